"""Index arithmetic shared by the backends: (outer, axis, inner) views and block offsets."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod


def view3(shape: Sequence[int], axis: int) -> tuple[int, int, int]:
    """``(prod(shape[:axis]), shape[axis], prod(shape[axis+1:]))``."""
    return prod(shape[:axis]), shape[axis], prod(shape[axis + 1 :])


def offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def with_dim(shape: Sequence[int], axis: int, length: int) -> tuple[int, ...]:
    return tuple(length if i == axis else n for i, n in enumerate(shape))
