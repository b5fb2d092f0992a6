"""Reductions: sum, mean, max, min, prod, all, any, std, var, argmax, argmin. Each declaration
holds the op's rule table, kernel and backward.

Reduction kernels take ``(xp, piece, axes, keepdim, count, partial)``: ``count`` is the number
of elements reduced globally per output element; ``partial``: a reduced dim is sharded (the
piece's result is one term of a Partial).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtensor import DTensor
from ..dtypes import identity_value
from .apply import apply_reduce, arg_reduction, reduction, spelling
from .backward import Backward
from .planners import plan_reduce
from .registry import Op
from .signature import P, R, Rule, S, Signature
from .tables import LINEAR_PARTIALS

REDUCE_DOC = ("Shard(r) on a reduced dim: each rank reduces its piece and the result is Partial; "
              "mean divides the local sum by the global count (exact on uneven pieces)")
SPREAD_DOC = ("the reduced dims must not be sharded (a variance is no single Partial term); over a "
              "sharded dim d, with one small explicit all-reduce of the means: m = x.mean(d, keepdim=True)"
              ".redistribute(placements=[Replicate()]); ((x - m) ** 2).mean(d) (sqrt of it for std), "
              "a Partial(\"sum\") result. ddof=0 (NumPy's default; torch's correction=1 is ddof=1)")
ARG_DOC = ("the dim must not be sharded: over a sharded dim each rank's best (value, global index) "
           "would have to be combined across ranks (MPI_MAXLOC), which is communication, and "
           "operators never communicate. Make that dim whole first (the suggested redistribute), or "
           "take the values alone with max/min (a Partial result)")


def _rules(name: str, partial_out: str | None, keeps: tuple[str, ...] = (), doc: str | None = None) -> Signature:
    """A reduction's table: ``Shard(r)`` on a reduced dim gives ``Partial(partial_out)`` (when the
    op has one), and the Partial inputs in ``keeps`` stay."""
    rules = [Rule((S("d"),), S("d")), Rule((R,), R)]
    if partial_out:
        rules.append(Rule((S("r"),), P(partial_out)))
    rules += [Rule((P(p),), P(p)) for p in keeps]
    default = REDUCE_DOC if partial_out else "reduced dims must not be sharded (no Partial reduce op for it)"
    return Signature(name, tuple(rules), default if doc is None else doc)


# --- kernels -------------------------------------------------------------------------------
def reduce_sum(xp: Any, x: Any, axes: tuple[int, ...], keepdim: bool, count: int, partial: bool) -> Any:
    return xp.asarray(xp.sum(x, axis=axes, keepdims=keepdim))


def reduce_prod(xp: Any, x: Any, axes: tuple[int, ...], keepdim: bool, count: int, partial: bool) -> Any:
    return xp.asarray(xp.prod(x, axis=axes, keepdims=keepdim))


def reduce_all(xp: Any, x: Any, axes: tuple[int, ...], keepdim: bool, count: int, partial: bool) -> Any:
    """An empty piece gives True, the identity of Partial("min") on booleans (min is and)."""
    return xp.asarray(xp.all(x, axis=axes, keepdims=keepdim))


def reduce_any(xp: Any, x: Any, axes: tuple[int, ...], keepdim: bool, count: int, partial: bool) -> Any:
    """An empty piece gives False, the identity of Partial("max") on booleans (max is or)."""
    return xp.asarray(xp.any(x, axis=axes, keepdims=keepdim))


def reduce_var(xp: Any, x: Any, axes: tuple[int, ...], keepdim: bool, count: int, partial: bool,
               ddof: int = 0) -> Any:
    """Over unsharded dims only (the rules refuse a sharded one): the piece holds every term."""
    return xp.asarray(xp.var(x, axis=axes, keepdims=keepdim, ddof=ddof))


def reduce_std(xp: Any, x: Any, axes: tuple[int, ...], keepdim: bool, count: int, partial: bool,
               ddof: int = 0) -> Any:
    return xp.asarray(xp.std(x, axis=axes, keepdims=keepdim, ddof=ddof))


def reduce_mean(xp: Any, x: Any, axes: tuple[int, ...], keepdim: bool, count: int, partial: bool) -> Any:
    """The local sum over the GLOBAL count: exact on uneven pieces once the terms are summed."""
    acc = np.dtype(np.float64) if x.dtype.kind in "biu" else x.dtype
    out = xp.sum(x, axis=axes, keepdims=keepdim, dtype=acc)
    out = xp.true_divide(out, count) if count else out * xp.nan
    return xp.asarray(out.astype(acc))


def _extreme_kernel(name: str) -> Any:
    def kernel(xp: Any, x: Any, axes: tuple[int, ...], keepdim: bool, count: int, partial: bool) -> Any:
        if count == 0:
            raise ValueError(f"{name} of an empty dim: zero-size reduction has no identity")
        fn = getattr(xp, name)
        if partial:  # an empty piece contributes the identity term
            return xp.asarray(fn(x, axis=axes, keepdims=keepdim, initial=identity_value(x.dtype, name)))
        return xp.asarray(fn(x, axis=axes, keepdims=keepdim))

    kernel.__name__ = f"reduce_{name}"
    return kernel


def arg_reduce(name: str) -> Any:
    def kernel(xp: Any, x: Any, dim: int | None, keepdim: bool) -> Any:
        fn = getattr(xp, name)
        return xp.asarray(fn(x, axis=dim, keepdims=keepdim) if dim is not None else fn(x))

    kernel.__name__ = name
    return kernel


# --- backwards -----------------------------------------------------------------------------
def _expand(g: Any, p: dict[str, Any]) -> Any:
    """``g`` of a reduction with its reduced dims put back (size 1) when keepdim was False."""
    if p["keepdim"]:
        return g
    for axis in p["dim"]:
        g = g.reshape(g.shape[:axis] + (1,) + g.shape[axis:])
    return g


def _count(p: dict[str, Any]) -> int:
    """The global number of elements a reduction combined (its input spec's reduced dims)."""
    shape = p["in_specs"][0].shape
    return math.prod(shape[d] for d in p["dim"])


def _others_product(x: Any, axes: tuple[int, ...], xp: Any) -> Any:
    """For every element, the product of the other elements over ``axes`` (no division, so
    zeros are exact): exclusive cumulative products from both ends."""
    rest = [d for d in range(x.ndim) if d not in axes]
    moved = xp.transpose(x, rest + list(axes))
    flat = moved.reshape(moved.shape[: len(rest)] + (math.prod(x.shape[d] for d in axes),))
    ones = xp.ones(flat.shape[:-1] + (1,), dtype=x.dtype)
    left = xp.cumprod(xp.concatenate([ones, flat[..., :-1]], axis=-1), axis=-1)
    right = xp.flip(xp.cumprod(xp.concatenate([ones, xp.flip(flat, -1)[..., :-1]], axis=-1), axis=-1), -1)
    others = (left * right).reshape(moved.shape)
    return xp.transpose(others, np.argsort(rest + list(axes)))


def _extreme(g: Any, xs: tuple[Any, ...], out: Any, p: dict[str, Any], xp: Any) -> tuple[Any]:
    x = xs[0]
    mask = x == _expand(out, p)
    count = xp.sum(mask, axis=p["dim"], keepdims=True)
    return (_expand(g, p) * mask / count,)


def _spread(std: bool) -> Backward:
    """var: 2 g (x - mean) / (n - ddof); std: g (x - mean) / ((n - ddof) y), 0 where y = 0
    (constant terms: the subgradient; torch gives NaN there). The reduced dims
    are unsharded (the forward's rules), so the piece holds all n terms of each output."""

    def kernel(g: Any, xs: tuple[Any, ...], out: Any, p: dict[str, Any], xp: Any) -> tuple[Any]:
        x = xs[0]
        centred = x - xp.mean(x, axis=p["dim"], keepdims=True)
        n = math.prod(x.shape[d] for d in p["dim"]) - p.get("ddof", 0)
        grad = _expand(g, p) * centred / n
        if not std:
            return (2 * grad,)
        y = _expand(out, p)
        return (grad / xp.where(y == 0, 1, y),)  # y = 0: every term equals the mean, gradient 0

    formula = "g (x - mean) / ((n - ddof) y)" if std else "2 g (x - mean) / (n - ddof)"
    return Backward(kernel, True, std, formula)


# --- declarations --------------------------------------------------------------------------
sum = reduction(Op("sum", _rules("sum", "sum", LINEAR_PARTIALS), plan_reduce, reduce_sum, reference=np.sum,
                   backward=Backward(lambda g, xs, out, p, xp: (xp.broadcast_to(_expand(g, p), p["in_shapes"][0]),),
                                     False, False, "g broadcast over the reduced dims")))
mean = reduction(Op("mean", _rules("mean", "sum", LINEAR_PARTIALS), plan_reduce, reduce_mean, reference=np.mean,
                    backward=Backward(lambda g, xs, out, p, xp: (
                        xp.broadcast_to(_expand(g, p) / _count(p), p["in_shapes"][0]),), False, False,
                        "g / n broadcast over the reduced dims (n: the global count)")))
max = reduction(Op("max", _rules("max", "max", ("max",)), plan_reduce, _extreme_kernel("max"), reference=np.max,
                   backward=Backward(_extreme, True, True, "g shared by the maxima (split on ties)")))
min = reduction(Op("min", _rules("min", "min", ("min",)), plan_reduce, _extreme_kernel("min"), reference=np.min,
                   backward=Backward(_extreme, True, True, "g shared by the minima (split on ties)")))
prod = reduction(Op("prod", _rules("prod", None), plan_reduce, reduce_prod, reference=np.prod,
                    backward=Backward(lambda g, xs, out, p, xp: (_expand(g, p) * _others_product(xs[0], p["dim"], xp),),
                                      True, False, "g times the product of the other elements (zeros included)")))
all = reduction(Op("all", _rules("all", "min", doc=(
    'Shard(r) on a reduced dim: each rank reduces its piece and the result is Partial("min") '
    "(booleans: min is and; an empty piece gives True, the identity)")),
    plan_reduce, reduce_all, reference=np.all, domain=("bool",)))
any = reduction(Op("any", _rules("any", "max", doc=(
    'Shard(r) on a reduced dim: each rank reduces its piece and the result is Partial("max") '
    "(booleans: max is or; an empty piece gives False, the identity)")),
    plan_reduce, reduce_any, reference=np.any, domain=("bool",)))
STD = Op("std", _rules("std", None, doc=SPREAD_DOC), plan_reduce, reduce_std, reference=np.std, backward=_spread(True))
VAR = Op("var", _rules("var", None, doc=SPREAD_DOC), plan_reduce, reduce_var, reference=np.var, backward=_spread(False))


def _spread_call(op: Op, x: DTensor, dim: Any, keepdim: Any, ddof: Any, axis: Any, keepdims: Any,
                 correction: Any) -> DTensor:
    return apply_reduce(op, x, spelling(op.name, "dim", dim, "axis", axis, None),
                        spelling(op.name, "keepdim", keepdim, "keepdims", keepdims, False),
                        ddof=int(spelling(op.name, "correction", correction, "ddof", ddof, 0)))


@STD.define("std")
def std(x: DTensor, dim: int | Sequence[int] | None = None, keepdim: bool | None = None, *, ddof: int | None = None,
        axis: int | Sequence[int] | None = None, keepdims: bool | None = None, correction: int | None = None) -> DTensor:
    """Standard deviation over unsharded ``dim`` (NumPy's ``ddof=0`` default; torch's
    ``correction=`` is the same parameter). Over a sharded dim: see ``signature("std")``."""
    return _spread_call(STD, x, dim, keepdim, ddof, axis, keepdims, correction)


@VAR.define("var")
def var(x: DTensor, dim: int | Sequence[int] | None = None, keepdim: bool | None = None, *, ddof: int | None = None,
        axis: int | Sequence[int] | None = None, keepdims: bool | None = None, correction: int | None = None) -> DTensor:
    """Variance over unsharded ``dim`` (NumPy's ``ddof=0`` default; torch's ``correction=`` is
    the same parameter). Over a sharded dim: see ``signature("var")``."""
    return _spread_call(VAR, x, dim, keepdim, ddof, axis, keepdims, correction)


argmax = arg_reduction(Op("argmax", _rules("argmax", None, doc=ARG_DOC), plan_reduce, arg_reduce("argmax"),
                          reference=np.argmax))
argmin = arg_reduction(Op("argmin", _rules("argmin", None, doc=ARG_DOC), plan_reduce, arg_reduce("argmin"),
                          reference=np.argmin))

__all__ = ["all", "any", "argmax", "argmin", "max", "mean", "min", "prod", "std", "sum", "var"]
