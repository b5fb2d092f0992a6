"""Plan builders, one per operator family: output shape and DimMap from the input specs and
the op's (hashable) parameters, then signature inference. Metadata only; cached by
``apply.plan_for`` in one bounded cache per mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

import numpy as np

from ..errors import PlacementError, ShapeMismatchError
from ..placement import Shard
from ..spec import DTensorSpec
from .dimmaps import BroadcastMap, IndexMap, JoinMap, MatmulMap, PermuteMap, RemoveDimsMap, ReshapeMap
from .dispatch import OpPlan, infer
from .registry import Op
from .tables import nary

Specs = tuple[DTensorSpec | None, ...]
ARG_NAMES = ("a", "b", "c")


def _shape_of(spec: DTensorSpec | None) -> tuple[int, ...] | None:
    return spec.shape if spec is not None else None


def _one(specs: Specs) -> DTensorSpec:
    (spec,) = specs
    assert spec is not None  # the applier passes a DTensor's spec
    return spec


def plan_elementwise(op: Op, specs: Specs, params: tuple[Any, ...]) -> OpPlan:
    """Broadcasting elementwise ops (a scalar operand's spec is None)."""
    shapes = [s.shape for s in specs if s is not None]
    try:
        out_shape = tuple(np.broadcast_shapes(*shapes))
    except ValueError as exc:
        raise ShapeMismatchError(f"{op.name}: shapes {[_shape_of(s) for s in specs]} do not broadcast") from exc
    dmap = BroadcastMap(tuple(_shape_of(s) for s in specs), out_shape)
    return infer(op.signature, specs, dmap, out_shape, ARG_NAMES[: len(specs)] if len(specs) > 1 else ("x",))


def matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy's matmul result shape (1-D operands promoted, batch dims broadcast)."""
    if not a or not b:
        raise ShapeMismatchError("matmul: operands must have at least one dim (use * for scalars)")
    a2 = a if len(a) >= 2 else (1,) + a
    b2 = b if len(b) >= 2 else b + (1,)
    if a2[-1] != b2[-2]:
        raise ShapeMismatchError(f"matmul: inner dims differ: {a} @ {b}")
    try:
        batch = tuple(np.broadcast_shapes(a2[:-2], b2[:-2]))
    except ValueError as exc:
        raise ShapeMismatchError(f"matmul: batch dims of {a} and {b} do not broadcast") from exc
    out = batch + (a2[-2], b2[-1])
    if len(b) == 1:
        out = out[:-1]
    if len(a) == 1:
        out = out[:-2] + out[-1:] if len(b) > 1 else out[:-1]
    return out


def plan_matmul(op: Op, specs: Specs, params: tuple[Any, ...]) -> OpPlan:
    a, b = specs
    assert a is not None and b is not None
    shape = matmul_shape(a.shape, b.shape)
    return infer(op.signature, specs, MatmulMap(a.shape, b.shape, shape), shape, ("a", "b"))


def axes_of(dim: int | Sequence[int] | None, ndim: int, op: str) -> tuple[int, ...]:
    """Sorted, normalised, distinct dims (all dims when None); IndexError when out of range."""
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, (int, np.integer)) else tuple(dim)
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"{op}: dim must be an int or a sequence of ints, got {d!r}")
        if not -ndim <= d < max(ndim, 1):
            raise IndexError(f"{op}: dim {d} out of range for a {ndim}-D tensor")
        out.append(int(d) % max(ndim, 1))
    return tuple(sorted(set(out)))


def plan_reduce(op: Op, specs: Specs, params: tuple[Any, ...]) -> OpPlan:
    """Reductions over ``axes``: params ``(axes, keepdim)``."""
    spec = _one(specs)
    axes, keepdim = params
    shape = tuple(1 if d in axes else n for d, n in enumerate(spec.shape)) if keepdim else tuple(
        n for d, n in enumerate(spec.shape) if d not in axes)
    dmap = RemoveDimsMap(len(spec.shape), frozenset(axes), keepdim)
    return infer(op.signature, specs, dmap, shape, ("x",))


def plan_along_dim(op: Op, specs: Specs, params: tuple[Any, ...]) -> OpPlan:
    """Shape-preserving ops computed along one dim that must not be sharded (softmax,
    cumsum): params ``(axis,)``; a Shard on that dim matches no ``Shard(d)`` rule."""
    spec = _one(specs)
    (axis,) = params
    dmap = RemoveDimsMap(len(spec.shape), frozenset((axis,)), True)
    return infer(op.signature, specs, dmap, spec.shape, ("x",))


def plan_permute(op: Op, specs: Specs, params: tuple[Any, ...]) -> OpPlan:
    """Params ``(perm,)``: output dim ``j`` is input dim ``perm[j]``."""
    spec = _one(specs)
    (perm,) = params
    shape = tuple(spec.shape[p] for p in perm)
    return infer(op.signature, specs, PermuteMap(perm), shape, ("x",))


def plan_reshape(op: Op, specs: Specs, params: tuple[Any, ...]) -> OpPlan:
    """Params ``(shape,)`` (already resolved: no -1). A sharded dim may be split or merged
    where every rank's piece maps onto the new layout (``ReshapeMap``); where it does not,
    the error says why and names the fix."""
    spec = _one(specs)
    (shape,) = params
    dmap = ReshapeMap(spec.shape, shape, tuple(spec.mesh.shape), spec.placements)
    try:
        plan = infer(op.signature, specs, dmap, shape, ("x",))
    except PlacementError as err:
        reasons = [why for p in spec.placements if isinstance(p, Shard) and (why := dmap.why_not(p.dim))]
        if not reasons:
            raise
        raise PlacementError(
            f"reshape {spec.shape} -> {shape}: " + "; ".join(dict.fromkeys(reasons)) + ". Shard the "
            f"dim that stays whole instead (e.g. the head dim of [B, T, heads, head_dim], with a "
            f"rank count that divides the heads), or redistribute as below, reshape, and cut the "
            f"result back with .redistribute(placements=[Shard(...)]) (a local slice).\n{err}"
        ) from None
    local = DTensorSpec(plan.mesh, plan.placements, plan.shape, np.dtype("f4")).local_shape
    return OpPlan(plan.mesh, plan.placements, plan.shape, plan.prepare, plan.reduced_sharded, plan.xp,
                  plan.rules, aux=local)


def resolve_shape(shape: Sequence[int], size: int) -> tuple[int, ...]:
    """``shape`` with its -1 (at most one) inferred for ``size`` elements."""
    dims = [int(s) for s in shape]
    if dims.count(-1) > 1:
        raise ShapeMismatchError("reshape: at most one dim may be -1")
    if -1 in dims:
        known = prod(d for d in dims if d != -1)
        if known == 0 or size % known:
            raise ShapeMismatchError(f"reshape: cannot infer -1 in {tuple(shape)} for {size} elements")
        dims[dims.index(-1)] = size // known
    if prod(dims) != size:
        raise ShapeMismatchError(f"reshape: {size} elements do not fit shape {tuple(dims)}")
    return tuple(dims)


# --- basic indexing ------------------------------------------------------------------------
def hashable_key(key: Any) -> tuple[Any, ...]:
    """Validate a basic-indexing key (ints, slices, None, ...) and make it hashable."""
    key = key if isinstance(key, tuple) else (key,)
    for k in key:
        if not (k is None or k is Ellipsis or isinstance(k, (slice, int, np.integer))) or isinstance(k, bool):
            raise TypeError(
                f"indexing: {type(k).__name__} keys (advanced indexing) are not supported; use "
                f"ints, slices, None and ..."
            )
    return tuple((k.start, k.stop, k.step, "slice") if isinstance(k, slice) else k for k in key)


def _real_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(slice(*k[:3]) if isinstance(k, tuple) and k[-1] == "slice" else k for k in key)


def _index_dims(shape: tuple[int, ...], key: tuple[Any, ...]) -> tuple[tuple[int | None, ...], tuple[int, ...], tuple[Any, ...]]:
    """For a validated key: each input dim's output dim (None unless taken whole), the output
    shape and the key with ``...`` and missing trailing dims expanded."""
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError("an index can only have a single ellipsis")
    used = sum(1 for k in key if k is not None and k is not Ellipsis)
    if used > len(shape):
        raise IndexError(f"too many indices for a {len(shape)}-D tensor")
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (len(shape) - used) + key[i + 1 :]
    else:
        key = key + (slice(None),) * (len(shape) - used)
    kept: list[int | None] = []
    out_shape: list[int] = []
    d = 0
    for k in key:
        if k is None:
            out_shape.append(1)
            continue
        n = shape[d]
        if isinstance(k, slice):
            full = k == slice(None) or k.indices(n) == (0, n, 1)
            kept.append(len(out_shape) if full else None)
            out_shape.append(len(range(*k.indices(n))))
        else:
            if not -n <= int(k) < n:
                raise IndexError(f"index {int(k)} is out of bounds for dim {d} with size {n}")
            kept.append(None)
        d += 1
    return tuple(kept), tuple(out_shape), key


def plan_getitem(op: Op, specs: Specs, params: tuple[Any, ...]) -> OpPlan:
    """Params ``(hashable_key(key),)``; the plan's ``aux`` is the expanded key."""
    spec = _one(specs)
    (key,) = params
    kept, shape, full_key = _index_dims(spec.shape, _real_key(key))
    plan = infer(op.signature, specs, IndexMap(kept), shape, ("x",))
    return OpPlan(plan.mesh, plan.placements, plan.shape, plan.prepare, plan.reduced_sharded, plan.xp,
                  plan.rules, aux=full_key)


# --- cat / stack ---------------------------------------------------------------------------
def _join(op: Op, specs: Specs, axis: int, shape: tuple[int, ...], new_dim: bool) -> OpPlan:
    names = tuple(f"tensors[{i}]" for i in range(len(specs)))
    return infer(nary(op.signature, len(specs)), specs, JoinMap(axis, new_dim), shape, names)


def plan_cat(op: Op, specs: Specs, params: tuple[Any, ...]) -> OpPlan:
    (axis,) = params
    shapes = [s.shape for s in specs if s is not None]
    first = shapes[0]
    for s in shapes[1:]:
        if len(s) != len(first) or any(a != b for d, (a, b) in enumerate(zip(s, first)) if d != axis):
            raise ShapeMismatchError(f"cat: shapes {shapes} differ outside dim {axis}")
    shape = first[:axis] + (sum(s[axis] for s in shapes),) + first[axis + 1 :]
    return _join(op, specs, axis, shape, False)


def plan_stack(op: Op, specs: Specs, params: tuple[Any, ...]) -> OpPlan:
    (axis,) = params
    shapes = [s.shape for s in specs if s is not None]
    if any(s != shapes[0] for s in shapes):
        raise ShapeMismatchError(f"stack: shapes differ: {shapes}")
    return _join(op, specs, axis, shapes[0][:axis] + (len(specs),) + shapes[0][axis:], True)
