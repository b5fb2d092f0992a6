"""Gradient utilities: ``reduce_gradients`` (the one explicit call that brings gradients to
their parameters' placements, packing many tensors into few collectives) and
``clip_grad_norm_`` (the global norm with one small collective)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..arrays import array_namespace
from ..comm import Group, backend_for
from ..comm.divergence import call_context
from ..dtensor import DTensor
from ..errors import MeshMismatchError, PlacementError, ShapeMismatchError
from ..redistribute import compile_plan
from ..redistribute.executor import CompiledStep, run_compiled_step
from .checkpoint import apply_activation_checkpointing, checkpoint, checkpoint_module, checkpoint_sequential  # noqa: F401

BUCKET_BYTES = 25 << 20
"""Bucket capacity (DDP's default 25 MB), counted on global tensor sizes so that every rank
cuts the buckets at the same places."""

PACKED_KINDS = ("all_reduce", "reduce_scatter")


@dataclass
class _Item:
    """One gradient in flight: its current piece and the steps left to run."""

    param: DTensor
    piece: Any
    steps: tuple[CompiledStep, ...]
    nbytes: int


@dataclass
class _Bucket:
    group: Group
    kind: str
    items: list[tuple[_Item, CompiledStep]] = field(default_factory=list)
    nbytes: int = 0


def reduce_gradients(params: Iterable[DTensor], *, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Redistribute every ``p.grad`` to ``p``'s placements, in place of ``p.grad``.

    ``Partial -> Replicate`` is an all-reduce and ``Partial -> Shard(d)`` a reduce-scatter on
    that mesh dim; these are packed: gradients whose step has the same (mesh, mesh dim, kind,
    reduce op, dtype) share one flat buffer and one collective per ``bucket_bytes`` (0: one
    collective per gradient). Other changes (``Replicate -> Shard``: a local slice; a
    ``Shard`` gradient of a replicated parameter: an all-gather) run per gradient as
    ``redistribute`` would. Gradients already in place are left untouched. Every decision is
    made from metadata, so every rank runs the same collectives in the same order.
    """
    items = []
    for i, p in enumerate(params):
        g = p.grad
        if g is None:
            continue
        if g.device_mesh != p.device_mesh:
            raise MeshMismatchError(
                f"reduce_gradients: parameter {i}'s gradient lives on {g.device_mesh!r}, the parameter on "
                f"{p.device_mesh!r}; assign a gradient on the parameter's mesh (or let backward() make it)")
        if g.shape != p.shape:
            raise ShapeMismatchError(
                f"reduce_gradients: parameter {i} has shape {p.shape} but its gradient {g.shape}; the "
                f"gradient must have its parameter's global shape")
        plan = compile_plan(g.spec, p.placements)
        if plan.steps:
            items.append(_Item(p, g.to_local(), plan.steps, math.prod(g.shape) * g.dtype.itemsize))
    rounds = max((len(it.steps) for it in items), default=0)
    for r in range(rounds):
        buckets: dict[tuple[Any, ...], list[_Bucket]] = {}
        for it in items:
            if len(it.steps) <= r:
                continue
            step = it.steps[r]
            mesh = it.param.device_mesh
            xp, backend = array_namespace(mesh.device_type), backend_for(mesh.device_type)
            if step.kind not in PACKED_KINDS:
                it.piece = run_compiled_step(step, it.piece, xp, backend, False).wait()
                continue
            assert step.group is not None
            key = (id(mesh), step.group.mesh_dim, step.kind, step.args[-1], it.piece.dtype)
            chain = buckets.setdefault(key, [_Bucket(step.group, step.kind)])
            if chain[-1].items and chain[-1].nbytes + it.nbytes > bucket_bytes:
                chain.append(_Bucket(step.group, step.kind))
            chain[-1].items.append((it, step))
            chain[-1].nbytes += it.nbytes
        for chain in buckets.values():
            for bucket in chain:
                _RUNNERS[bucket.kind](bucket)
    for it in items:
        it.param.grad = DTensor(it.piece, compile_plan(it.param.grad.spec, it.param.placements).out_spec)  # type: ignore[union-attr]


def _xp_backend(bucket: _Bucket) -> tuple[Any, Any]:
    mesh = bucket.items[0][0].param.device_mesh
    return array_namespace(mesh.device_type), backend_for(mesh.device_type)


def _contents(bucket: _Bucket) -> str:
    """What a packed bucket holds, in order (the divergence check compares it across ranks): each
    parameter's global shape, dtype and placements, and its gradient's."""
    return "bucket of " + ", ".join(f"{tuple(it.param.shape)}:{it.param.dtype}{list(it.param.placements)}"
                                    f"<-{list(it.param.grad.placements)}"  # type: ignore[union-attr]
                                    for it, _ in bucket.items)


def _all_reduce_bucket(bucket: _Bucket) -> None:
    """One all-reduce of every piece of the bucket, flattened into one buffer."""
    xp, backend = _xp_backend(bucket)
    pieces = [it.piece for it, _ in bucket.items]
    if len(pieces) > 1:  # packed into a buffer of its own: reduced in place (no copy when MPI starts)
        flat = out = xp.concatenate([x.reshape(-1) for x in pieces])
    else:
        flat = pieces[0].reshape(-1)
        out = xp.empty_like(flat)
    with call_context(lambda: _contents(bucket), every_size=True):
        backend.all_reduce(bucket.group, flat, out, bucket.items[0][1].args[0]).wait()
    at = 0
    for (it, _), x in zip(bucket.items, pieces):
        it.piece = out[at : at + x.size].reshape(x.shape)
        at += x.size


def _reduce_scatter_bucket(bucket: _Bucket) -> None:
    """One reduce-scatter (per-destination counts) of every piece of the bucket: destination
    ``j``'s block of every piece is packed together, so block ``j`` of the buffer is rank
    ``j``'s part of every gradient."""
    xp, backend = _xp_backend(bucket)
    group = bucket.group
    m, me = group.size, group.rank
    views = []  # per item: (outer, rows, inner) view, split sizes, offsets, target shape
    for it, step in bucket.items:
        axis, sizes = step.args[0], step.args[1]
        x = it.piece
        outer, inner = math.prod(x.shape[:axis]), math.prod(x.shape[axis + 1 :])
        views.append((x.reshape(outer, x.shape[axis], inner), sizes, np.cumsum((0,) + tuple(sizes)), step.out_shape))
    counts = [sum(v.shape[0] * sizes[j] * v.shape[2] for v, sizes, _, _ in views) for j in range(m)]
    pack = xp.empty(sum(counts), dtype=bucket.items[0][0].piece.dtype)
    at = 0
    for j in range(m):
        for v, _sizes, offs, _ in views:
            block = v[:, offs[j] : offs[j + 1], :]
            pack[at : at + block.size] = block.reshape(-1)
            at += block.size
    out = xp.empty(counts[me], dtype=pack.dtype)
    with call_context(lambda: _contents(bucket), every_size=True):
        backend.reduce_scatter(group, pack, out, 0, counts, bucket.items[0][1].args[2]).wait()
    at = 0
    for (it, _), (_, _, _, shape) in zip(bucket.items, views):
        n = math.prod(shape)
        it.piece = out[at : at + n].reshape(shape)
        at += n


_RUNNERS = {"all_reduce": _all_reduce_bucket, "reduce_scatter": _reduce_scatter_bucket}


def _reduced(norm_type: float) -> tuple[str, float]:
    """The reduce op and identity of the rank-wise partial norms for ``norm_type``."""
    if norm_type == math.inf:
        return "max", 0.0
    if norm_type == -math.inf:
        return "min", math.inf
    return "sum", 0.0


def clip_grad_norm_(params: Iterable[DTensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> float:
    """Scale every gradient in place so that their global ``norm_type``-norm is at most
    ``max_norm``; return the norm before clipping, as a float, on every rank.

    As PyTorch: the total is the ``norm_type``-norm of the gradients' own norms, which for
    every ``p`` other than 0 is the norm of all gradients as one vector (``inf``: the largest
    magnitude, ``-inf``: the smallest, a negative ``p``: 0 where any entry is 0), and for
    ``p = 0`` the number of gradients with a nonzero entry. One all-reduce over the mesh: each
    rank's ``sum |g|^p`` (the max / min magnitude for ``±inf``; per-gradient nonzero counts for
    0), a replicated piece counted only at coordinate 0 of the mesh dims it is replicated on.
    ``Partial`` gradients are refused (reduce them first).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    mesh = grads[0].device_mesh
    for g in grads:
        if g.device_mesh != mesh:
            raise MeshMismatchError("clip_grad_norm_ needs every gradient on one mesh; clip each mesh's "
                                    "parameters separately")
        if any(pl.is_partial() for pl in g.placements):
            raise PlacementError(
                f"clip_grad_norm_: a gradient is {list(g.placements)}; Partial terms have no norm of "
                f"their own: call dtorch.nn.utils.reduce_gradients(params) first")
    norm_type = float(norm_type)
    op, identity = _reduced(norm_type)
    xp = array_namespace(mesh.device_type)
    coord = mesh.get_coordinate()
    acc = xp.full(len(grads) if norm_type == 0 else 1, identity, dtype=np.float64)
    for i, g in enumerate(grads):
        x = g.to_local()
        owner = coord is not None and all(c == 0 for c, pl in zip(coord, g.placements) if pl.is_replicate())
        if not owner or x.size == 0:
            continue
        a = xp.abs(x.astype(np.float64, copy=False))
        if op == "max":
            acc[0] = xp.maximum(acc[0], a.max())
        elif op == "min":
            acc[0] = xp.minimum(acc[0], a.min())
        elif norm_type == 0:
            acc[i] = xp.count_nonzero(a)
        elif norm_type == 2.0:
            acc[0] += xp.sum(a * a)
        else:
            with np.errstate(divide="ignore"):  # 0 ** negative p is inf: the norm is then 0
                acc[0] += xp.sum(a ** norm_type)
    if coord is not None:
        out = xp.empty_like(acc)
        with call_context(lambda: f"clip_grad_norm_(norm_type={norm_type}, {len(grads)} gradients)"):
            backend_for(mesh.device_type).all_reduce(Group(mesh.get_comm(), None), acc, out, op).wait()
        acc = out
    if norm_type == 0:
        total = float(xp.count_nonzero(acc))
    elif op != "sum":
        total = float(acc[0])
    else:
        with np.errstate(divide="ignore"):
            total = float(np.float64(acc[0]) ** (1.0 / norm_type))
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total}; "
                           f"pass error_if_nonfinite=False to clip anyway")
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            x = g.to_local()
            x *= x.dtype.type(coef)
    return total
