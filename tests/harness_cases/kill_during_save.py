"""Fault injection, run by tests/test_faults.py: save checkpoint A, then SIGKILL a rank in the
middle of saving B over it (rank 1; in the writer thread of an async save, a rank that writes).
Not a pytest file."""

import os
import shutil
import signal
import sys

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.checkpoint import writer as ck

path = sys.argv[1]
rank = MPI.COMM_WORLD.Get_rank()
mesh = dt.init_device_mesh("cpu", (MPI.COMM_WORLD.Get_size(),))
state = {f"layer{i}.w": dt.distribute_tensor(np.full((9, 4), float(i)), mesh, [dt.Shard(0)]) for i in range(3)}
dt.save(state, path)
if rank == 0:
    shutil.copyfile(path, path + ".A")
MPI.COMM_WORLD.Barrier()

asynchronous = sys.argv[2:] == ["async"]  # then the kill comes in the writer thread, mid-file
name = "_write_slab" if asynchronous else "_writer_piece"
real, calls = getattr(ck, name), [0]


# without MPI in h5py only each node's lowest rank writes (checkpoint/funnel.py): kill the writer
victim = 0 if asynchronous and not dt.has_parallel_hdf5() else 1


def write_then_die(*args, **kwargs):
    calls[0] += 1
    if rank == victim and calls[0] == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)


setattr(ck, name, write_then_die)
for v in state.values():
    v.to_local()[...] = -1.0
handle = dt.save(state, path, async_op=asynchronous)
if handle is not None:
    handle.wait()
print("the save finished: the kill did not happen", flush=True)
