"""Applying an operator: operands -> cached plan -> prepared local inputs -> kernel -> ``finish``.

One path per operator family; every path ends in ``finish``, the single point where an
operator's output DTensor is built (autograd records there). Plans come from one bounded
cache per mesh shared by every operator (``plan_for``; ``cache_info``/``clear_plan_cache``);
``DeviceMesh.free()`` empties only that mesh's.

Operand rules: a Python or NumPy scalar acts as a ``Replicate`` value (so ``P + 1`` is an error
and ``P * 2`` is fine); a plain NumPy/CuPy array operand is a ``TypeError`` (make it a DTensor
with ``distribute_tensor(..., [Replicate()])`` first: nothing is distributed implicitly).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from math import prod
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..autograd import skipping as _skipping
from ..autograd.record import mark_changed, needs_recording, record_op
from ..dtensor import DTensor
from ..errors import PlacementError
from ..grad_mode import _GradMode
from ..mesh import cached_per_mesh, live_caches
from ..redistribute import run_compiled
from ..spec import DTensorSpec
from .dispatch import INFERENCE_CACHE_SIZE, OpPlan
from .planners import axes_of, hashable_key, resolve_shape
from .registry import Op

Operand = DTensor | complex | np.generic
NO_PARAMS: Mapping[str, Any] = MappingProxyType({})


# --- the one plan cache ---------------------------------------------------------------------
def _resolve_kernel(op: Op, xp: Any) -> Callable[..., Any]:
    if op.ufunc is not None:
        return getattr(xp, op.ufunc)  # type: ignore[no-any-return]
    assert op.kernel is not None, f"operator {op.name} declares neither kernel nor ufunc"
    return partial(op.kernel, xp)


def plan_for(op: Op, specs: tuple[DTensorSpec | None, ...], params: tuple[Any, ...]) -> OpPlan:
    """The plan of ``op`` on these input specs and hashable parameters, built once (metadata
    only) with the op's kernel resolved for the mesh's array library, and cached in the mesh of
    the first DTensor input (``mesh._op_plans``; ``DeviceMesh.free()`` empties it, so a freed
    mesh always reaches the check below)."""
    for spec in specs:
        if spec is not None:
            return spec.mesh._op_plans(op, specs, params)  # type: ignore[no-any-return]
    raise TypeError(f"{op.name}: no DTensor input")


@cached_per_mesh("_op_plans", maxsize=INFERENCE_CACHE_SIZE)
def _plan_for(op: Op, specs: tuple[DTensorSpec | None, ...], params: tuple[Any, ...]) -> OpPlan:
    for spec in specs:
        if spec is not None:
            spec.mesh._check_alive()
    plan = op.planner(op, specs, params)
    return replace(plan, kernel=_resolve_kernel(op, plan.xp))


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    maxsize: int
    currsize: int


def cache_info() -> CacheInfo:
    """Hits, misses, per-mesh bound and size of the operator plan caches of every live mesh."""
    infos = [cache.cache_info() for cache in live_caches("_op_plans")]
    return CacheInfo(sum(i.hits for i in infos), sum(i.misses for i in infos), INFERENCE_CACHE_SIZE,
                     sum(i.currsize for i in infos))


def clear_plan_cache() -> None:
    """Drop every live mesh's cached operator plans (``DeviceMesh.free()`` drops its own)."""
    for cache in live_caches("_op_plans"):
        cache.cache_clear()


# --- the one application point --------------------------------------------------------------
def finish(op: Op, plan: OpPlan, operands: Sequence[Any], inputs: Sequence[Any], out: Any,
           params: Mapping[str, Any]) -> DTensor:
    """Build the output DTensor of ``op``: the single point every operator's result passes.

    ``plan``: the OpPlan (``plan.rules`` the rule matched per mesh dim, ``plan.prepare`` each
    input's local slice plan); ``operands``: what the caller passed (DTensors or scalars);
    ``inputs``: the prepared local pieces the kernel ran on; ``out``: the local result;
    ``params``: the op's parameters (dim, keepdim, perm, shape, key, ...).
    Autograd records here when some operand requires grad (one flag test otherwise).
    """
    result = DTensor(out, plan.out_spec(out.dtype))
    if _GradMode.recording and op.backward is not None and needs_recording(operands):
        record_op(op.name, op.backward, plan, operands, inputs, result, params)
    return result


def _kernel_for(plan: OpPlan, op: Op, operands: Sequence[Any]) -> Callable[..., Any]:
    """``plan.kernel``; during an activation-checkpoint recompute, for an operation whose result
    no backward reads, a stand-in returning zeros of its shape (autograd/skipping.py)."""
    if _skipping.ACTIVE is not None and _GradMode.recording and op.backward is not None and needs_recording(operands):
        stand = _skipping.stand_in(op.name, operands, plan.xp)
        if stand is not None:
            return stand  # type: ignore[no-any-return]
    return plan.kernel


# --- operands --------------------------------------------------------------------------------
def spec_of(x: Any, op: str) -> DTensorSpec | None:
    """A DTensor's spec; None for a scalar; TypeError for anything else."""
    if isinstance(x, DTensor):
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


def tensor_spec(x: Any, op: str, what: str = "x") -> DTensorSpec:
    """The spec of an operand that must be a DTensor (TypeError naming the op otherwise)."""
    if isinstance(x, DTensor):
        return x._spec
    raise TypeError(f"{op}: {what} must be a DTensor, got {type(x).__name__}")


def _prepared(x: Any, spec: DTensorSpec | None, steps: Any) -> Any:
    if spec is None:
        return x
    local = x._local if x._pending is None else x.to_local()
    return local if steps is None else run_compiled(local, steps, operand=True)


def _check_params(op: Op, params: Mapping[str, Any]) -> None:
    if op.params is not None:
        unknown = sorted(set(params) - set(op.params))
        if unknown:
            accepted = ", ".join(op.params) or "no keyword arguments"
            raise TypeError(f"{op.name}() got unexpected keyword argument(s) {unknown}; it accepts {accepted}")


# --- elementwise ------------------------------------------------------------------------------
def apply_elementwise(op: Op, operands: Sequence[Any], params: Mapping[str, Any]) -> DTensor:
    """Broadcasting elementwise ops of any arity (scalars act as Replicate)."""
    _check_params(op, params)
    specs = tuple([spec_of(x, op.name) for x in operands])
    plan = plan_for(op, specs, ())
    inputs = [_prepared(x, s, steps) for x, s, steps in zip(operands, specs, plan.prepare)]
    return finish(op, plan, operands, inputs, _kernel_for(plan, op, operands)(*inputs, **params), params)


class UnaryFn(Protocol):
    def __call__(self, x: DTensor, /, **kwargs: Any) -> DTensor: ...


class BinaryFn(Protocol):
    def __call__(self, a: Operand, b: Operand, /) -> DTensor: ...


def unary(op: Op, *methods: str, alias: tuple[str, ...] = ()) -> UnaryFn:
    """Declare elementwise unary ``op``: ``dtorch.<name>(x)`` and ``x.<name>()`` (and ``methods``)."""

    def fn(x: DTensor, /, **kwargs: Any) -> DTensor:
        return apply_elementwise(op, (x,), kwargs)

    fn.__name__ = fn.__qualname__ = op.name
    fn.__doc__ = op.doc or f"Elementwise {op.name}. Placement rules: dtorch_mpi.signature({op.name!r})."
    return op.define(op.name, *methods, alias=alias)(fn)


def binary(op: Op, *methods: str, reflected: tuple[str, ...] = (), inplace: tuple[str, ...] = (),
           alias: tuple[str, ...] = ()) -> BinaryFn:
    """Declare broadcasting binary ``op``: ``dtorch.<name>(a, b)``, DTensor ``methods``
    (``__add__``), ``reflected`` operators (``__radd__``) and ``inplace`` ones (``__iadd__``).
    The function below is the one path of every binary op (its speed is benchmarked)."""
    name = op.name

    def fn(a: Operand, b: Operand, /) -> DTensor:
        sa = a._spec if type(a) is DTensor else spec_of(a, name)
        sb = b._spec if type(b) is DTensor else spec_of(b, name)
        first = sa if sa is not None else sb  # plan_for inlined: the mesh's cache, one call less
        plan = plan_for(op, (sa, sb), ()) if first is None else first.mesh._op_plans(op, (sa, sb), ())
        pa, pb = plan.prepare
        la, lb = _prepared(a, sa, pa), _prepared(b, sb, pb)
        kernel = plan.kernel if _skipping.ACTIVE is None else _kernel_for(plan, op, (a, b))
        return finish(op, plan, (a, b), (la, lb), kernel(la, lb), NO_PARAMS)

    def reflected_fn(a: Operand, b: Operand, /) -> DTensor:
        return fn(b, a)

    def inplace_fn(target: DTensor, other: Operand, /) -> DTensor:
        return apply_inplace(op, target, other)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = op.doc or (f"Elementwise {name} with broadcasting. A Replicate operand is sliced locally to "
                            f"the other operand's Shard (no communication). Rules: signature({name!r}).")
    for method in reflected:
        op.bind(method, reflected_fn)
    for method in inplace:
        op.bind(method, inplace_fn)
    return op.define(*methods, alias=alias)(fn)


def apply_inplace(op: Op, target: DTensor, other: Any) -> DTensor:
    """``target op= other`` in place: allowed when it keeps ``target``'s placements and shape."""
    specs = (tensor_spec(target, op.name, "the in-place target"), spec_of(other, op.name))
    plan = plan_for(op, specs, ())
    if plan.placements != target.placements or plan.shape != target.shape:
        raise PlacementError(
            f"in-place {op.name} would change the result to {list(plan.placements)} shape {plan.shape} "
            f"from {list(target.placements)} shape {target.shape}; use the out-of-place form"
        )
    if _GradMode.enabled and target.requires_grad:
        raise RuntimeError(
            f"in-place {op.name} on a tensor that requires grad: autograd needs its value; use the "
            f"out-of-place form (x = x {op.name} y), or wrap the update in `with dtorch.no_grad():`"
        )
    local = target.to_local()
    rhs = _prepared(other, specs[1], plan.prepare[1])
    plan.kernel(local, rhs, out=local, casting="same_kind")
    mark_changed(target)
    return target


# --- matmul, reductions, along-dim, layout, joins ----------------------------------------------
def apply_matmul(op: Op, a: DTensor, b: DTensor) -> DTensor:
    specs = (spec_of(a, op.name), spec_of(b, op.name))
    if specs[0] is None or specs[1] is None:
        raise TypeError("matmul: both operands must be DTensors (use * for scalars)")
    plan = plan_for(op, specs, ())
    inputs = (_prepared(a, specs[0], plan.prepare[0]), _prepared(b, specs[1], plan.prepare[1]))
    return finish(op, plan, (a, b), inputs, _kernel_for(plan, op, (a, b))(*inputs), NO_PARAMS)


def apply_reduce(op: Op, x: DTensor, dim: int | Sequence[int] | None, keepdim: bool,
                 **extra: Any) -> DTensor:
    """sum / mean / max / min / prod / all / any / std / var over ``dim`` (all dims when None);
    ``extra`` (e.g. std's ``ddof``) goes to the kernel and the backward."""
    spec = tensor_spec(x, op.name)
    axes = axes_of(dim, len(spec.shape), op.name)
    keepdim = bool(keepdim)
    plan = plan_for(op, (spec,), (axes, keepdim))
    local = x.to_local()
    count = prod(spec.shape[d] for d in axes)
    out = _kernel_for(plan, op, (x,))(local, axes, keepdim, count, plan.reduced_sharded, **extra)
    return finish(op, plan, (x,), (local,), out, {"dim": axes, "keepdim": keepdim, **extra})


def apply_arg_reduce(op: Op, x: DTensor, dim: int | None, keepdim: bool) -> DTensor:
    """argmax / argmin along an unsharded ``dim`` (flattened when None)."""
    spec = tensor_spec(x, op.name)
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, (int, np.integer))):
        raise TypeError(f"{op.name}: dim must be an int or None, got {dim!r}")
    axes = axes_of(dim, len(spec.shape), op.name)
    keep = bool(keepdim) and dim is not None
    plan = plan_for(op, (spec,), (axes, keep))
    axis = None if dim is None else axes[0]
    local = x.to_local()
    out = _kernel_for(plan, op, (x,))(local, axis, keep)
    return finish(op, plan, (x,), (local,), out, {"dim": axis, "keepdim": keep})


def apply_along_dim(op: Op, x: DTensor, dim: int, **params: Any) -> DTensor:
    """Shape-preserving ops along one unsharded dim (softmax, log_softmax, cumsum)."""
    spec = tensor_spec(x, op.name)
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"{op.name}: dim must be an int, got {dim!r}")
    (axis,) = axes_of(dim, len(spec.shape), op.name)
    plan = plan_for(op, (spec,), (axis,))
    local = x.to_local()
    out = _kernel_for(plan, op, (x,))(local, dim=axis, **params)
    return finish(op, plan, (x,), (local,), out, {"dim": axis, **params})


def apply_permute(op: Op, x: DTensor, perm: tuple[int, ...]) -> DTensor:
    spec = tensor_spec(x, op.name)
    plan = plan_for(op, (spec,), (perm,))
    local = x.to_local()
    return finish(op, plan, (x,), (local,), _kernel_for(plan, op, (x,))(local, perm), {"perm": perm})


def apply_reshape(op: Op, x: DTensor, shape: Sequence[int]) -> DTensor:
    spec = tensor_spec(x, op.name)
    new = resolve_shape(shape, prod(spec.shape))
    plan = plan_for(op, (spec,), (new,))
    local = x.to_local()
    return finish(op, plan, (x,), (local,), _kernel_for(plan, op, (x,))(local, plan.aux), {"shape": new})


def apply_getitem(op: Op, x: DTensor, key: Any) -> DTensor:
    spec = tensor_spec(x, op.name)
    plan = plan_for(op, (spec,), (hashable_key(key),))
    local = x.to_local()
    return finish(op, plan, (x,), (local,), _kernel_for(plan, op, (x,))(local, plan.aux), {"key": plan.aux})


def apply_join(op: Op, tensors: Sequence[DTensor], dim: int, new_dim: bool) -> DTensor:
    """cat (``new_dim=False``) / stack along ``dim``; every input a DTensor with equal placements."""
    if not isinstance(tensors, DTensor) and isinstance(tensors, Iterable):
        tensors = list(tensors)
    if not isinstance(tensors, list) or not tensors or not all(isinstance(t, DTensor) for t in tensors):
        raise TypeError(f"{op.name}: needs a non-empty sequence of DTensors")
    specs = tuple(t._spec for t in tensors)
    axis = dim % (len(specs[0].shape) + (1 if new_dim else 0) or 1)
    plan = plan_for(op, specs, (axis,))
    inputs = [t.to_local() for t in tensors]
    return finish(op, plan, tuple(tensors), inputs, _kernel_for(plan, op, tensors)(*inputs, dim=axis), {"dim": axis})


def spelling(op: str, torch_name: str, torch_value: Any, numpy_name: str, numpy_value: Any,
             default: Any) -> Any:
    """One parameter spelled the torch way or the NumPy way (``dim``/``axis``,
    ``keepdim``/``keepdims``): either is accepted, both at once is a TypeError."""
    if torch_value is not None and numpy_value is not None:
        raise TypeError(f"{op}() got both {torch_name}= and {numpy_name}= (the same parameter spelled "
                        f"the torch and the NumPy way); pass one")
    if torch_value is not None:
        return torch_value
    return default if numpy_value is None else numpy_value


class ReduceFn(Protocol):
    def __call__(self, x: DTensor, dim: int | Sequence[int] | None = None, keepdim: bool | None = None, *,
                 axis: int | Sequence[int] | None = None, keepdims: bool | None = None) -> DTensor: ...


class ArgReduceFn(Protocol):
    def __call__(self, x: DTensor, dim: int | None = None, keepdim: bool | None = None, *,
                 axis: int | None = None, keepdims: bool | None = None) -> DTensor: ...


def reduction(op: Op) -> ReduceFn:
    """Declare reduction ``op``: ``dtorch.<name>(x, dim=None, keepdim=False)`` and the method
    (NumPy's ``axis=``/``keepdims=`` accepted too)."""

    def fn(x: DTensor, dim: int | Sequence[int] | None = None, keepdim: bool | None = None, *,
           axis: int | Sequence[int] | None = None, keepdims: bool | None = None) -> DTensor:
        return apply_reduce(op, x, spelling(op.name, "dim", dim, "axis", axis, None),
                            spelling(op.name, "keepdim", keepdim, "keepdims", keepdims, False))

    fn.__name__ = fn.__qualname__ = op.name
    fn.__doc__ = op.doc or (f"{op.name} over ``dim`` (all dims when None; ``axis=`` and ``keepdims=`` "
                            f"are NumPy's spellings). Over a sharded dim the result is Partial; rules: "
                            f"dtorch_mpi.signature({op.name!r}).")
    return op.define(op.name)(fn)


def arg_reduction(op: Op) -> ArgReduceFn:
    """Declare ``argmax``/``argmin``: along an unsharded ``dim`` (flattened when None)."""

    def fn(x: DTensor, dim: int | None = None, keepdim: bool | None = None, *, axis: int | None = None,
           keepdims: bool | None = None) -> DTensor:
        return apply_arg_reduce(op, x, spelling(op.name, "dim", dim, "axis", axis, None),
                                spelling(op.name, "keepdim", keepdim, "keepdims", keepdims, False))

    fn.__name__ = fn.__qualname__ = op.name
    fn.__doc__ = op.doc or (f"{op.name} along an unsharded ``dim`` (the flattened tensor when None); "
                            f"rules: dtorch_mpi.signature({op.name!r}).")
    return op.define(op.name)(fn)
