"""The range check of integer indices (class targets, embedding rows), agreed across ranks."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..spmd import agreed


def require_in_range(what: str, values: Any, bound: int, comm: MPI.Intracomm | None) -> None:
    """Raise ``IndexError`` on every rank of ``comm`` unless every value is in ``[0, bound)``
    (``comm`` None: every rank holds the same values, so each reaches the same verdict alone)."""
    with agreed(comm):
        if values.size:
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= bound:
                raise IndexError(f"{what} out of range [0, {bound}) (got {low}..{high})")
