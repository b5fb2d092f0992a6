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
