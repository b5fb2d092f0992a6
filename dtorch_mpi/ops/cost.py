"""What a redistribute costs, from metadata only: the bytes its plan moves and the piece it
leaves on each rank. Used to choose the cheapest fix a PlacementError suggests.

The plan is ``plan_redistribute``'s step list (the steps ``compile_plan`` compiles for each
rank), costed from the global shape, dtype and mesh dim sizes at mesh coordinate 0, whose
piece the split rule makes the largest. So the cost is the same number on every rank.
Bytes are those one rank receives (ring algorithms): an all-gather the part of the target
piece it lacks, an all-reduce 2(m-1)/m of the piece, a reduce-scatter and an all-to-all
(m-1)/m of it; a local slice and ``Replicate -> Partial`` move nothing.
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

from ..placement import Placement
from ..redistribute import plan_redistribute
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


def _step_bytes(kind: str, m: int, before: int, after: int) -> int:
    return {
        "all_gather": after - before,
        "all_to_all": before * (m - 1) // m,
        "all_reduce": 2 * before * (m - 1) // m,
        "reduce_scatter": before * (m - 1) // m,
    }.get(kind, 0)


def redistribute_cost(spec: DTensorSpec, target: tuple[Placement, ...]) -> Cost:
    """The cost of ``redistribute(placements=target)`` on a tensor described by ``spec``."""
    current = spec.placements
    moved = 0
    for step in plan_redistribute(current, target):
        after = current[: step.mesh_dim] + (step.dst,) + current[step.mesh_dim + 1 :]
        moved += _step_bytes(step.kind, spec.mesh.shape[step.mesh_dim], piece_bytes(spec, current),
                             piece_bytes(spec, after))
        current = after
    return Cost(moved, piece_bytes(spec, target))


__all__ = ["Cost", "piece_bytes", "redistribute_cost"]
