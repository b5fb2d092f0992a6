"""Operators along one unsharded dim that keep the shape: softmax, log_softmax, cumsum. Each
declaration holds the op's rule table, kernel and backward."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtensor import DTensor
from .apply import apply_along_dim
from .backward import Backward
from .planners import plan_along_dim
from .registry import Op
from .signature import P, R, Rule, S, Signature

SOFTMAX_DOC = "the softmax dim must not be sharded; not defined on Partial"


def softmax_kernel(xp: Any, x: Any, dim: int, log: bool = False) -> Any:
    """Shifted by the max along ``dim`` (integers promoted to float64)."""
    if x.dtype.kind in "biu":
        x = x.astype(np.float64)
    if not x.size:
        return x.copy()
    shifted = x - xp.max(x, axis=dim, keepdims=True)
    e = xp.exp(shifted)
    s = xp.sum(e, axis=dim, keepdims=True)
    return shifted - xp.log(s) if log else e / s


def _softmax_reference(x: np.ndarray, dim: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=dim, keepdims=True, initial=-np.inf))
    return e / e.sum(axis=dim, keepdims=True)


SOFTMAX = Op("softmax", Signature("softmax", (Rule((S("d"),), S("d")), Rule((R,), R)), SOFTMAX_DOC),
             plan_along_dim, softmax_kernel, reference=_softmax_reference,
             backward=Backward(lambda g, xs, out, p, xp: (out * (g - xp.sum(g * out, axis=p["dim"], keepdims=True)),),
                               False, True, "y (g - sum(g y))"))
LOG_SOFTMAX = Op("log_softmax", Signature("log_softmax", (Rule((S("d"),), S("d")), Rule((R,), R)), SOFTMAX_DOC),
                 plan_along_dim, lambda xp, x, dim: softmax_kernel(xp, x, dim, log=True),
                 reference=lambda x, dim: np.log(_softmax_reference(x, dim)),
                 backward=Backward(lambda g, xs, out, p, xp: (
                     g - xp.exp(out) * xp.sum(g, axis=p["dim"], keepdims=True),), False, True, "g - exp(y) sum(g)"))


@SOFTMAX.define("softmax")
def softmax(x: DTensor, dim: int = -1, *, log: bool = False) -> DTensor:
    """Softmax (or log-softmax) along an unsharded ``dim``."""
    return apply_along_dim(LOG_SOFTMAX if log else SOFTMAX, x, dim)


@LOG_SOFTMAX.define("log_softmax")
def log_softmax(x: DTensor, dim: int = -1) -> DTensor:
    """Log-softmax along an unsharded ``dim``."""
    return apply_along_dim(LOG_SOFTMAX, x, dim)


CUMSUM = Op("cumsum", Signature("cumsum", (
    Rule((S("d"),), S("d")), Rule((R,), R), Rule((P("sum"),), P("sum")), Rule((P("avg"),), P("avg"))),
    "the cumsum dim must not be sharded; linear: Partial(sum|avg) stays"),
    plan_along_dim, lambda xp, x, dim: xp.cumsum(x, axis=dim), reference=lambda x, dim: np.cumsum(x, axis=dim),
    backward=Backward(lambda g, xs, out, p, xp: (
        xp.flip(xp.cumsum(xp.flip(g, axis=p["dim"]), axis=p["dim"]), axis=p["dim"]),), False, False,
        "reversed cumulative sum of g"))


@CUMSUM.define("cumsum")
def cumsum(x: DTensor, dim: int) -> DTensor:
    """Cumulative sum along an unsharded ``dim``. Rules: ``signature("cumsum")``."""
    return apply_along_dim(CUMSUM, x, dim)


__all__ = ["cumsum", "log_softmax", "softmax"]
