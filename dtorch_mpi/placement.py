"""Placement types: how a tensor lives along one mesh dimension."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base of ``Shard``, ``Replicate`` and ``Partial``; immutable and hashable."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Split tensor dim ``dim`` over the ranks of the mesh dim (balanced, uneven allowed)."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) needs an int tensor dim, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank of the mesh dim holds the full value."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Each rank holds a term; the value is their reduction by ``reduce_op``."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(
                f"Partial(reduce_op={self.reduce_op!r}) is not supported; "
                f"use one of {', '.join(REDUCE_OPS)}"
            )

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f'Partial("{self.reduce_op}")'


def normalize_placements(
    placements: Sequence[Placement] | Placement, mesh_ndim: int, tensor_ndim: int
) -> tuple[Placement, ...]:
    """Check ``placements`` against the mesh and tensor ranks; resolve negative shard dims.

    Raises ``PlacementError`` naming the wrong entry and how to fix it. Pure: no communication.
    """
    from .errors import PlacementError

    if isinstance(placements, Placement):
        placements = (placements,)
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise PlacementError(
            f"got {len(placements)} placements {list(placements)} for a {mesh_ndim}-D mesh; "
            f"give exactly one placement per mesh dim"
        )
    result = []
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise PlacementError(
                f"placement {p!r} at mesh dim {mesh_dim} is not a Shard, Replicate or Partial"
            )
        if isinstance(p, Shard):
            d = p.dim + tensor_ndim if p.dim < 0 else p.dim
            if not 0 <= d < tensor_ndim:
                raise PlacementError(
                    f"{p!r} at mesh dim {mesh_dim} is out of range for a {tensor_ndim}-D tensor; "
                    f"use a dim in [{-tensor_ndim}, {tensor_ndim - 1}]"
                    if tensor_ndim
                    else f"{p!r} at mesh dim {mesh_dim}: a 0-D tensor cannot be sharded; "
                    f"use Replicate() or Partial()"
                )
            p = Shard(d)
        result.append(p)
    return tuple(result)


@lru_cache(maxsize=1024)
def _normalized_tuple(placements: tuple[Placement, ...], mesh_ndim: int, ndim: int) -> tuple[Placement, ...]:
    return normalize_placements(placements, mesh_ndim, ndim)


def normalized_placements(placements: Sequence[Placement] | Placement, mesh_ndim: int,
                          ndim: int) -> tuple[Placement, ...]:
    """``normalize_placements``, cached per (placements, mesh ndim, tensor ndim): from_local and
    redistribute normalise the same few placements on every call."""
    if isinstance(placements, Placement):
        placements = (placements,)
    try:
        return _normalized_tuple(tuple(placements), mesh_ndim, ndim)
    except TypeError:  # unhashable entries: let normalize_placements name the problem
        return normalize_placements(placements, mesh_ndim, ndim)
