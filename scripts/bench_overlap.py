#!/usr/bin/env python3
"""Does an async gather overlap with local work? (issue 13, item 13)

Under mpiexec. For each size, a ``to_torch_async()`` of an S(0) float64 vector (the output is
SIZE MB on every rank) beside local work calibrated to take as long as the gather alone.
Cases, interleaved repeat by repeat, medians of the slowest rank:
  comm          the blocking gather alone (``to_torch()``)
  work          the work alone
  block+work    blocking gather, then the work
  async/off     ``to_torch_async()``, the work, ``wait()``; no background progress
  async/thread  the same with the progress thread (comm/progress.py)
Two kinds of work: ``numpy`` (np.sin over an array: needs this rank's core, like the copy
MPI makes for a shared-memory transfer) and ``offcore`` (time.sleep: the stand-in for work
that leaves the core free: a GPU kernel, file I/O, a transfer carried by a network card).
``comm cpu`` is the CPU time the process spends in the blocking gather (time.process_time):
with numpy work no schedule can beat ``comm cpu + work`` on a rank that has one core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
from benchtools import numpy_work, timed, timed_interleaved
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.comm.progress import set_progress_mode

WORLD = MPI.COMM_WORLD


def cpu_seconds(fn: Callable[[], object], reps: int) -> float:
    samples = []
    for _ in range(reps):
        WORLD.Barrier()
        start = time.process_time()
        fn()
        samples.append(WORLD.allreduce(time.process_time() - start, op=MPI.MAX))
    return statistics.median(samples)


def async_then(work: Callable[[], object], x: dt.DTensor, mode: str) -> Callable[[], object]:
    def run() -> object:
        handle = x.to_torch_async()
        work()
        return handle.wait()

    def case() -> object:
        set_progress_mode(mode)
        return run()

    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="16,64", help="output MB per rank")
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    mesh = dt.init_device_mesh("cpu", (WORLD.size,))
    if WORLD.rank == 0:
        print(f"{WORLD.size} ranks, {os.cpu_count()} cores, MPI thread level "
              f"{'MULTIPLE' if MPI.Query_thread() == MPI.THREAD_MULTIPLE else MPI.Query_thread()}, "
              f"load before {os.getloadavg()[0]:.2f}")
        print(f"{'MB':>4} {'work':>7} {'comm ms':>8} {'comm cpu':>8} {'work ms':>8} {'block+work':>10} "
              f"{'async/off':>9} {'async/thread':>12} {'thread/max':>10} {'floor/max':>9}")
    for mb in (int(s) for s in args.sizes.split(",")):
        full = np.random.default_rng(2).random((mb << 20) // 8)
        x = dt.distribute_tensor(full, mesh, [dt.Shard(0)])
        gather = x.to_torch
        comm = timed(gather, args.reps)
        comm_cpu = cpu_seconds(gather, args.reps)
        for kind, work in (("numpy", numpy_work(comm)), ("offcore", lambda: time.sleep(comm))):
            cases = {
                "comm": gather,
                "work": work,
                "block+work": lambda: (gather(), work()),
                "async/off": async_then(work, x, "off"),
                "async/thread": async_then(work, x, "thread"),
            }
            med = {name: t * 1e3 for name, t in timed_interleaved(cases, args.reps, WORLD).items()}
            longest = max(med["comm"], med["work"])
            floor = med["work"] + (comm_cpu * 1e3 if kind == "numpy" else 0.0)
            if WORLD.rank == 0:
                print(f"{mb:>4} {kind:>7} {med['comm']:8.2f} {comm_cpu * 1e3:8.2f} {med['work']:8.2f} "
                      f"{med['block+work']:10.2f} {med['async/off']:9.2f} {med['async/thread']:12.2f} "
                      f"{med['async/thread'] / longest:9.2f}x {max(floor, longest) / longest:8.2f}x")
    set_progress_mode("thread")
    if WORLD.rank == 0:
        print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
