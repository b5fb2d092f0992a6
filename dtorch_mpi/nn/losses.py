"""``cross_entropy`` on logits sharded any legal way, the class dim included (vocab-parallel,
the Megatron case), without ever gathering the logits.

Per row, ``loss = log(sum_j exp(z_j - m)) - (z_t - m)`` with ``m`` the row max and ``t`` the
target class. On every mesh dim that shards the class dim (the last), each rank holds some of
a row's classes, so the forward combines three ``[rows]``-sized numbers across that mesh dim:

1. the row max ``m``: one all-reduce (MAX) of the local row maxima;
2. the sum of ``exp(z - m)`` and the target's shifted logit (only its owner contributes, the
   others add zero): one all-reduce (SUM) of the two stacked, ``[2, rows]``.

Both are ``redistribute`` calls of small ``Partial`` DTensors (``Partial("max")``,
``Partial("sum")`` -> ``Replicate``), so they go through the communication backend and show in
``CommCounter``. Mesh dims that replicate or shard the batch dims move nothing. The backward
is local: ``softmax(z) - onehot(t)`` on each rank's piece, times the incoming row gradient;
the logits' gradient has the logits' placements. (Only a ``Partial`` row gradient on a
class-sharded mesh dim, which a plain ``sum``/``mean`` never produces, is all-reduced first:
every class shard needs the whole row gradient.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import array_namespace
from ..autograd.graph import attach
from ..autograd.record import needs_recording
from ..dtensor import DTensor
from ..errors import PlacementError, ShapeMismatchError
from ..grad_mode import _GradMode
from ..placement import Partial, Placement, Replicate, Shard
from ..spec import DTensorSpec
from .indices import require_in_range

__all__ = ["cross_entropy"]

REDUCTIONS = ("mean", "sum", "none")


def _row_placements(logits: DTensor, class_op: str, shift: int = 0) -> tuple[Placement, ...]:
    """Per mesh dim, the placement of a per-row statistic of ``logits``: a batch dim's Shard
    stays (moved by ``shift`` when a leading dim is stacked), a class-dim Shard becomes
    ``Partial(class_op)`` (each rank has a term over its classes), Replicate stays."""
    cls = logits.ndim - 1
    return tuple(Partial(class_op) if p.is_shard(cls) else Shard(p.dim + shift) if isinstance(p, Shard) else p
                 for p in logits.placements)


def _reduced(stat: Any, logits: DTensor, op: str, shift: int = 0) -> Any:
    """Combine a local per-row statistic across the class-sharded mesh dims (one all-reduce
    with ``op`` when there are any; nothing otherwise)."""
    spec = DTensorSpec(logits.device_mesh, _row_placements(logits, op, shift),
                       stat.shape[:shift] + logits.shape[:-1], logits.dtype)
    if not any(p.is_partial() for p in spec.placements):
        return stat
    target = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    return DTensor(stat, spec).redistribute(placements=target).to_local()


def _local_target(target: Any, logits: DTensor) -> Any:
    """This rank's rows of ``target`` (checked: integer, the logits' batch shape, in range)."""
    rows = logits.shape[:-1]
    xp = array_namespace(logits.device_mesh.device_type)
    if not isinstance(target, DTensor):
        target = xp.asarray(target)
    if tuple(target.shape) != rows:
        raise ShapeMismatchError(
            f"cross_entropy: target has shape {tuple(target.shape)}; logits {logits.shape} need class indices "
            f"of shape {rows} (the class dim is the last)")
    if target.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: target must hold integer class indices, got dtype {target.dtype}")
    comm = None
    if isinstance(target, DTensor):
        want = tuple(p if isinstance(p, Shard) and not p.is_shard(logits.ndim - 1) else Replicate()
                     for p in logits.placements)
        if target.device_mesh is not logits.device_mesh or target.placements != want:
            raise PlacementError(
                f"cross_entropy: target placed {list(target.placements)} does not match the logits' rows "
                f"(logits {list(logits.placements)}); redistribute the target to {list(want)}")
        local = target.to_local()
        comm = logits.device_mesh.get_comm() if any(p.is_shard() for p in want) else None
    else:  # every rank holds the whole array: check all of it (the same verdict everywhere)
        require_in_range("cross_entropy: target", target, logits.shape[-1], None)
        local_rows, offset = logits.spec.local_shape_and_offset
        return target[tuple(slice(o, o + n) for o, n in zip(offset, local_rows[:-1]))]
    # ranks hold different rows of a sharded target: they agree on the check
    require_in_range("cross_entropy: target", local, logits.shape[-1], comm)
    return local


def _row_losses(logits: DTensor, target: Any) -> DTensor:
    """The per-row loss DTensor (batch placements kept, class-sharded mesh dims Replicate),
    recorded with its local backward."""
    if logits.dtype.kind != "f":
        raise TypeError(f"cross_entropy: logits must be floating point, got {logits.dtype}")
    if logits.ndim < 1 or logits.shape[-1] == 0:
        raise ShapeMismatchError(f"cross_entropy: logits of shape {logits.shape} have no class dim to normalise over")
    partial = [k for k, p in enumerate(logits.placements) if p.is_partial()]
    if partial:
        raise PlacementError(
            f"cross_entropy: logits are Partial on mesh dim(s) {partial}; the loss is not linear in the "
            f"terms: redistribute the logits to Replicate() or Shard() on those mesh dims first")
    tgt = _local_target(target, logits)
    xp = array_namespace(logits.device_mesh.device_type)
    z = logits.to_local()
    (_, offset) = logits.spec.local_shape_and_offset
    c0, c = offset[-1], z.shape[-1]
    rows_shape = z.shape[:-1]
    m = z.max(-1) if c else xp.full(rows_shape, -np.inf, dtype=z.dtype)
    m = _reduced(m, logits, "max")
    e = xp.exp(z - m[..., None])
    owned = (tgt >= c0) & (tgt < c0 + c)
    cls = xp.where(owned, tgt - c0, 0)
    picked = xp.take_along_axis(z, cls[..., None], -1)[..., 0] - m if c else xp.zeros(rows_shape, dtype=z.dtype)
    stats = _reduced(xp.stack([e.sum(-1), xp.where(owned, picked, 0)]).astype(z.dtype, copy=False),
                     logits, "sum", shift=1)
    loss = (xp.log(stats[0]) - stats[1]).astype(z.dtype, copy=False)
    out_plc = tuple(Replicate() if p.is_shard(logits.ndim - 1) else p for p in logits.placements)
    out = DTensor(loss, DTensorSpec(logits.device_mesh, out_plc, logits.shape[:-1], logits.dtype))
    if not (_GradMode.recording and needs_recording((logits,))):
        return out
    prob = e / stats[0][..., None]
    hit = xp.nonzero(owned)
    hit_cls = cls[hit]
    spec, class_dims = logits.spec, [k for k, p in enumerate(logits.placements) if p.is_shard(logits.ndim - 1)]

    def backward(grad: DTensor) -> list[DTensor | None]:
        if any(grad.placements[k].is_partial() for k in class_dims):
            # every class shard needs the whole row gradient
            grad = grad.redistribute(placements=[Replicate() if k in class_dims else p
                                                 for k, p in enumerate(grad.placements)])
        g = grad.to_local()
        local = prob * g[..., None]
        local[hit + (hit_cls,)] -= g[hit]
        plc = tuple(p if isinstance(p, Shard) else q for p, q in zip(spec.placements, grad.placements))
        return [DTensor(local.astype(spec.dtype, copy=False), spec.with_placements(plc))]

    return attach(out, "cross_entropy", (logits,), backward)


def cross_entropy(logits: DTensor, target: Any, reduction: str = "mean") -> DTensor:
    """Cross-entropy of ``logits [..., C]`` (the class dim last, as vocab-parallel losses lay it
    out; torch's ``[N, C, d...]`` needs its class dim moved last) against integer class indices
    ``target [...]``: a NumPy/CuPy array of the whole batch, the same on every rank, or an
    integer DTensor placed like the logits' rows (a batch dim's Shard kept, Replicate
    elsewhere).

    Any placements of the logits among ``Replicate``, ``Shard(batch dim)`` and ``Shard(C)``
    on a mesh of any rank; the logits are never gathered. Per class-sharded mesh dim the
    forward does two ``[rows]``-sized all-reduces (MAX of the row maxima; SUM of the stacked
    sum of exponentials and target logit), counted by ``CommCounter``; the backward moves
    nothing and gives the logits' gradient their placements. ``reduction``: ``"none"`` (per
    row, shape ``logits.shape[:-1]``, batch placements kept), ``"sum"`` or ``"mean"`` (a
    scalar, ``Partial("sum")`` where the batch is sharded, as ``sum``/``mean`` are).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")
    rows = _row_losses(logits, target)
    return rows if reduction == "none" else rows.sum() if reduction == "sum" else rows.mean()
