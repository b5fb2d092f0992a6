"""Summing gradient contributions that arrive with different placements, without communication.

A tensor used several times gets one contribution per use, each with a legal gradient
placement for that use. Per mesh dim they combine locally:

==========================  ====================  ==========================================
contributions               sum's placement       what happens to the pieces
==========================  ====================  ==========================================
equal placements            the same              pieces add
Replicate + Partial("sum")  Partial("sum")        the Replicate term counts at coordinate 0
Replicate + Partial("avg")  Partial("avg")        pieces add
Partial("avg") + ("sum")    Partial("sum")        avg terms are divided by the mesh dim size
Replicate + Shard(d)        Shard(d)              the Replicate term is sliced locally
==========================  ====================  ==========================================

Any other pair (a Shard with a Partial, two different Shards) cannot be added without moving
data and is an error: backward never moves data to tidy placements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import PlacementError
from ..placement import Partial, Placement, Replicate, Shard

if TYPE_CHECKING:
    from ..dtensor import DTensor


def _combined(a: Placement, b: Placement, mesh_dim: int) -> Placement:
    if a == b:
        return a
    pair = {a, b}
    if Replicate() in pair:
        other = b if isinstance(a, Replicate) else a
        if isinstance(other, Shard) or (isinstance(other, Partial) and other.reduce_op in ("sum", "avg")):
            return other
    if pair == {Partial("sum"), Partial("avg")}:
        return Partial("sum")
    raise PlacementError(
        f"backward: gradient contributions with placements {a!r} and {b!r} on mesh dim {mesh_dim} "
        f"cannot be summed without communication"
    )


def convert_locally(t: "DTensor", target: tuple[Placement, ...]) -> Any:
    """``t``'s local piece expressed in ``target`` placements, by local steps only
    (Replicate -> Shard slices, Replicate -> Partial keeps coordinate 0, avg -> sum scales)."""
    from ..redistribute import compile_plan, run_compiled

    local = t.to_local()
    scale = 1
    via = list(t.placements)
    for k, (src, dst) in enumerate(zip(t.placements, target)):
        if src == Partial("avg") and dst == Partial("sum"):
            scale *= t.device_mesh.shape[k]
        elif src != dst:
            via[k] = dst
    if tuple(via) != t.placements:
        plan = compile_plan(t.spec, tuple(via))
        if plan.communicates:
            raise PlacementError(
                f"backward: summing gradient contributions placed {list(t.placements)} into "
                f"{list(target)} would move data (nested sharding); give the uses one placement")
        local = run_compiled(local, plan)
    return local / scale if scale != 1 else local


def accumulate(a: "DTensor", b: "DTensor") -> "DTensor":
    """The sum of two gradient contributions to one tensor (no communication)."""
    from ..dtensor import DTensor

    if a.placements == b.placements:
        return DTensor(a.to_local() + b.to_local(), a.spec)
    target = tuple(_combined(pa, pb, k) for k, (pa, pb) in enumerate(zip(a.placements, b.placements)))
    local = convert_locally(a, target) + convert_locally(b, target)
    return DTensor(local, a.spec.with_placements(target))
