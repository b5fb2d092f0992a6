"""What a rank waiting in a collective costs the ranks still working, and what the wait's
back-off costs the collective (``mpiexec -n P python scripts/bench_waiters.py``).

Three ways to wait, interleaved in one run (so machine drift hits all alike):
  spin      the library's wait with the back-off off (``DTORCH_WAIT_SPIN`` huge: the loop
            before the back-off: Test, ``sched_yield`` every 16 polls)
  backoff   the library's wait as shipped (spin ``DTORCH_WAIT_SPIN`` µs, then naps growing to 1 ms;
            ``--spin`` tries another spin time)
  sleep     the reference "sleeping waiter": Test, then ``time.sleep(1 ms)``
  mpi       MPI's own blocking call (``Barrier`` / ``Allreduce`` / ``Allgather``)
Figures (medians over repeats; the slowest rank's time for collectives):
  work      rank 0 runs ~``--work-ms`` of NumPy while every other rank waits in an Ibarrier
            for it; the time of rank 0's work, and its ratio to the ``sleep`` waiters'
  1 KiB     latency of an Allreduce of 1 KiB, all ranks in step
  16 MiB    an Allgather of 16 MiB in all (each rank 16 MiB / P)
Say how busy the machine was (printed: the load average before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
from benchtools import numpy_work, timed_interleaved
from mpi4py import MPI

from dtorch_mpi import settings
from dtorch_mpi.comm.deadline import wait_request

WORLD = MPI.COMM_WORLD
SPIN_FOREVER = 1e15  # microseconds: the back-off never starts


def sleeping_wait(request: MPI.Request, what: str) -> None:
    while not request.Test():
        time.sleep(1e-3)


def library_wait(spin_micros: float) -> Callable[[MPI.Request, str], None]:
    def wait(request: MPI.Request, what: str) -> None:
        settings.put("DTORCH_WAIT_SPIN", spin_micros)
        wait_request(request, what)
    return wait




def work_time(wait: Callable[[MPI.Request, str], None] | None, work: Callable[[], object]) -> float:
    """Rank 0's time for ``work`` while the others wait in an Ibarrier (``wait`` None: the
    blocking Barrier)."""
    WORLD.Barrier()
    elapsed = 0.0
    if WORLD.Get_rank() == 0:
        start = time.perf_counter()
        work()
        elapsed = time.perf_counter() - start
    if wait is None:
        WORLD.Barrier()
    else:
        wait(WORLD.Ibarrier(), "barrier")
    return WORLD.bcast(elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-ms", type=float, default=40.0)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--spin", type=float, default=settings.SETTINGS["DTORCH_WAIT_SPIN"].parse(
        settings.SETTINGS["DTORCH_WAIT_SPIN"].default), help="the back-off's spin time, µs (default: the shipped one)")
    args = parser.parse_args()
    size = WORLD.Get_size()
    load_before = os.getloadavg()[0]
    work = numpy_work(args.work_ms * 1e-3)

    modes: dict[str, Callable[[MPI.Request, str], None] | None] = {
        "spin": library_wait(SPIN_FOREVER), "backoff": library_wait(args.spin), "sleep": sleeping_wait, "mpi": None}
    samples: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.reps):
        for name, wait in modes.items():
            samples[name].append(work_time(wait, work))
    work_median = {m: statistics.median(v) for m, v in samples.items()}

    small = np.ones(128, np.float64)  # 1 KiB
    small_out = np.empty_like(small)
    per_rank = (16 << 20) // size // 8
    big = np.ones(per_rank, np.float64)
    big_out = np.empty(per_rank * size, np.float64)

    def allreduce_with(wait: Callable[[MPI.Request, str], None] | None) -> Callable[[], None]:
        """50 Allreduces of 1 KiB in a row (one timing of 50 calls: sub-ms timings are noise)."""
        def run() -> None:
            for _ in range(50):
                if wait is None:
                    WORLD.Allreduce(small, small_out)
                else:
                    wait(WORLD.Iallreduce(small, small_out), "allreduce")
        return run

    def allgather_with(wait: Callable[[MPI.Request, str], None] | None) -> Callable[[], None]:
        if wait is None:
            return lambda: WORLD.Allgather(big, big_out)
        return lambda: wait(WORLD.Iallgather(big, big_out), "allgather")

    latency = timed_interleaved({m: allreduce_with(w) for m, w in modes.items()}, args.reps)
    bandwidth = timed_interleaved({m: allgather_with(w) for m, w in modes.items()}, args.reps)
    load_after = os.getloadavg()[0]
    if WORLD.Get_rank() == 0:
        print(f"ranks {size}; load average {load_before:.1f} before, {load_after:.1f} after; "
              f"{os.cpu_count()} cores")
        print(f"{'wait':8} {'work ms':>8} {'x sleep':>8} {'1 KiB µs':>9} {'16 MiB ms':>10}")
        for m in modes:
            print(f"{m:8} {work_median[m] * 1e3:8.2f} {work_median[m] / work_median['sleep']:8.2f} "
                  f"{latency[m] / 50 * 1e6:9.1f} {bandwidth[m] * 1e3:10.2f}")


if __name__ == "__main__":
    main()
