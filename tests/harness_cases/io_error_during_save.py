"""Fault injection, run by tests/test_faults.py: save checkpoint A, then make the second
write of a save over it report an I/O error on one rank only (the last, or without MPI in h5py
the host's writer; after the write itself completed, as an ENOSPC from MPI-IO does). Every rank must raise
CheckpointError, A must stay bit for bit, and the temporary file must be gone. Not a pytest file."""

import os
import sys

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.checkpoint import writer as ck

path = sys.argv[1]
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
mesh = dt.init_device_mesh("cpu", (size,))
state = {f"layer{i}.w": dt.distribute_tensor(np.full((9, 4), float(i)), mesh, [dt.Shard(0)]) for i in range(3)}
dt.save(state, path)
before = open(path, "rb").read() if rank == 0 else b""
real, calls = ck._write_slab, [0]


# the failing rank: the last (collective MPI-IO), or without MPI in h5py the one writer of this
# host (each node's lowest rank writes its node's pieces: checkpoint/funnel.py)
failing = size - 1 if dt.has_parallel_hdf5() else 0


def write_then_fail(*args, **kwargs):
    real(*args, **kwargs)
    calls[0] += 1
    if rank == failing and calls[0] == 2:
        raise OSError(28, "No space left on device (injected)")


ck._write_slab = write_then_fail
for v in state.values():
    v.to_local()[...] = -1.0
try:
    dt.save(state, path)
except dt.CheckpointError as exc:
    assert "No space left on device" in str(exc), exc
    print(f"rank {rank} raised CheckpointError", flush=True)
ck._write_slab = real
world.Barrier()
if rank == 0:
    assert open(path, "rb").read() == before, "the previous checkpoint changed"
    left = sorted(os.listdir(os.path.dirname(path)))
    assert left == [os.path.basename(path)], left
    print("previous checkpoint intact", flush=True)
