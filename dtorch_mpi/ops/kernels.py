"""Local kernels: what each operator computes on this rank's piece.

Signature ``kernel(xp, *local_inputs, **params)``; ``xp`` is the mesh's array library (NumPy
or CuPy). Ops that are one of the library's own functions name it (``Op.ufunc``) instead.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..dtypes import identity_value

SQRT_HALF = 0.7071067811865476
_erf_object = np.frompyfunc(math.erf, 1, 1)


def erf(xp: Any, x: Any) -> Any:
    """The error function to double precision: libm's ``erf`` per element for NumPy (exact,
    about 0.1 us per element), ``cupyx.scipy.special.erf`` for CuPy."""
    if xp is np:
        return _erf_object(x).astype(x.dtype) if x.size else x.copy()
    from cupyx.scipy.special import erf as cupy_erf

    return cupy_erf(x)


def _floating(x: Any) -> Any:
    return x if x.dtype.kind in "fc" else x.astype(np.float64)


def gelu(xp: Any, x: Any, approximate: str = "none") -> Any:
    """PyTorch's GELU: ``x * Phi(x)`` (``"none"``, the erf form) or its tanh approximation."""
    x = _floating(x)
    if approximate == "none":
        return 0.5 * x * (1 + erf(xp, x * SQRT_HALF))
    return 0.5 * x * (1 + xp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def sigmoid(xp: Any, x: Any) -> Any:
    return xp.divide(1, 1 + xp.exp(-x))


def relu(xp: Any, x: Any) -> Any:
    return xp.maximum(x, 0)


def silu(xp: Any, x: Any) -> Any:
    return x * sigmoid(xp, x)


def softplus(xp: Any, x: Any) -> Any:
    return xp.logaddexp(0, x)


def clip(xp: Any, x: Any, lo: Any = None, hi: Any = None) -> Any:
    return xp.clip(x, lo, hi)


def where(xp: Any, cond: Any, a: Any, b: Any) -> Any:
    return xp.where(cond, a, b)


def clone(xp: Any, x: Any) -> Any:
    return x.copy()


def astype(xp: Any, x: Any, dtype: Any) -> Any:
    return x.astype(dtype)


def matmul(xp: Any, a: Any, b: Any) -> Any:
    return xp.matmul(a, b)


# --- reductions: (xp, piece, axes, keepdim, count, partial) --------------------------------
# ``count``: elements reduced globally per output element; ``partial``: a reduced dim is
# sharded (the piece's result is one term of a Partial).
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


def _extreme(name: str) -> Any:
    def kernel(xp: Any, x: Any, axes: tuple[int, ...], keepdim: bool, count: int, partial: bool) -> Any:
        if count == 0:
            raise ValueError(f"{name} of an empty dim: zero-size reduction has no identity")
        fn = getattr(xp, name)
        if partial:  # an empty piece contributes the identity term
            return xp.asarray(fn(x, axis=axes, keepdims=keepdim, initial=identity_value(x.dtype, name)))
        return xp.asarray(fn(x, axis=axes, keepdims=keepdim))

    kernel.__name__ = f"reduce_{name}"
    return kernel


reduce_max = _extreme("max")
reduce_min = _extreme("min")


def arg_reduce(name: str) -> Any:
    def kernel(xp: Any, x: Any, dim: int | None, keepdim: bool) -> Any:
        fn = getattr(xp, name)
        return xp.asarray(fn(x, axis=dim, keepdims=keepdim) if dim is not None else fn(x))

    kernel.__name__ = name
    return kernel


# --- along one dim -------------------------------------------------------------------------
def softmax(xp: Any, x: Any, dim: int, log: bool = False) -> Any:
    """Shifted by the max along ``dim`` (integers promoted to float64)."""
    if x.dtype.kind in "biu":
        x = x.astype(np.float64)
    if not x.size:
        return x.copy()
    shifted = x - xp.max(x, axis=dim, keepdims=True)
    e = xp.exp(shifted)
    s = xp.sum(e, axis=dim, keepdims=True)
    return shifted - xp.log(s) if log else e / s


def log_softmax(xp: Any, x: Any, dim: int) -> Any:
    return softmax(xp, x, dim, log=True)


# --- layout --------------------------------------------------------------------------------
def permute(xp: Any, x: Any, perm: tuple[int, ...]) -> Any:
    return xp.transpose(x, perm)


def reshape(xp: Any, x: Any, local_shape: tuple[int, ...]) -> Any:
    return x.reshape(local_shape)


def getitem(xp: Any, x: Any, key: tuple[Any, ...]) -> Any:
    return x[key]


def cat(xp: Any, *xs: Any, dim: int) -> Any:
    return xp.concatenate(xs, axis=dim)


def stack(xp: Any, *xs: Any, dim: int) -> Any:
    return xp.stack(xs, axis=dim)
