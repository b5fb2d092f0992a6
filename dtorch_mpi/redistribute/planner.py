"""Redistribute planning: placements in, per-mesh-dim steps out. Pure and cached.

Nested sharding (several mesh dims splitting one tensor dim, applied in mesh-dim order) is
what makes the order matter: a mesh dim's shard may only change while no deeper mesh dim
splits the same tensor dim. So the plan runs in two phases:

1. innermost to outermost mesh dim: gather or reduce what must change (S->R all-gather,
   P->R all-reduce), or move directly when that is safe (S->S all-to-all, P->S
   reduce-scatter). Deeper shards of a tensor dim that a shallower change touches are
   gathered first and restored in phase 2 ("dirty").
2. outermost to innermost: the communication-free steps (R->S local slice, R->P).

That per-dim plan can gather far more than a rank needs on meshes of 2+ dims (a shard gathered
on one mesh dim and sliced again, e.g. ``[S0,S0,S0] -> [S1,S1,S1]`` gathers 1/8 of the tensor
on an (8,16,8) mesh for a 1/1024 piece). ``exchanges_directly`` names the Shard/Replicate pairs
whose per-dim plan is not minimal; those run as one ``EXCHANGE`` over the whole mesh: each rank
receives exactly what its target piece lacks, from the rank holding it with its own
coordinates on the source's Replicate dims (redistribute/traffic.py counts both plans' bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from ..placement import Partial, Placement, Replicate, Shard


class StepKind(str, Enum):
    """What one step does, by (source, target) placement kind; equal to its name as a string
    (``StepKind.ALL_GATHER == "all_gather"``). The executor's table has one entry per kind."""

    ALL_GATHER = "all_gather"  # Shard -> Replicate
    ALL_TO_ALL = "all_to_all"  # Shard -> Shard
    ALL_REDUCE = "all_reduce"  # Partial -> Replicate
    REDUCE_SCATTER = "reduce_scatter"  # Partial -> Shard
    SLICE = "slice"  # Replicate -> Shard (local)
    TO_PARTIAL = "to_partial"  # Replicate -> Partial (local)
    EXCHANGE = "exchange"  # Shard/Replicate -> Shard/Replicate on several mesh dims at once (whole mesh)

    @property
    def communicates(self) -> bool:
        return self not in (StepKind.SLICE, StepKind.TO_PARTIAL)

    def __str__(self) -> str:
        return self.value


_KINDS = {  # (source is Shard / Partial / Replicate, target is Shard) -> kind
    (Shard, True): StepKind.ALL_TO_ALL, (Shard, False): StepKind.ALL_GATHER,
    (Partial, True): StepKind.REDUCE_SCATTER, (Partial, False): StepKind.ALL_REDUCE,
    (Replicate, True): StepKind.SLICE, (Replicate, False): StepKind.TO_PARTIAL,
}


@dataclass(frozen=True)
class Step:
    """Change mesh dim ``mesh_dim`` from ``src`` to ``dst``."""

    mesh_dim: int
    src: Placement
    dst: Placement

    @property
    def kind(self) -> StepKind:
        return _KINDS[type(self.src), isinstance(self.dst, Shard)]

    @property
    def communicates(self) -> bool:
        return self.kind.communicates

    def __repr__(self) -> str:
        return f"mesh dim {self.mesh_dim}: {self.src!r} -> {self.dst!r} ({self.kind})"


@lru_cache(maxsize=2048)
def plan_redistribute(
    src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> tuple[Step, ...]:
    """The steps turning placements ``src`` into ``dst`` on the same mesh."""
    assert len(src) == len(dst)
    n = len(src)
    cur = list(src)
    steps: list[Step] = []

    def changes(i: int, p: Placement) -> bool:
        return cur[i] != dst[i] and p in (cur[i], dst[i])

    def dirty(k: int) -> bool:
        p = cur[k]
        if isinstance(p, Shard):
            return any(changes(i, p) for i in range(k))
        if isinstance(p, Partial):
            return any(
                isinstance(cur[i], Partial) and cur[i] != p and cur[i] != dst[i] for i in range(k)
            )
        return False

    def safe_shard(k: int, p: Shard) -> bool:
        deeper = any(cur[j] == p for j in range(k + 1, n))
        shallower = any(changes(i, p) for i in range(k))
        return not deeper and not shallower

    def move(k: int, p: Placement) -> None:
        steps.append(Step(k, cur[k], p))
        cur[k] = p

    for k in reversed(range(n)):
        is_dirty = cur[k] == dst[k] and dirty(k)
        if cur[k] == dst[k] and not is_dirty:
            continue
        target = Replicate() if is_dirty else dst[k]
        p = cur[k]
        if isinstance(p, Shard):
            if isinstance(target, Shard) and safe_shard(k, target) and not any(
                cur[j] == p for j in range(k + 1, n)
            ):
                move(k, target)
            else:
                move(k, Replicate())
        elif isinstance(p, Partial):
            if isinstance(target, Shard) and safe_shard(k, target):
                move(k, target)
            else:
                move(k, Replicate())
    for k in range(n):
        if cur[k] != dst[k]:
            assert isinstance(cur[k], Replicate), (src, dst, cur)
            move(k, dst[k])
    return tuple(steps)


@lru_cache(maxsize=2048)
def exchanges_directly(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> bool:
    """Whether ``src -> dst`` runs as one whole-mesh ``EXCHANGE`` instead of the per-dim plan:
    for Shard/Replicate pairs (no Partial) whose per-dim plan communicates and is not minimal.
    Minimal (kept) is a plan of local steps only, or one changing each mesh dim at most once,
    straight to its target, by communication alone, and either a single step or all-gathers
    only (a chain of all-gathers receives exactly what the target lacks). The choice is a
    function of placements alone: the same on every rank."""
    if any(isinstance(p, Partial) for p in src + dst):
        return False
    steps = plan_redistribute(src, dst)
    if not any(s.communicates for s in steps):
        return False
    direct = len({s.mesh_dim for s in steps}) == len(steps) and all(
        s.communicates and s.dst == dst[s.mesh_dim] for s in steps)
    return not (direct and (len(steps) == 1 or all(s.kind is StepKind.ALL_GATHER for s in steps)))
