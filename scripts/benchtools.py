"""Timing shared by the benchmark scripts (run as `python scripts/NAME.py`, so importable)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI


def timed(fn: Callable[[], Any], reps: int, comm: MPI.Intracomm = MPI.COMM_WORLD, *,
          warmup: bool = True, after: Callable[[], Any] | None = None) -> float:
    """Median over ``reps`` calls of the slowest rank's time, ranks starting together.
    ``after`` runs inside the timed region (a barrier, a GPU stream synchronize)."""
    if warmup:
        fn()
        if after is not None:
            after()
    times = []
    for _ in range(reps):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        if after is not None:
            after()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return statistics.median(times)


def timed_interleaved(fns: dict[str, Callable[[], Any]], reps: int,
                      comm: MPI.Intracomm = MPI.COMM_WORLD) -> dict[str, float]:
    """Median (slowest rank) of each of ``fns``, run in rotation within every repeat, so a
    load change on a busy machine hits all of them alike (one warm-up call each first)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            comm.Barrier()
            start = time.perf_counter()
            fn()
            times[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return {name: statistics.median(t) for name, t in times.items()}
