#!/usr/bin/env python3
"""Short GPU benchmark: redistribute of CuPy pieces vs the raw collective of the same bytes.

Run under mpiexec on a GPU machine (scripts/gpu_check.sh does). The raw baseline is what the
selected backend does by hand: host staging (device -> host -> MPI -> device), or NCCL /
CUDA-aware MPI on device buffers.
"""

from __future__ import annotations

import cupy
import numpy as np
from benchtools import timed
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.comm import backend_for

WORLD = MPI.COMM_WORLD


def main() -> None:
    m = WORLD.Get_size()
    mesh = dt.init_device_mesh("cuda", (m,))
    name = backend_for("cuda").name
    if WORLD.Get_rank() == 0:
        print(f"ranks={m} backend={name} device={cupy.cuda.Device().id}")
        print(f"{'case':<18} {'shape':>13} {'dtorch ms':>10} {'raw ms':>9} {'ratio':>6}")
    for shape in ((4096, 1024), (4099, 1023)):
        full = cupy.ones(shape, dtype=cupy.float32)
        x = dt.distribute_tensor(full, mesh, [dt.Shard(0)], src_data_rank=None)
        p = dt.distribute_tensor(full, mesh, [dt.Partial()], src_data_rank=None)
        piece = x.to_local()
        rows = max(dt.split.split_sizes(shape[0], m))

        def raw_gather() -> None:
            host = np.zeros((rows, shape[1]), np.float32)
            host[: piece.shape[0]] = cupy.asnumpy(piece)
            out = np.empty((m * rows, shape[1]), np.float32)
            WORLD.Allgather(host, out)
            cupy.asarray(out)

        def raw_reduce() -> None:
            host = cupy.asnumpy(p.to_local())
            out = np.empty_like(host)
            WORLD.Allreduce(host, out)
            cupy.asarray(out)

        for case, ours, raw in (("S(0)->R", lambda: x.redistribute(placements=[dt.Replicate()]), raw_gather),
                                ("P->R", lambda: p.redistribute(placements=[dt.Replicate()]), raw_reduce)):
            sync = cupy.cuda.get_current_stream().synchronize
            t, r = timed(ours, 10, after=sync), timed(raw, 10, after=sync)
            if WORLD.Get_rank() == 0:
                print(f"{case:<18} {shape!s:>13} {t * 1e3:>10.3f} {r * 1e3:>9.3f} {t / r:>6.2f}")
    mesh.free()


if __name__ == "__main__":
    main()
