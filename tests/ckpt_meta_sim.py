"""Checkpoint metadata at simulated rank counts (issue 27 item 2): each rank's metadata exchanges
(pieces.exchange for a save, checksum.reduced_sums for a load) run on a stand-in communicator
of any size, with their buffers' peak bytes (tracemalloc: NumPy reports its allocations) and
CPU time measured on one process. ``SimComm`` fills the receive buffers as if ``writers``
ranks held this rank's values (the rest wrote nothing), so the work done on them (sums, tables)
is the real work. ``before_save`` / ``before_load`` are the exchanges the checkpoint made until
the fix (one Allgather of ranks x datasets words and a Python sum per dataset), kept here only
as the baseline the figures compare with."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from standin_comm import DoneRequest, StandInComm

from dtorch_mpi.checkpoint import pieces
from dtorch_mpi.checkpoint.checksum import MASK, combine, reduced_sums

_DONE = DoneRequest()


class SimComm(StandInComm):
    """A stand-in of ``size`` ranks whose first ``writers`` ranks hold this rank's values:
    Allreduce SUM gives ``writers`` times the send buffer (mod 2**64), Allgather gives this
    rank's block in the first ``writers`` slots and zeros after, Allgatherv this rank's block
    once per non-empty count."""

    def __init__(self, size: int, writers: int | None = None) -> None:
        super().__init__(size)
        self.writers = size if writers is None else writers

    def Iallreduce(self, send: Any, recv: Any, op: Any = None) -> DoneRequest:
        super().Iallreduce(send, recv, op)
        np.multiply(send, np.array(self.writers, dtype=send.dtype), out=recv)
        return _DONE

    def Iallgather(self, send: Any, recv: Any) -> DoneRequest:
        self.calls["Iallgather"] += 1
        recv = recv.reshape(self.size, -1)
        recv[: self.writers] = np.asarray(send).reshape(1, -1)
        recv[self.writers :] = 0
        return _DONE

    def Iallgatherv(self, send: Any, spec: Any) -> DoneRequest:
        self.calls["Iallgatherv"] += 1
        recv, (counts, displs), _ = spec
        flat, block = recv.reshape(-1), np.asarray(send).reshape(-1)
        for count, displ in zip(counts, displs):
            if count:
                flat[displ : displ + count] = block
        return _DONE


def measured(run: Callable[[], Any]) -> tuple[Any, int, float]:
    """``run()``'s result, the peak bytes it allocated (tracemalloc) and its CPU seconds (timed
    in a second, untraced run: tracing slows every allocation, the Python sums' most of all)."""
    tracemalloc.start()
    try:
        out = run()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    t0 = time.process_time()
    run()
    return out, peak, time.process_time() - t0


def sharded_owns(p: int, datasets: int, rows: int = 3) -> list[pieces.Own]:
    """Rank 0's parts of ``datasets`` 2-d tensors Shard(0) over ``p`` ranks (``p`` pieces each),
    with lin64 terms as large as real ones (a Python sum of small ints would be unduly fast)."""
    data = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    return [pieces.Own(big_term(k), 2, ((0, 0), (rows, 4), data)) for k in range(datasets)]


def big_term(k: int) -> int:
    """A 64-bit lin64-like term for dataset ``k``."""
    return (k + 1) * 0x9E3779B97F4A7C15 & MASK


def save_after(p: int, owns: Sequence[pieces.Own], writers: int | None = None) -> list[pieces.Summary]:
    return pieces.exchange(SimComm(p, writers), owns)


def load_after(p: int, datasets: int) -> list[int]:
    terms = [big_term(k) for k in range(datasets)] + [1] * datasets  # a lin64 term and a copies count per dataset
    return reduced_sums(SimComm(p), terms)


def before_save(p: int, owns: Sequence[pieces.Own]) -> list[tuple[int, np.ndarray | None]]:
    """The save's exchange before the fix: every rank's ``[term, written, *offset, *shape,
    digest]`` per dataset in one Allgather, a Python sum per dataset, every table built."""
    from dtorch_mpi.checkpoint.checksum import digest

    records = []
    for own in owns:
        row = np.zeros(3 + 2 * own.ndim, dtype=np.uint64)
        row[0] = own.term
        if own.piece is not None:
            row[1 : 2 + 2 * own.ndim] = [1, *own.piece[0], *own.piece[1]]
            row[-1] = digest(own.piece[2])
        records.append(row)
    world = SimComm(p)
    mine = np.concatenate([np.zeros(0, np.uint64), *records])
    every = np.empty((p, mine.size), dtype=np.uint64)
    world.Iallgather(mine, every)
    out, start = [], 0
    for rec in records:
        block = every[:, start : start + rec.size]
        start += rec.size
        found = block[block[:, 1] == 1, 2:]
        out.append((combine(block[:, 0]), np.ascontiguousarray(found) if len(found) else None))
    return out


def before_load(p: int, datasets: int) -> list[int]:
    """The load's exchange before the fix: every rank's terms and status in one Allgather."""
    world = SimComm(p)
    mine = np.array([0, *(big_term(k) for k in range(datasets)), *[1] * datasets], dtype=np.uint64)
    every = np.empty((p, mine.size), dtype=np.uint64)
    world.Iallgather(mine, every)
    return [combine(every[:, n]) for n in range(1, mine.size)]


def expected_sum(term: int, writers: int) -> int:
    return term * writers & MASK
