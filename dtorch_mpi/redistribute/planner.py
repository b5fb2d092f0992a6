"""Redistribute planning: placements in, per-mesh-dim steps out. Pure and cached.

Nested sharding (several mesh dims splitting one tensor dim, applied in mesh-dim order) is
what makes the order matter: a mesh dim's shard may only change while no deeper mesh dim
splits the same tensor dim. So the plan runs in two phases:

1. innermost to outermost mesh dim: gather or reduce what must change (S->R all-gather,
   P->R all-reduce), or move directly when that is safe (S->S all-to-all, P->S
   reduce-scatter). Deeper shards of a tensor dim that a shallower change touches are
   gathered first and restored in phase 2 ("dirty").
2. outermost to innermost: the communication-free steps (R->S local slice, R->P).
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
