"""Counting what moved: every collective records its kind, mesh dim and payload bytes."""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from .. import settings

_active: list["CommCounter"] = []
on_started: Callable[[Any, bool], Any] | None = None
"""While a trace is on (dtorch_mpi/timeline.py): called with each started collective's handle
(and whether it is nonblocking) right after the record; returns the handle to use."""


@dataclass(frozen=True)
class CommRecord:
    """One collective call on this rank. Bytes are payload (padding excluded).

    ``bytes_sent``/``bytes_recv``: what this rank contributed to / got from the other ranks
    (all-gather: its piece / the others' pieces; all-to-all: blocks for / from the others;
    reduce-scatter: its terms of the others' blocks / the others' terms of its block;
    all-reduce: the buffer both ways; broadcast and scatter: what the root sends / a rank gets).
    """

    kind: str
    mesh_dim: int | None
    bytes_sent: int
    bytes_recv: int
    padded: bool
    nonblocking: bool


class CommCounter:
    """``with CommCounter() as c:`` records every collective run inside the block (nestable)."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> "CommCounter":
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.remove(self)

    @property
    def count(self) -> int:
        return len(self.records)

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    @property
    def bytes_recv(self) -> int:
        return sum(r.bytes_recv for r in self.records)

    def kinds(self) -> list[str]:
        return [r.kind for r in self.records]

    def summary(self) -> dict[tuple[str, int | None], tuple[int, int, int]]:
        """``(kind, mesh_dim) -> (count, bytes_sent, bytes_recv)``."""
        table: dict[tuple[str, int | None], list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in self.records:
            row = table[(r.kind, r.mesh_dim)]
            row[0] += 1
            row[1] += r.bytes_sent
            row[2] += r.bytes_recv
        return {k: (v[0], v[1], v[2]) for k, v in table.items()}

    def table(self) -> str:
        """A readable per-collective table (kind, mesh dim, count, bytes)."""
        rows = [("collective", "mesh dim", "count", "bytes sent", "bytes recv")]
        for (kind, dim), (n, sent, recv) in sorted(
            self.summary().items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1])
        ):
            rows.append((kind, "-" if dim is None else str(dim), str(n), f"{sent:,}", f"{recv:,}"))
        rows.append(("total", "", str(self.count), f"{self.bytes_sent:,}", f"{self.bytes_recv:,}"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                           enumerate(zip(row, widths))) for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def print(self, file: IO[str] | None = None) -> None:
        print(self.table(), file=file or sys.stdout)


def record(
    kind: str, mesh_dim: int | None, sent: int, recv: int, padded: bool, nonblocking: bool
) -> None:
    if _active:
        rec = CommRecord(kind, mesh_dim, int(sent), int(recv), padded, nonblocking)
        for counter in _active:
            counter.records.append(rec)


def _install_from_environment() -> None:
    """``DTORCH_COMM_REPORT=1``: count the whole script and print the table at exit (rank 0)."""
    if settings.get("DTORCH_COMM_REPORT"):
        import atexit

        from mpi4py import MPI

        counter = CommCounter().__enter__()

        def report() -> None:
            if MPI.COMM_WORLD.Get_rank() == 0:
                print("dtorch_mpi communication (rank 0):", file=sys.stderr)
                counter.print(sys.stderr)

        atexit.register(report)


_install_from_environment()
