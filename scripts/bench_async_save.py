"""Blocking time of an asynchronous checkpoint save vs a memcpy of this rank's state and vs a
blocking save (interleaved, medians). Run under MPI, e.g.
  PYTHONPATH=$PWD mpiexec -n 2 .venv/bin/python scripts/bench_async_save.py --mb 16 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt

WORLD = MPI.COMM_WORLD


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=16, help="MiB of state per rank")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    size = WORLD.Get_size()
    mesh = dt.init_device_mesh("cpu", (size,))
    rows = args.mb * 2**20 // 8 // 256 * size
    state = {f"w{i}": dt.distribute_tensor(np.random.default_rng(i).random((rows // 4, 256)), mesh, [dt.Shard(0)])
             for i in range(4)}
    directory = WORLD.bcast(tempfile.mkdtemp() if WORLD.Get_rank() == 0 else None)
    path = os.path.join(directory, "ck.h5")
    times: dict[str, list[float]] = {"memcpy": [], "async (blocking part)": [], "async (to wait)": [],
                                     "blocking save": [], "compute alone": [], "compute beside the write": []}
    a = np.random.default_rng(0).random((128, 128))

    def compute() -> float:
        t = time.perf_counter()
        for _ in range(10):
            a @ a
        return time.perf_counter() - t

    for _ in range(args.reps):
        WORLD.Barrier()
        t = time.perf_counter()
        copies = [v.to_local().copy() for v in state.values()]
        times["memcpy"].append(time.perf_counter() - t)
        del copies
        WORLD.Barrier()
        t = time.perf_counter()
        h = dt.save(state, path, async_op=True)
        times["async (blocking part)"].append(time.perf_counter() - t)
        assert h is not None
        times["compute beside the write"].append(compute())  # a training step's NumPy work, GIL included
        h.wait()
        times["async (to wait)"].append(time.perf_counter() - t)
        times["compute alone"].append(compute())
        WORLD.Barrier()
        t = time.perf_counter()
        dt.save(state, path)
        times["blocking save"].append(time.perf_counter() - t)
    slowest = {k: max(WORLD.allgather(statistics.median(v))) for k, v in times.items()}
    if WORLD.Get_rank() == 0:
        print(f"{size} ranks, {args.mb} MiB per rank, h5py mpi={dt.has_parallel_hdf5()}, medians of {args.reps} "
              f"(slowest rank):")
        for k, v in slowest.items():
            print(f"  {k:24s} {v * 1e3:9.1f} ms")
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
        os.rmdir(directory)


if __name__ == "__main__":
    main()
