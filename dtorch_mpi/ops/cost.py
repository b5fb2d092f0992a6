"""What a redistribute costs, from metadata only: the bytes its plan moves and the piece it
leaves on each rank. Used to choose the cheapest fix a PlacementError suggests.

The plan is ``plan_redistribute``'s step list (the steps ``compile_plan`` compiles for each
rank), costed from the global shape, dtype and mesh dim sizes at mesh coordinate 0, whose
piece the split rule makes the largest. So the cost is the same number on every rank.
Bytes are those one rank receives: an all-gather, an all-to-all and a whole-mesh exchange
exactly the part of the new piece it did not hold (the piece less its overlap with the old
one: an all-to-all's own block stays), ring algorithms for the reductions (an all-reduce
2(m-1)/m of the piece, a reduce-scatter (m-1)/m of it); a local slice and
``Replicate -> Partial`` move nothing.
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

from ..placement import Placement
from ..redistribute import plan_redistribute
from ..redistribute.planner import exchanges_directly
from ..redistribute.traffic import overlap
from ..spec import DTensorSpec
from ..split import local_shape_and_offset


class Cost(NamedTuple):
    moved: int
    """Bytes one rank receives over the whole plan."""
    resident: int
    """Bytes of the piece each rank holds afterwards (the largest piece)."""

    @property
    def total(self) -> int:
        return self.moved + self.resident


def piece_bytes(spec: DTensorSpec, placements: tuple[Placement, ...]) -> int:
    """Bytes of the largest piece (mesh coordinate 0) of ``spec`` placed as ``placements``."""
    mesh_shape = tuple(spec.mesh.shape)
    shape = local_shape_and_offset(spec.shape, mesh_shape, placements, (0,) * len(mesh_shape))[0]
    return prod(shape) * spec.dtype.itemsize


def _received(spec: DTensorSpec, kind: str, m: int, before: tuple[Placement, ...],
              after: tuple[Placement, ...]) -> int:
    """Bytes mesh coordinate 0 receives in one step from ``before`` to ``after``."""
    mesh_shape = tuple(spec.mesh.shape)
    coord = (0,) * len(mesh_shape)
    old = local_shape_and_offset(spec.shape, mesh_shape, before, coord)
    new = local_shape_and_offset(spec.shape, mesh_shape, after, coord)
    item = spec.dtype.itemsize
    ring = {"all_reduce": 2 * (m - 1), "reduce_scatter": m - 1}.get(kind)
    if ring is not None:
        return prod(old[0]) * item * ring // m
    if kind in ("all_gather", "all_to_all", "exchange"):
        return (prod(new[0]) - overlap(old, new)) * item
    return 0


def redistribute_cost(spec: DTensorSpec, target: tuple[Placement, ...]) -> Cost:
    """The cost of ``redistribute(placements=target)`` on a tensor described by ``spec``."""
    current = spec.placements
    if spec.mesh.ndim > 1 and exchanges_directly(current, target):  # the executor's choice (MPI backends)
        return Cost(_received(spec, "exchange", spec.mesh.size(), current, target), piece_bytes(spec, target))
    moved = 0
    for step in plan_redistribute(current, target):
        after = current[: step.mesh_dim] + (step.dst,) + current[step.mesh_dim + 1 :]
        moved += _received(spec, step.kind, spec.mesh.shape[step.mesh_dim], current, after)
        current = after
    return Cost(moved, piece_bytes(spec, target))


__all__ = ["Cost", "piece_bytes", "redistribute_cost"]
