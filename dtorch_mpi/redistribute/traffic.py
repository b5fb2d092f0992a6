"""What a redistribute moves, rank by rank, from metadata alone (pure; no communication).

``exchange_layout`` is the whole-mesh ``EXCHANGE`` step's block table for one rank (which
peer gets which part of its piece, which part of its target piece comes from whom);
``received`` counts the elements one rank receives and the largest piece a communicating step
leaves it with, for whichever plan ``compile_plan`` runs. The fix-it cost model
(ops/cost.py) and the simulated-scale tests use the same numbers.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import product
from math import prod
from typing import NamedTuple

from ..placement import Placement, Replicate
from ..split import local_shape_and_offset
from .planner import exchanges_directly, plan_redistribute

Shape = tuple[int, ...]
Ranges = tuple[tuple[int, int], ...]  # (start, stop) per tensor dim, in a piece's own indices


def _intersect(a: tuple[Shape, Shape], b: tuple[Shape, Shape]) -> tuple[Shape, Shape] | None:
    """The global box (shape, offset) two pieces share, None when empty."""
    lo = tuple(max(x, y) for x, y in zip(a[1], b[1]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[1], a[0], b[1], b[0]))
    if any(h <= lo_ for lo_, h in zip(lo, hi)):
        return None
    return tuple(h - lo_ for lo_, h in zip(lo, hi)), lo


def overlap(a: tuple[Shape, Shape], b: tuple[Shape, Shape]) -> int:
    """Elements two pieces ``(shape, offset)`` share."""
    both = _intersect(a, b)
    return 0 if both is None else prod(both[0])


def _within(piece: tuple[Shape, Shape], box: tuple[Shape, Shape]) -> Ranges:
    """``box`` in ``piece``'s own indices."""
    return tuple((o - p, o - p + n) for o, p, n in zip(box[1], piece[1], box[0]))


class ExchangeLayout(NamedTuple):
    """One rank's side of an ``EXCHANGE``: ``sends``/``recvs`` are ``(peer, ranges)`` with peer
    the rank in the mesh communicator (row-major coordinate) and ranges in the source piece /
    target piece; ``own`` the part kept here ``(source ranges, target ranges)``."""

    sends: tuple[tuple[int, Ranges], ...]
    recvs: tuple[tuple[int, Ranges], ...]
    own: tuple[Ranges, Ranges] | None


@lru_cache(maxsize=256)
def exchange_layout(shape: Shape, mesh_shape: Shape, src: tuple[Placement, ...], dst: tuple[Placement, ...],
                    coord: Shape) -> ExchangeLayout:
    """Rank ``coord``'s blocks of the exchange ``src -> dst``. Each target element comes from
    the rank holding it whose coordinates on the source's Replicate mesh dims equal the
    receiver's (those ranks' source pieces partition the tensor), so nothing is received twice
    and what a rank already holds is never received: each rank receives exactly what its
    target piece lacks. O(ranks) arithmetic, once per (shapes, placements, coordinate)."""
    mine_src = local_shape_and_offset(shape, mesh_shape, src, coord)
    mine_dst = local_shape_and_offset(shape, mesh_shape, dst, coord)
    axes = [range(n) if not isinstance(p, Replicate) else (c,) for n, p, c in zip(mesh_shape, src, coord)]
    strides = [prod(mesh_shape[k + 1 :]) for k in range(len(mesh_shape))]
    sends, recvs = [], []
    for peer in product(*axes):
        if peer == coord:
            continue
        rank = sum(c * s for c, s in zip(peer, strides))  # row-major: the mesh communicator's order
        give = _intersect(mine_src, local_shape_and_offset(shape, mesh_shape, dst, peer))
        if give is not None:
            sends.append((rank, _within(mine_src, give)))
        take = _intersect(mine_dst, local_shape_and_offset(shape, mesh_shape, src, peer))
        if take is not None:
            recvs.append((rank, _within(mine_dst, take)))
    own = _intersect(mine_src, mine_dst)
    return ExchangeLayout(tuple(sends), tuple(recvs),
                          None if own is None else (_within(mine_src, own), _within(mine_dst, own)))


def received(shape: Shape, mesh_shape: Shape, src: tuple[Placement, ...], dst: tuple[Placement, ...],
             coord: Shape, per_dim: bool = False) -> tuple[int, int]:
    """``(elements rank coord receives, the largest piece a communicating step or the result
    leaves it)`` for the plan the executor runs, or with ``per_dim`` the per-dim plan alone
    (all-reduce and reduce-scatter counted as the piece they reduce into, the payload a ring
    algorithm moves at least)."""
    target = local_shape_and_offset(shape, mesh_shape, dst, coord)
    if not per_dim and len(mesh_shape) > 1 and prod(shape) > 0 and exchanges_directly(src, dst):
        return prod(target[0]) - overlap(target, local_shape_and_offset(shape, mesh_shape, src, coord)), \
            prod(target[0])
    cur, moved, peak = src, 0, prod(target[0])
    for step in plan_redistribute(src, dst):
        after = cur[: step.mesh_dim] + (step.dst,) + cur[step.mesh_dim + 1 :]
        if step.communicates:
            before = local_shape_and_offset(shape, mesh_shape, cur, coord)
            piece = local_shape_and_offset(shape, mesh_shape, after, coord)
            moved += prod(piece[0]) - (0 if step.kind in ("all_reduce", "reduce_scatter") else overlap(before, piece))
            peak = max(peak, prod(piece[0]))
        cur = after
    return moved, peak


def lower_bound(shape: Shape, mesh_shape: Shape, src: tuple[Placement, ...], dst: tuple[Placement, ...],
                coord: Shape) -> int:
    """Elements rank ``coord``'s target piece lacks from its source piece (Shard/Replicate)."""
    target = local_shape_and_offset(shape, mesh_shape, dst, coord)
    return prod(target[0]) - overlap(target, local_shape_and_offset(shape, mesh_shape, src, coord))
