"""Blocking time of an asynchronous checkpoint save vs a memcpy of this rank's state and vs a
blocking save (interleaved, medians), and how much the write slows the work beside it: NumPy
work (128 x 128 products for about ``--offcore-ms``: the core and the GIL) and off-core work (``--offcore-ms`` of
``time.sleep`` in 2 ms slices, as a loop waiting on GPU kernels: only the GIL between them),
each alone and while an async save writes, in turn first. One BLAS thread per rank (as the other
step benchmarks): BLAS threads left spinning by the NumPy work took the cores from the off-core
work after it. Run under MPI, e.g.
  PYTHONPATH=$PWD mpiexec -n 2 .venv/bin/python scripts/bench_async_save.py --mb 16 --reps 5
"""

from __future__ import annotations

# ruff: noqa: E402  (the BLAS thread count must be set before NumPy is imported)
import argparse
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one core per rank: BLAS threads
    os.environ.setdefault(_var, "1")  # left spinning by the NumPy work slowed the off-core work after it (+17 to +40 %)
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
from benchtools import process_environment
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi import settings

WORLD = MPI.COMM_WORLD


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=16, help="MiB of state per rank")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--offcore-ms", type=float, default=40.0, help="off-core work beside the write (2 ms sleeps)")
    args = ap.parse_args()
    size = WORLD.Get_size()
    mesh = dt.init_device_mesh("cpu", (size,))
    rows = args.mb * 2**20 // 8 // 256 * size
    state = {f"w{i}": dt.distribute_tensor(np.random.default_rng(i).random((rows // 4, 256)), mesh, [dt.Shard(0)])
             for i in range(4)}
    directory = WORLD.bcast(tempfile.mkdtemp() if WORLD.Get_rank() == 0 else None)
    path = os.path.join(directory, "ck.h5")
    times: dict[str, list[float]] = {"memcpy": [], "async (blocking part)": [], "async (to wait)": [],
                                     "blocking save": [], "compute alone": [], "compute beside the write": [],
                                     "off-core alone": [], "off-core beside the write": []}
    a = np.random.default_rng(0).random((128, 128))
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    products = WORLD.bcast(max(1, round(20 * args.offcore_ms * 1e-3 / (time.perf_counter() - t))))

    def compute() -> float:  # about --offcore-ms of small products: the core and the GIL between them
        t = time.perf_counter()
        for _ in range(products):
            a @ a
        return time.perf_counter() - t

    def offcore() -> float:
        t = time.perf_counter()
        for _ in range(max(1, round(args.offcore_ms / 2))):
            time.sleep(0.002)
        return time.perf_counter() - t

    def alone_and_beside(work: Callable[[], float], name: str, rep: int) -> None:
        """``work`` alone and beside an async save, in turn first (what runs before a window, a
        write's end or other work, is then the same for both on average)."""
        for beside in ((True, False) if rep % 2 else (False, True)):
            WORLD.Barrier()
            if not beside:
                times[f"{name} alone"].append(work())
                continue
            t = time.perf_counter()
            h = dt.save(state, path, async_op=True)
            times["async (blocking part)"].append(time.perf_counter() - t)
            assert h is not None
            times[f"{name} beside the write"].append(work())
            h.wait()
            times["async (to wait)"].append(time.perf_counter() - t)

    for rep in range(args.reps):
        WORLD.Barrier()
        t = time.perf_counter()
        copies = [v.to_local().copy() for v in state.values()]
        times["memcpy"].append(time.perf_counter() - t)
        del copies
        alone_and_beside(compute, "compute", rep)  # a training step's NumPy work, GIL included
        alone_and_beside(offcore, "off-core", rep)
        WORLD.Barrier()
        t = time.perf_counter()
        dt.save(state, path)
        times["blocking save"].append(time.perf_counter() - t)
    slowest = {k: max(WORLD.allgather(statistics.median(v))) for k, v in times.items()}
    if WORLD.Get_rank() == 0:
        print(f"{size} ranks, {args.mb} MiB per rank, h5py mpi={dt.has_parallel_hdf5()}, medians of {args.reps} "
              f"(slowest rank); {process_environment()}; OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}; "
              f"DTORCH_SAVE_NICE={settings.get('DTORCH_SAVE_NICE')}:")
        for k, v in slowest.items():
            print(f"  {k:26s} {v * 1e3:9.1f} ms")
        goal = 1.2 * slowest["memcpy"] + 0.05
        print(f"  blocking part / (1.2 memcpy + 50 ms) = {slowest['async (blocking part)'] / goal:.2f}; slowdown "
              f"beside the write: NumPy {slowest['compute beside the write'] / slowest['compute alone'] - 1:+.0%}, "
              f"off-core {slowest['off-core beside the write'] / slowest['off-core alone'] - 1:+.0%}; "
              f"load {os.getloadavg()[0]:.1f}")
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
        os.rmdir(directory)


if __name__ == "__main__":
    main()
