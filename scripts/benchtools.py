"""Timing shared by the benchmark scripts (run as `python scripts/NAME.py`, so importable)."""

from __future__ import annotations

import dtorch_mpi  # noqa: F401  (before mpi4py starts MPI: the import sets UCX_RNDV_THRESH, dtorch_mpi/ucx.py)

# isort: split
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from dtorch_mpi.comm.deadline import wait_request


def process_environment() -> str:
    """What shapes the process's allocator (``GLIBC_TUNABLES``, ``LD_PRELOAD``, the library's
    opt-in tuning of dtorch_mpi/heap.py): a NumPy step with MB-sized arrays runs up to 2x apart
    with glibc's defaults and with tuned thresholds (docs/performance.md, "Page faults"), so
    every step benchmark prints it; with UCX's rendezvous threshold (dtorch_mpi/ucx.py), which
    decides how fast a collective between hosts finishes beside compute, and the buffer pool's
    cap: buffers from 32 MiB (glibc's largest mmap threshold) that it cannot keep are mapped and
    faulted in afresh at every use."""
    from dtorch_mpi import heap, ucx
    from dtorch_mpi.comm import pool

    env = {k: os.environ[k] for k in ("GLIBC_TUNABLES", "LD_PRELOAD") if k in os.environ}
    shown = ", ".join(f"{k}={v}" for k, v in env.items()) or "glibc defaults"
    rndv = os.environ.get(ucx.VARIABLE, "UCX's own")
    return (f"{shown}; DTORCH_MALLOC_TUNING: {heap.state}; {ucx.VARIABLE}={rndv} ({ucx.state}); "
            f"DTORCH_BUFFER_POOL_BYTES={pool.pool_cap() >> 20} MiB")


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


def aligned_empty(shape: int | tuple[int, ...], dtype: object) -> np.ndarray:
    """A fresh array starting at a page boundary, as the library's pooled buffers do (a copy
    runs 1.75x slower here when its destination is 16-48 bytes past its source modulo 4096, so
    buffers wherever the heap puts them make a baseline's speed a matter of chance)."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape))
    raw = np.empty(count * dt.itemsize + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start : start + count * dt.itemsize].view(dt).reshape(shape)


def aligned_copy(a: np.ndarray) -> np.ndarray:
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


EVICT_BYTES = 48 << 20
"""Written before each timed call when ``cold``: more than this machine's 32 MiB last-level cache."""
_scratch: list[np.ndarray] = []


def evict_caches() -> None:
    """Overwrite a buffer larger than the last-level cache, so the next call starts cold."""
    if not _scratch:
        _scratch.append(np.zeros(EVICT_BYTES, np.uint8))
    _scratch[0] += 1


def timed_interleaved(fns: dict[str, Callable[[], Any]], reps: int,
                      comm: MPI.Intracomm = MPI.COMM_WORLD, *, caches: str = "shared",
                      polled: bool = False) -> dict[str, float]:
    """Median (slowest rank) of each of ``fns``, run in rotation within every repeat, so a
    load change on a busy machine hits all of them alike (one warm-up call each first).
    ``caches``: "shared" runs each call straight after the previous case's; "primed" runs an
    untimed call of the same case first (each case's own buffers and code warm, as in a loop
    repeating one call; otherwise a case whose buffers others share, such as a raw baseline's one
    send buffer, runs warm while the rest run cold); "cold" flushes the caches first.
    ``polled``: the barrier before each call and the time's reduction after it wait as the
    library's waits do (comm/deadline.py: a short spin, then yields and naps), not in MPI's
    blocking calls, which spin on the core: a case that leaves a collective in flight past its
    end (fully_shard's prefetch after the optimizer step) then gets the cores to progress it,
    as it would beside the next batch's load, where ranks outnumber cores."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if caches == "primed":
                fn()
            elif caches == "cold":
                evict_caches()
            _barrier(comm, polled)
            start = time.perf_counter()
            fn()
            times[name].append(_slowest(comm, time.perf_counter() - start, polled))
    return {name: statistics.median(t) for name, t in times.items()}


def _barrier(comm: MPI.Intracomm, polled: bool) -> None:
    if polled:
        wait_request(comm.Ibarrier(), "the benchmark's barrier")
    else:
        comm.Barrier()


def _slowest(comm: MPI.Intracomm, seconds: float, polled: bool) -> float:
    if not polled:
        return float(comm.allreduce(seconds, op=MPI.MAX))
    mine, out = np.array([seconds]), np.empty(1)
    wait_request(comm.Iallreduce(mine, out, op=MPI.MAX), "the benchmark's time reduction")
    return float(out[0])


def numpy_work(seconds: float, probe_len: int = 1 << 18, reps: int = 11,
               comm: MPI.Intracomm = MPI.COMM_WORLD) -> Callable[[], object]:
    """np.sin over an array sized (on rank 0, then shared) to take ``seconds``: compute that
    needs this rank's core (``seconds <= 0``: nothing)."""
    if seconds <= 0:
        return lambda: None
    probe = np.random.default_rng(0).random(probe_len)
    out = np.empty_like(probe)
    per = timed(lambda: np.sin(probe, out=out), reps, comm) / probe.size
    n = comm.bcast(max(1, int(seconds / per)))
    data = np.random.default_rng(1).random(n)
    result = np.empty_like(data)
    return lambda: np.sin(data, out=result)
