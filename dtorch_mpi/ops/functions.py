"""Operators on DTensors: cached signature inference, then local compute. Never communicates.

Operand rules: a Python or NumPy scalar acts as a ``Replicate`` value (so ``P + 1`` is an error
and ``P * 2`` is fine); a plain NumPy/CuPy array operand is a ``TypeError`` (make it a DTensor
with ``distribute_tensor(..., [Replicate()])`` first: nothing is distributed implicitly).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from functools import lru_cache
from math import prod
from typing import Any

import numpy as np

from ..autograd.function import needs_recording, record_op
from ..autograd.grad_mode import _GradMode
from ..dtensor import DTensor
from ..errors import PlacementError, ShapeMismatchError
from ..placement import Partial
from ..spec import DTensorSpec
from .dimmaps import BroadcastMap, IndexMap, JoinMap, MatmulMap, PermuteMap, RemoveDimsMap, ReshapeMap
from .dispatch import INFERENCE_CACHE_SIZE, OpPlan, infer, prepared
from .tables import BINARY, OTHER, UNARY, WHERE, nary

ARG_NAMES = ("a", "b", "c")


# --- operands ------------------------------------------------------------------------------
def _spec_of(x: Any, op: str) -> DTensorSpec | None:
    if type(x) is DTensor or isinstance(x, DTensor):
        return x._spec
    if isinstance(x, (numbers.Number, np.generic)) and not isinstance(x, np.ndarray):
        return None
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        raise TypeError(
            f"{op}: operand is a {type(x).__module__}.{type(x).__name__}, not a DTensor; make it "
            f"one explicitly, e.g. dt.distribute_tensor(arr, mesh, [Replicate()]*mesh.ndim, "
            f"src_data_rank=None)"
        )
    raise TypeError(f"{op}: unsupported operand type {type(x).__name__}")


def _local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def _wrap(local: Any, plan: OpPlan) -> DTensor:
    return DTensor(local, plan.out_spec(local.dtype))


def _record(op: str, plan: OpPlan, operands: Sequence[Any], inputs: Sequence[Any], out: DTensor,
            params: dict[str, Any] | None = None) -> DTensor:
    """Hand the call to autograd when some operand requires grad (one flag test otherwise)."""
    if _GradMode.enabled and needs_recording(operands):
        cuts = tuple(p.out_spec if p is not None else None for p in plan.prepare)
        record_op(op, plan.placements, cuts, operands, inputs, out, params or {}, plan.xp)
    return out


def _xp(plan: OpPlan) -> Any:
    return plan.xp


# --- elementwise ---------------------------------------------------------------------------
def _shape_of(spec: DTensorSpec | None) -> tuple[int, ...] | None:
    return spec.shape if spec is not None else None


@lru_cache(maxsize=INFERENCE_CACHE_SIZE)
def _plan_elementwise(op: str, specs: tuple[DTensorSpec | None, ...]) -> OpPlan:
    shapes = [s.shape for s in specs if s is not None]
    try:
        out_shape = tuple(np.broadcast_shapes(*shapes))
    except ValueError as exc:
        raise ShapeMismatchError(f"{op}: shapes {[_shape_of(s) for s in specs]} do not broadcast") from exc
    sig = UNARY.get(op) or BINARY.get(op) or (WHERE if op == "where" else OTHER[op])
    dmap = BroadcastMap(tuple(_shape_of(s) for s in specs), out_shape)
    return infer(sig, specs, dmap, out_shape, ARG_NAMES[: len(specs)] if len(specs) > 1 else ("x",))


def binary_fast(op: str, a: Any, b: Any) -> DTensor:
    """The two-operand path of ``elementwise`` with the local function resolved once."""
    ta, tb = type(a) is DTensor, type(b) is DTensor
    sa = a._spec if ta else _spec_of(a, op)
    sb = b._spec if tb else _spec_of(b, op)
    plan = _plan_elementwise(op, (sa, sb))
    fn = plan.resolved.get(op)
    if fn is None:
        fn = plan.resolved[op] = resolve_local(op, plan.xp)
    pa, pb = plan.prepare
    la, lb = a, b
    if sa is not None:
        la = a._local if a._pending is None else a.to_local()
        if pa is not None:
            la = prepared(la, pa)
    if sb is not None:
        lb = b._local if b._pending is None else b.to_local()
        if pb is not None:
            lb = prepared(lb, pb)
    out = fn(la, lb)
    result = DTensor(out, plan.out_spec(out.dtype))
    if _GradMode.enabled and ((ta and a._requires_grad) or (tb and b._requires_grad)):
        return _record(op, plan, (a, b), (la, lb), result)
    return result


def resolve_local(op: str, xp: Any) -> Callable[..., Any]:
    """The array library's own function for ``op`` (a ufunc where there is one)."""
    name = _UFUNC_NAMES.get(op)
    if name is not None:
        return getattr(xp, name)
    fn = LOCAL_BINARY[op] if op in LOCAL_BINARY else LOCAL_UNARY[op]
    return lambda *args, **kw: fn(xp, *args, **kw)


def elementwise(op: str, fn: Callable[..., Any], *operands: Any, **kwargs: Any) -> DTensor:
    specs = tuple([_spec_of(x, op) for x in operands])
    plan = _plan_elementwise(op, specs)
    locals_ = []
    for x, s, steps in zip(operands, specs, plan.prepare):
        if s is None:
            locals_.append(x)
        else:
            local = x._local if x._pending is None else x.to_local()
            locals_.append(local if steps is None else prepared(local, steps))
    out = fn(plan.xp, *locals_, **kwargs)
    return _record(op, plan, operands, locals_, DTensor(out, plan.out_spec(out.dtype)), kwargs)


def inplace(op: str, fn: Callable[..., Any], target: DTensor, other: Any) -> DTensor:
    """``target op= other`` in place: allowed when it keeps ``target``'s placements and shape."""
    specs = (target.spec, _spec_of(other, op))
    plan = _plan_elementwise(op, specs)
    if plan.placements != target.placements or plan.shape != target.shape:
        raise PlacementError(
            f"in-place {op} would change the result to {list(plan.placements)} shape {plan.shape} "
            f"from {list(target.placements)} shape {target.shape}; use the out-of-place form"
        )
    if _GradMode.enabled and target.requires_grad:
        raise RuntimeError(
            f"in-place {op} on a tensor that requires grad: autograd needs its value; use the "
            f"out-of-place form (x = x {op} y), or wrap the update in `with dtorch.no_grad():`"
        )
    local = target.to_local()
    rhs = prepared(_local(other), plan.prepare[1]) if specs[1] is not None else other
    fn(_xp(plan), local, rhs, out=local, casting="same_kind")
    target._version += 1
    return target


_UFUNC_NAMES: dict[str, str] = {}


def _ufunc(name: str, op: str | None = None) -> Callable[..., Any]:
    if op is not None:
        _UFUNC_NAMES[op] = name
    return lambda xp, *args, **kw: getattr(xp, name)(*args, **kw)


def _sigmoid(xp: Any, x: Any, **kw: Any) -> Any:
    return xp.divide(1, 1 + xp.exp(-x), **kw)


def _gelu(xp: Any, x: Any, **kw: Any) -> Any:
    return 0.5 * x * (1 + xp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


LOCAL_UNARY: dict[str, Callable[..., Any]] = {
    "neg": _ufunc("negative"), "relu": lambda xp, x, **kw: xp.maximum(x, 0, **kw),
    "sigmoid": _sigmoid, "gelu": _gelu, "silu": lambda xp, x, **kw: x * _sigmoid(xp, x),
    "softplus": lambda xp, x, **kw: xp.logaddexp(0, x, **kw),
    "clip": lambda xp, x, lo=None, hi=None: xp.clip(x, lo, hi),
}
for _n in ("exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "tanh", "floor", "ceil",
           "trunc", "rint", "arctan", "arcsinh", "cbrt", "abs", "sin", "cos", "tan", "sign",
           "square", "reciprocal", "logical_not", "isnan", "isinf", "isfinite", "arcsin",
           "arccos", "sinh", "cosh", "bitwise_not"):
    LOCAL_UNARY[_n] = _ufunc(_n)

_BINARY_UFUNCS = {
    "add": "add", "sub": "subtract", "mul": "multiply", "truediv": "true_divide",
    "floordiv": "floor_divide", "mod": "remainder", "pow": "power", "maximum": "maximum",
    "minimum": "minimum", "eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal",
    "gt": "greater", "ge": "greater_equal", "logical_and": "logical_and",
    "logical_or": "logical_or", "logical_xor": "logical_xor", "bitwise_and": "bitwise_and",
    "bitwise_or": "bitwise_or", "bitwise_xor": "bitwise_xor", "arctan2": "arctan2", "hypot": "hypot",
}
LOCAL_BINARY: dict[str, Callable[..., Any]] = {
    op: _ufunc(name, op) for op, name in _BINARY_UFUNCS.items()}


def unary(op: str, x: Any, **kwargs: Any) -> DTensor:
    return elementwise(op, LOCAL_UNARY[op], x, **kwargs)


def binary(op: str, a: Any, b: Any) -> DTensor:
    return binary_fast(op, a, b)


def where(cond: Any, a: Any, b: Any) -> DTensor:
    """``numpy.where`` on DTensors (broadcasting; see ``signature("where")``)."""
    return elementwise("where", lambda xp, c, x, y: xp.where(c, x, y), cond, a, b)


def clone(x: DTensor) -> DTensor:
    return elementwise("clone", lambda xp, v: v.copy(), x)


def astype(x: DTensor, dtype: Any) -> DTensor:
    """A cast. Partial inputs only to floating or complex dtypes (other casts are not linear)."""
    from ..dtypes import check_dtype

    dt = check_dtype(dtype)
    if dt.kind not in "fc" and any(isinstance(p, Partial) for p in x.placements):
        raise PlacementError(
            f"astype({dt}): casting a Partial value to a non-floating dtype does not commute with "
            f"its reduction; redistribute first, e.g. x = x.redistribute(placements="
            f"{[p if not isinstance(p, Partial) else 'Replicate()' for p in x.placements]})"
        )
    return elementwise("astype", lambda xp, v: v.astype(dt), x)


# --- matmul --------------------------------------------------------------------------------
def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
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


@lru_cache(maxsize=INFERENCE_CACHE_SIZE)
def _plan_matmul(a: DTensorSpec, b: DTensorSpec) -> OpPlan:
    shape = _matmul_shape(a.shape, b.shape)
    return infer(OTHER["matmul"], (a, b), MatmulMap(a.shape, b.shape, shape), shape, ("a", "b"))


def matmul(a: DTensor, b: DTensor) -> DTensor:
    """``a @ b`` (NumPy semantics). See ``signature("matmul")``."""
    sa, sb = _spec_of(a, "matmul"), _spec_of(b, "matmul")
    if sa is None or sb is None:
        raise TypeError("matmul: both operands must be DTensors (use * for scalars)")
    plan = _plan_matmul(sa, sb)
    la = prepared(a.to_local(), plan.prepare[0])
    lb = prepared(b.to_local(), plan.prepare[1])
    return _record("matmul", plan, (a, b), (la, lb), _wrap(_xp(plan).matmul(la, lb), plan))


# --- reductions ----------------------------------------------------------------------------
def _axes(dim: int | Sequence[int] | None, ndim: int, op: str) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, (int, np.integer)) else tuple(dim)
    out = []
    for d in dims:
        if not -ndim <= d < max(ndim, 1):
            raise IndexError(f"{op}: dim {d} out of range for a {ndim}-D tensor")
        out.append(int(d) % max(ndim, 1))
    return tuple(sorted(set(out)))


@lru_cache(maxsize=INFERENCE_CACHE_SIZE)
def _plan_reduce(op: str, spec: DTensorSpec, axes: tuple[int, ...], keepdim: bool) -> OpPlan:
    shape = tuple(1 if d in axes else n for d, n in enumerate(spec.shape)) if keepdim else tuple(
        n for d, n in enumerate(spec.shape) if d not in axes)
    dmap = RemoveDimsMap(len(spec.shape), frozenset(axes), keepdim)
    return infer(OTHER[op], (spec,), dmap, shape, ("x",))


def reduce(op: str, x: DTensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> DTensor:
    """sum / mean / max / min / prod over ``dim`` (all dims when None) of a DTensor."""
    spec = _spec_of(x, op)
    assert spec is not None
    axes = _axes(dim, x.ndim, op)
    plan = _plan_reduce(op, spec, axes, keepdim)
    xp = _xp(plan)
    local = x.to_local()
    count = prod(spec.shape[d] for d in axes)
    if op == "sum":
        out = xp.sum(local, axis=axes, keepdims=keepdim)
    elif op == "prod":
        out = xp.prod(local, axis=axes, keepdims=keepdim)
    elif op == "mean":
        acc = np.dtype(np.float64) if local.dtype.kind in "biu" else local.dtype
        out = xp.sum(local, axis=axes, keepdims=keepdim, dtype=acc)
        out = xp.true_divide(out, count) if count else out * xp.nan
        out = out.astype(acc)
    else:
        if count == 0:
            raise ValueError(f"{op} of an empty dim: zero-size reduction has no identity")
        fn = xp.max if op == "max" else xp.min
        if plan.reduced_sharded:
            from ..dtypes import identity_value

            out = fn(local, axis=axes, keepdims=keepdim, initial=identity_value(local.dtype, op))
        else:
            out = fn(local, axis=axes, keepdims=keepdim)
    params = {"axes": axes, "keepdim": keepdim, "count": count, "in_shape": local.shape}
    return _record(op, plan, (x,), (local,), _wrap(xp.asarray(out), plan), params)


def arg_reduce(op: str, x: DTensor, dim: int | None = None, keepdim: bool = False) -> DTensor:
    """argmax / argmin along an unsharded ``dim`` (flattened when None and nothing is sharded)."""
    spec = _spec_of(x, op)
    assert spec is not None
    axes = _axes(dim, x.ndim, op)
    plan = _plan_reduce(op, spec, axes, keepdim and dim is not None)
    fn = getattr(_xp(plan), op)
    local = x.to_local()
    out = fn(local, axis=dim, keepdims=keepdim) if dim is not None else fn(local)
    return _wrap(_xp(plan).asarray(out), plan)


# --- softmax -------------------------------------------------------------------------------
@lru_cache(maxsize=INFERENCE_CACHE_SIZE)
def _plan_softmax(op: str, spec: DTensorSpec, dim: int) -> OpPlan:
    dmap = RemoveDimsMap(len(spec.shape), frozenset((dim,)), True)
    return infer(OTHER[op], (spec,), dmap, spec.shape, ("x",))


def softmax(x: DTensor, dim: int = -1, *, log: bool = False) -> DTensor:
    """Softmax (or log-softmax) along an unsharded ``dim``."""
    op = "log_softmax" if log else "softmax"
    spec = _spec_of(x, op)
    assert spec is not None
    (axis,) = _axes(dim, x.ndim, op)
    plan = _plan_softmax(op, spec, axis)
    xp = _xp(plan)
    v = x.to_local()
    if v.dtype.kind in "biu":
        v = v.astype(np.float64)
    shifted = v - (xp.max(v, axis=axis, keepdims=True) if v.size else 0)
    e = xp.exp(shifted)
    s = xp.sum(e, axis=axis, keepdims=True)
    return _record(op, plan, (x,), (v,), _wrap(shifted - xp.log(s) if log else e / s, plan), {"axis": axis})


def log_softmax(x: DTensor, dim: int = -1) -> DTensor:
    return softmax(x, dim, log=True)


# --- layout --------------------------------------------------------------------------------
@lru_cache(maxsize=INFERENCE_CACHE_SIZE)
def _plan_permute(spec: DTensorSpec, perm: tuple[int, ...]) -> OpPlan:
    shape = tuple(spec.shape[p] for p in perm)
    return infer(OTHER["transpose"], (spec,), PermuteMap(perm), shape, ("x",))


def permute(x: DTensor, *dims: Any) -> DTensor:
    """Reorder dims; Shard dims follow the data."""
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    perm = tuple(int(d) % max(x.ndim, 1) for d in dims)
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"permute: {dims} is not a permutation of {x.ndim} dims")
    spec = _spec_of(x, "permute")
    assert spec is not None
    plan = _plan_permute(spec, perm)
    local = x.to_local()
    return _record("transpose", plan, (x,), (local,), _wrap(_xp(plan).transpose(local, perm), plan),
                   {"perm": perm})


def transpose(x: DTensor, dim0: int = -2, dim1: int = -1) -> DTensor:
    """Swap two dims (a 2-D tensor's transpose by default)."""
    if x.ndim < 2:
        return permute(x, tuple(range(x.ndim)))
    perm = list(range(x.ndim))
    a, b = dim0 % x.ndim, dim1 % x.ndim
    perm[a], perm[b] = perm[b], perm[a]
    return permute(x, tuple(perm))


swapaxes = transpose


@lru_cache(maxsize=INFERENCE_CACHE_SIZE)
def _plan_reshape(spec: DTensorSpec, shape: tuple[int, ...]) -> OpPlan:
    return infer(OTHER["reshape"], (spec,), ReshapeMap(spec.shape, shape), shape, ("x",))


def _resolve_shape(shape: Sequence[int], size: int) -> tuple[int, ...]:
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


def reshape(x: DTensor, *shape: Any) -> DTensor:
    """Reshape where the result is expressible without moving data (see its signature)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    spec = _spec_of(x, "reshape")
    assert spec is not None
    new = _resolve_shape(shape, prod(spec.shape))
    plan = _plan_reshape(spec, new)
    local = x.to_local()
    out = _wrap(local.reshape(plan_local_shape(plan)), plan)
    return _record("reshape", plan, (x,), (local,), out, {"in_local_shape": local.shape})


def plan_local_shape(plan: OpPlan) -> tuple[int, ...]:
    return DTensorSpec(plan.mesh, plan.placements, plan.shape, np.dtype("f4")).local_shape


def flatten(x: DTensor, start_dim: int = 0, end_dim: int = -1) -> DTensor:
    if x.ndim == 0:
        return reshape(x, (1,))
    s, e = start_dim % x.ndim, end_dim % x.ndim
    return reshape(x, x.shape[:s] + (prod(x.shape[s : e + 1]),) + x.shape[e + 1 :])


def squeeze(x: DTensor, dim: int | None = None) -> DTensor:
    if dim is None:
        return reshape(x, tuple(n for n in x.shape if n != 1))
    d = dim % x.ndim
    if x.shape[d] != 1:
        return x
    return reshape(x, x.shape[:d] + x.shape[d + 1 :])


def unsqueeze(x: DTensor, dim: int) -> DTensor:
    d = dim % (x.ndim + 1)
    return reshape(x, x.shape[:d] + (1,) + x.shape[d:])


def _index_plan(shape: tuple[int, ...], key: Any) -> tuple[tuple[int | None, ...], tuple[int, ...], tuple[Any, ...]]:
    if not isinstance(key, tuple):
        key = (key,)
    for k in key:
        if not (k is None or k is Ellipsis or isinstance(k, (slice, int, np.integer))) or isinstance(k, bool):
            raise TypeError(
                f"indexing: {type(k).__name__} keys (advanced indexing) are not supported; use "
                f"ints, slices, None and ..."
            )
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


@lru_cache(maxsize=INFERENCE_CACHE_SIZE)
def _plan_getitem(spec: DTensorSpec, key: tuple[Any, ...]) -> tuple[OpPlan, tuple[Any, ...]]:
    kept, shape, full_key = _index_plan(spec.shape, _real_key(key))
    return infer(OTHER["getitem"], (spec,), IndexMap(kept), shape, ("x",)), full_key


def _hashable_key(key: Any) -> tuple[Any, ...]:
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


def getitem(x: DTensor, key: Any) -> DTensor:
    """Basic indexing; sharded dims must be taken whole (``[:]``)."""
    spec = _spec_of(x, "getitem")
    assert spec is not None
    plan, full_key = _plan_getitem(spec, _hashable_key(key))
    local = x.to_local()
    out = _wrap(local[full_key], plan)
    return _record("getitem", plan, (x,), (local,), out, {"key": full_key, "in_local_shape": local.shape})


def _join_plan(op: str, specs: tuple[DTensorSpec, ...], axis: int) -> OpPlan:
    sig = nary(OTHER[op], len(specs))
    first = specs[0].shape
    if op == "cat":
        for s in specs[1:]:
            if len(s.shape) != len(first) or any(a != b for d, (a, b) in enumerate(zip(s.shape, first)) if d != axis):
                raise ShapeMismatchError(f"cat: shapes {[t.shape for t in specs]} differ outside dim {axis}")
        shape = first[:axis] + (sum(s.shape[axis] for s in specs),) + first[axis + 1 :]
    else:
        if any(s.shape != first for s in specs):
            raise ShapeMismatchError(f"stack: shapes differ: {[t.shape for t in specs]}")
        shape = first[:axis] + (len(specs),) + first[axis:]
    names = tuple(f"tensors[{i}]" for i in range(len(specs)))
    return infer(sig, specs, JoinMap(axis, op == "stack"), shape, names)


_plan_join = lru_cache(maxsize=INFERENCE_CACHE_SIZE)(_join_plan)


def cat(tensors: Sequence[DTensor], dim: int = 0) -> DTensor:
    """Concatenate along an unsharded ``dim``; all inputs share placements."""
    specs = tuple(_spec_of(t, "cat") for t in tensors)
    if not specs or any(s is None for s in specs):
        raise TypeError("cat: needs a non-empty sequence of DTensors")
    axis = dim % max(len(specs[0].shape), 1)  # type: ignore[union-attr]
    plan = _plan_join("cat", specs, axis)  # type: ignore[arg-type]
    locals_ = [t.to_local() for t in tensors]
    out = _wrap(_xp(plan).concatenate(locals_, axis=axis), plan)
    params = {"axis": axis, "sizes": [piece.shape[axis] for piece in locals_]}
    return _record("cat", plan, tuple(tensors), locals_, out, params)


def stack(tensors: Sequence[DTensor], dim: int = 0) -> DTensor:
    """Stack along a new ``dim``; all inputs share placements and shape."""
    specs = tuple(_spec_of(t, "stack") for t in tensors)
    if not specs or any(s is None for s in specs):
        raise TypeError("stack: needs a non-empty sequence of DTensors")
    axis = dim % (len(specs[0].shape) + 1)  # type: ignore[union-attr]
    plan = _plan_join("stack", specs, axis)  # type: ignore[arg-type]
    locals_ = [t.to_local() for t in tensors]
    out = _wrap(_xp(plan).stack(locals_, axis=axis), plan)
    return _record("stack", plan, tuple(tensors), locals_, out, {"axis": axis, "count": len(locals_)})


def cache_info() -> dict[str, Any]:
    """Sizes of the bounded inference caches."""
    return {f.__name__: f.cache_info() for f in (
        _plan_elementwise, _plan_matmul, _plan_reduce, _plan_softmax, _plan_permute,
        _plan_reshape, _plan_getitem, _plan_join)}
