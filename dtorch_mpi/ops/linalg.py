"""Linear algebra: ``matmul`` (``@``), its rule table, kernel and backward."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..dtensor import DTensor
from .apply import apply_matmul
from .backward import Backward
from .planners import plan_matmul
from .registry import Op
from .signature import P, R, Rule, S, Signature
from .tables import pr, rp

RULES = Signature("matmul", (
    Rule((S(-2), R), S(-2), note="rows of a: (Shard(0), Replicate()) -> Shard(0) for 2-D"),
    Rule((R, S(-1)), S(-1), note="columns of b: (Replicate(), Shard(1)) -> Shard(1) for 2-D"),
    Rule((S(-1), S(-2)), P("sum"), note='contraction dim: (Shard(1), Shard(0)) -> Partial("sum") for 2-D'),
    Rule((R, R), R),
    Rule((S("d"), S("d")), S("d"), note="batch dims"),
    Rule((S("d"), R), S("d"), slices=(1,), note="batch dims"),
    Rule((R, S("d")), S("d"), slices=(0,), note="batch dims"),
    pr("sum"), rp("sum"), pr("avg"), rp("avg"),
), "NumPy matmul semantics (1-D operands promoted, batch dims broadcast)")


def _matmul_grad(g: Any, xs: tuple[Any, ...], out: Any, p: dict[str, Any], xp: Any) -> tuple[Any, Any]:
    a, b = xs
    need_a, need_b = p["needs"]
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    g2 = g
    if b.ndim == 1:
        g2 = g2[..., None]
    if a.ndim == 1:
        g2 = g2[..., None, :]
    ga = gb = None
    if need_a:
        if _shared(a2, b2, g2):  # a weight used by a batch: fold the batch into one product
            ga = xp.tensordot(_batch_folded(g2), _batch_folded(b2), axes=([0, 2], [0, 2]))
        else:
            ga = xp.matmul(g2, xp.swapaxes(b2, -1, -2))
        ga = ga[..., 0, :] if a.ndim == 1 else ga
    if need_b:
        if _shared(b2, a2, g2) or b2.ndim == a2.ndim == g2.ndim == 2:
            gb = _transposed_product(_rows_folded(a2), _rows_folded(g2), b2, xp)
        else:
            gb = xp.matmul(xp.swapaxes(a2, -1, -2), g2)
        gb = gb[..., :, 0] if b.ndim == 1 else gb
    return ga, gb


def _transposed_product(x: Any, y: Any, like: Any, xp: Any) -> Any:
    """``x^T @ y`` laid out like ``like``: for a weight used transposed (``x @ W.T``, ``like``
    a Fortran-ordered view) compute ``(y^T @ x)^T``, so the gradient reaching ``W`` through
    the transpose is C-ordered without a strided copy (optimizers then run on contiguous
    memory)."""
    if like.flags.f_contiguous and not like.flags.c_contiguous:
        return xp.matmul(y.T, x).T
    return xp.matmul(x.T, y)


def _batch_folded(x: Any) -> Any:
    """``[..., m, n]`` as ``[batch, m, n]`` (explicit sizes: empty pieces reshape too)."""
    return x.reshape(math.prod(x.shape[:-2]), *x.shape[-2:])


def _rows_folded(x: Any) -> Any:
    """``[..., m, n]`` as ``[batch * m, n]``."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _shared(target: Any, other: Any, g: Any) -> bool:
    """The 2-D operand ``target`` was broadcast along all of ``other``'s batch dims: its
    gradient sums over the batch, which one product over the folded batch does without a
    [batch, *target] temporary."""
    return target.ndim == 2 and g.ndim > 2 and other.shape[:-2] == g.shape[:-2]


MATMUL = Op("matmul", RULES, plan_matmul, lambda xp, a, b: xp.matmul(a, b), reference=np.matmul,
            backward=Backward(_matmul_grad, True, False, "(g @ b^T, a^T @ g), batch dims summed where broadcast"))


@MATMUL.define("matmul", "__matmul__")
def matmul(a: DTensor, b: DTensor) -> DTensor:
    """``a @ b`` (NumPy semantics). See ``signature("matmul")``."""
    return apply_matmul(MATMUL, a, b)


MATMUL.bind("__rmatmul__", lambda a, b: matmul(b, a))

__all__ = ["matmul"]
