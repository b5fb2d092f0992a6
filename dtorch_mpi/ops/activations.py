"""Elementwise operators with kernels of their own: sigmoid, relu, silu, softplus, erf, gelu
and clip/clamp. Each declaration holds the op's rule table, kernel, NumPy
reference and backward. nn/layers.py calls these kernels on plain arrays too.

Kernels take ``(xp, x, **params)``; ``xp`` is the mesh's array library (NumPy or CuPy).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..dtensor import DTensor
from .apply import apply_elementwise, spelling, unary
from .backward import Backward, grad_x, grad_y
from .planners import plan_elementwise
from .registry import Op
from .tables import MONOTONE, PLAIN, Algebra, unary_signature

SQRT_HALF = 0.7071067811865476
_erf_object: Any = np.frompyfunc(math.erf, 1, 1)
_numpy_erf: Any = None  # chosen on first use (importing scipy.special costs ~0.1 s per process)


def _choose_numpy_erf() -> Any:
    """SciPy's ``erf`` ufunc where SciPy is installed (Cephes, within 3 ulp of libm's; ~5x
    faster than a Python call per element), else libm's ``erf`` per element (exact)."""
    try:
        from scipy import special
    except ImportError:
        return lambda x: _erf_object(x).astype(x.dtype)
    ufunc: Any = special.erf
    return lambda x: ufunc(x).astype(x.dtype, copy=False)  # float16 comes back float64


def _local(name: str, algebra: Algebra, kernel: Any, reference: Any, backward: Backward, **kw: Any) -> Op:
    return Op(name, unary_signature(name, algebra), plan_elementwise, kernel, reference=reference,
              backward=backward, **kw)


# --- kernels -------------------------------------------------------------------------------
def erf_kernel(xp: Any, x: Any) -> Any:
    """The error function to double precision: for NumPy SciPy's ufunc where installed (the
    ``fast`` extra; ~15 ns per element), else libm's per element (about 0.1 us per element);
    ``cupyx.scipy.special.erf`` for CuPy. GELU's forward and backward both call it, so its
    speed is most of a GELU network's forward (and of activation checkpointing's recompute)."""
    global _numpy_erf
    if xp is np:
        if not x.size:
            return x.copy()
        if _numpy_erf is None:
            _numpy_erf = _choose_numpy_erf()
        return _numpy_erf(x)
    from cupyx.scipy.special import erf as cupy_erf

    return cupy_erf(x)


def _floating(x: Any) -> Any:
    return x if x.dtype.kind in "fc" else x.astype(np.float64)


def gelu_kernel(xp: Any, x: Any, approximate: str = "none") -> Any:
    """PyTorch's GELU: ``x * Phi(x)`` (``"none"``, the erf form) or its tanh approximation."""
    x = _floating(x)
    if approximate == "none":
        return 0.5 * x * (1 + erf_kernel(xp, x * SQRT_HALF))
    return 0.5 * x * (1 + xp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def sigmoid_kernel(xp: Any, x: Any) -> Any:
    return xp.divide(1, 1 + xp.exp(-x))


def relu_kernel(xp: Any, x: Any) -> Any:
    return xp.maximum(x, 0)


def silu_kernel(xp: Any, x: Any) -> Any:
    return x * sigmoid_kernel(xp, x)


def softplus_kernel(xp: Any, x: Any) -> Any:
    return xp.logaddexp(0, x)


# --- backwards -----------------------------------------------------------------------------
def _sigmoid(xp: Any, x: Any) -> Any:
    return 1 / (1 + xp.exp(-x))


def _silu_grad(g: Any, x: Any, xp: Any) -> Any:
    s = _sigmoid(xp, x)
    return g * s * (1 + x * (1 - s))


def _gelu_grad(g: Any, x: Any, p: dict[str, Any], xp: Any) -> Any:
    if p.get("approximate", "none") == "tanh":
        c = 0.7978845608028654
        inner = c * (x + 0.044715 * x * x * x)  # x ** 3 takes NumPy's slow pow path
        t = xp.tanh(inner)
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x))
    cdf = 0.5 * (1 + erf_kernel(xp, x / math.sqrt(2)))  # the forward's erf
    pdf = xp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return g * (cdf + x * pdf)


def _inside(x: Any, p: dict[str, Any], xp: Any) -> Any:
    lo, hi = p.get("lo"), p.get("hi")
    mask = xp.ones(x.shape, dtype=bool)
    if lo is not None:
        mask &= x >= lo
    if hi is not None:
        mask &= x <= hi
    return mask


# --- declarations --------------------------------------------------------------------------
sigmoid = unary(_local("sigmoid", MONOTONE, sigmoid_kernel, lambda x: 1 / (1 + np.exp(-x)),
                       grad_y("g y (1 - y)", lambda g, y, xp: g * y * (1 - y))))
relu = unary(_local("relu", MONOTONE, relu_kernel, lambda x: np.maximum(x, 0),
                    grad_x("g where x > 0", lambda g, x, xp: g * (x > 0))))
silu = unary(_local("silu", PLAIN, silu_kernel, lambda x: x / (1 + np.exp(-x)),
                    grad_x("g s (1 + x (1 - s)), s = sigmoid(x)", _silu_grad)))
softplus = unary(_local("softplus", PLAIN, softplus_kernel, lambda x: np.log1p(np.exp(x)),
                        grad_x("g sigmoid(x)", lambda g, x, xp: g * _sigmoid(xp, x))))

erf = unary(_local("erf", MONOTONE, lambda xp, x: erf_kernel(xp, _floating(x)), np.vectorize(math.erf, otypes=[float]),
                   grad_x("2 g exp(-x^2) / sqrt(pi)", lambda g, x, xp: g * (2 / math.sqrt(math.pi)) * xp.exp(-x * x))))


def _gelu_reference(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return x * np.vectorize(lambda v: 0.5 * math.erfc(-v / math.sqrt(2)), otypes=[x.dtype])(x)


GELU = _local("gelu", PLAIN, gelu_kernel, _gelu_reference,
              Backward(lambda g, xs, out, p, xp: (_gelu_grad(g, xs[0], p, xp),), True, False,
                       "g (Phi(x) + x phi(x)) (tanh form when approximate='tanh')"),
              params=("approximate",), examples=({}, {"approximate": "tanh"}))


@GELU.define("gelu")
def gelu(x: DTensor, approximate: str = "none") -> DTensor:
    """PyTorch's GELU: ``approximate="none"`` (default) is ``x * Phi(x)`` with the exact erf;
    ``"tanh"`` is the tanh approximation. Rules: ``signature("gelu")``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return apply_elementwise(GELU, (x,), {"approximate": approximate})


CLIP = _local("clip", PLAIN, lambda xp, x, lo=None, hi=None: xp.clip(x, lo, hi),
              lambda x, lo=None, hi=None: np.clip(x, lo, hi),
              Backward(lambda g, xs, out, p, xp: (g * _inside(xs[0], p, xp),), True, False, "g where lo <= x <= hi"),
              params=("lo", "hi"), examples=({"lo": 2, "hi": 5}, {"lo": 3}, {"hi": 4}))


@CLIP.define("clip")
def clip(x: DTensor, lo: Any = None, hi: Any = None, *, min: Any = None, max: Any = None) -> DTensor:
    """Clip to scalar bounds (monotone: keeps Partial max/min). NumPy's positional ``(lo, hi)``
    or torch's ``min=``/``max=``; ``clamp`` is the same op."""
    bounds = {"lo": spelling("clip", "lo", lo, "min", min, None), "hi": spelling("clip", "hi", hi, "max", max, None)}
    return apply_elementwise(CLIP, (x,), bounds)


@CLIP.define("clamp")
def clamp(x: DTensor, min: Any = None, max: Any = None) -> DTensor:
    """torch's name for ``clip``: ``x.clamp(min=0, max=1)``."""
    return apply_elementwise(CLIP, (x,), {"lo": min, "hi": max})


__all__ = ["clamp", "clip", "erf", "gelu", "relu", "sigmoid", "silu", "softplus"]
