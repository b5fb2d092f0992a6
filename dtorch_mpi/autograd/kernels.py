"""Local gradient kernels: each operator's vector-Jacobian product on local pieces.

A kernel gets the output's gradient piece ``g``, the op's saved local inputs ``xs`` (already
cut to the output's layout), its local output ``out``, its parameters and the array module,
and returns one gradient piece per input (None where the input is not differentiable). It
may return a gradient in the broadcast shape; the caller sums it back to the input's shape.
Kernels never communicate: placements are the business of ``rules.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .rules import pattern_text

Kernel = Callable[[Any, tuple[Any, ...], Any, dict[str, Any], Any], tuple[Any, ...]]


@dataclass(frozen=True)
class Backward:
    """An operator's backward: its kernel and what the forward must save for it."""

    kernel: Kernel
    saves_inputs: bool = True
    saves_output: bool = False
    formula: str = ""
    """The gradient in words, shown by ``signature()``."""

    def describe(self, rules: Sequence[Any]) -> list[str]:
        """Lines for ``signature()``: the local gradient and, per forward rule, the placement of
        each input's gradient (derived by autograd/rules.py)."""
        lines = [f"gradient: {self.formula}"] if self.formula else []
        for rule in rules:
            grads = ", ".join(pattern_text(p.kind, p.arg, rule.output.kind, rule.output.arg, i in rule.slices)
                              for i, p in enumerate(rule.inputs))
            head = f"({', '.join(map(repr, rule.inputs))}) -> {rule.output!r}"
            lines.append(f"{head}   grads: ({grads})")
        return lines


def _unary(formula: str, fn: Callable[[Any, Any, Any, Any], Any], *, inputs: bool = True,
           output: bool = False) -> Backward:
    return Backward(lambda g, xs, out, p, xp: (fn(g, xs[0] if xs else None, out, xp),),
                    inputs, output, formula)


def _sigmoid(xp: Any, x: Any) -> Any:
    return 1 / (1 + xp.exp(-x))


def _gelu_grad(g: Any, x: Any, p: dict[str, Any], xp: Any) -> Any:
    if p.get("approximate", "none") == "tanh":
        c = 0.7978845608028654
        inner = c * (x + 0.044715 * x * x * x)  # x ** 3 takes NumPy's slow pow path
        t = xp.tanh(inner)
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x))
    from ..ops.kernels import erf  # the forward's erf (libm per element; cupyx on GPU)

    cdf = 0.5 * (1 + erf(xp, x / math.sqrt(2)))
    pdf = xp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return g * (cdf + x * pdf)


def _silu_grad(g: Any, x: Any, xp: Any) -> Any:
    s = _sigmoid(xp, x)
    return g * s * (1 + x * (1 - s))


def _zero(g: Any, x: Any, out: Any, xp: Any) -> Any:
    return xp.zeros_like(g)


UNARY: dict[str, Backward] = {
    "neg": _unary("-g", lambda g, x, y, xp: -g, inputs=False),
    "exp": _unary("g * y", lambda g, x, y, xp: g * y, inputs=False, output=True),
    "expm1": _unary("g * (y + 1)", lambda g, x, y, xp: g * (y + 1), inputs=False, output=True),
    "log": _unary("g / x", lambda g, x, y, xp: g / x),
    "log1p": _unary("g / (1 + x)", lambda g, x, y, xp: g / (1 + x)),
    "log2": _unary("g / (x ln 2)", lambda g, x, y, xp: g / (x * math.log(2))),
    "log10": _unary("g / (x ln 10)", lambda g, x, y, xp: g / (x * math.log(10))),
    "sqrt": _unary("g / (2 y)", lambda g, x, y, xp: g / (2 * y), inputs=False, output=True),
    "tanh": _unary("g (1 - y^2)", lambda g, x, y, xp: g * (1 - y * y), inputs=False, output=True),
    "sigmoid": _unary("g y (1 - y)", lambda g, x, y, xp: g * y * (1 - y), inputs=False, output=True),
    "relu": _unary("g where x > 0", lambda g, x, y, xp: g * (x > 0)),
    "silu": _unary("g s (1 + x (1 - s)), s = sigmoid(x)", lambda g, x, y, xp: _silu_grad(g, x, xp)),
    "softplus": _unary("g sigmoid(x)", lambda g, x, y, xp: g * _sigmoid(xp, x)),
    "abs": _unary("g sign(x)", lambda g, x, y, xp: g * xp.sign(x)),
    "sin": _unary("g cos(x)", lambda g, x, y, xp: g * xp.cos(x)),
    "cos": _unary("-g sin(x)", lambda g, x, y, xp: -g * xp.sin(x)),
    "tan": _unary("g (1 + y^2)", lambda g, x, y, xp: g * (1 + y * y), inputs=False, output=True),
    "square": _unary("2 g x", lambda g, x, y, xp: 2 * g * x),
    "reciprocal": _unary("-g y^2", lambda g, x, y, xp: -g * y * y, inputs=False, output=True),
    "arctan": _unary("g / (1 + x^2)", lambda g, x, y, xp: g / (1 + x * x)),
    "arcsinh": _unary("g / sqrt(x^2 + 1)", lambda g, x, y, xp: g / xp.sqrt(x * x + 1)),
    "cbrt": _unary("g / (3 y^2)", lambda g, x, y, xp: g / (3 * y * y), inputs=False, output=True),
    "arcsin": _unary("g / sqrt(1 - x^2)", lambda g, x, y, xp: g / xp.sqrt(1 - x * x)),
    "arccos": _unary("-g / sqrt(1 - x^2)", lambda g, x, y, xp: -g / xp.sqrt(1 - x * x)),
    "sinh": _unary("g cosh(x)", lambda g, x, y, xp: g * xp.cosh(x)),
    "cosh": _unary("g sinh(x)", lambda g, x, y, xp: g * xp.sinh(x)),
    "floor": _unary("0", _zero, inputs=False), "ceil": _unary("0", _zero, inputs=False),
    "trunc": _unary("0", _zero, inputs=False), "rint": _unary("0", _zero, inputs=False),
    "sign": _unary("0", _zero, inputs=False),
    "gelu": Backward(lambda g, xs, out, p, xp: (_gelu_grad(g, xs[0], p, xp),), True, False,
                     "g (Phi(x) + x phi(x)) (tanh form when approximate='tanh')"),
    "clip": Backward(lambda g, xs, out, p, xp: (g * _inside(xs[0], p, xp),), True, False,
                     "g where lo <= x <= hi"),
    "clone": _unary("g", lambda g, x, y, xp: g, inputs=False),
}


def _inside(x: Any, p: dict[str, Any], xp: Any) -> Any:
    lo, hi = p.get("lo"), p.get("hi")
    mask = xp.ones(x.shape, dtype=bool)
    if lo is not None:
        mask &= x >= lo
    if hi is not None:
        mask &= x <= hi
    return mask


def _binary(formula: str, fn: Callable[[Any, Any, Any, Any, Any], tuple[Any, Any]], *,
            inputs: bool = True, output: bool = False) -> Backward:
    return Backward(lambda g, xs, out, p, xp: fn(g, xs[0] if xs else None, xs[1] if xs else None,
                                                  out, xp), inputs, output, formula)


def _ties(g: Any, a: Any, b: Any, xp: Any, greater: bool) -> tuple[Any, Any]:
    win = (a > b) if greater else (a < b)
    tie = a == b
    return g * (win + 0.5 * tie), g * (~win & ~tie) + g * 0.5 * tie


BINARY: dict[str, Backward] = {
    "add": _binary("(g, g)", lambda g, a, b, y, xp: (g, g), inputs=False),
    "sub": _binary("(g, -g)", lambda g, a, b, y, xp: (g, -g), inputs=False),
    "mul": _binary("(g b, g a)", lambda g, a, b, y, xp: (g * b, g * a)),
    "truediv": _binary("(g / b, -g a / b^2)", lambda g, a, b, y, xp: (g / b, -g * a / (b * b))),
    "pow": Backward(lambda g, xs, y, p, xp: (
        g * xs[1] * xs[0] ** (xs[1] - 1),
        g * y * xp.log(xp.where(xs[0] > 0, xs[0], 1)) if p["needs"][1] else None), True, True,
        "(g b a^(b-1), g y ln a)"),
    "maximum": _binary("g to the larger (split on ties)", lambda g, a, b, y, xp: _ties(g, a, b, xp, True)),
    "minimum": _binary("g to the smaller (split on ties)", lambda g, a, b, y, xp: _ties(g, a, b, xp, False)),
    "mod": _binary("(g, -g floor(a / b))", lambda g, a, b, y, xp: (g, -g * xp.floor_divide(a, b))),
    "floordiv": _binary("0", lambda g, a, b, y, xp: (xp.zeros_like(g), xp.zeros_like(g)), inputs=False),
    "arctan2": _binary("(g b, -g a) / (a^2 + b^2)", lambda g, a, b, y, xp: (
        g * b / (a * a + b * b), -g * a / (a * a + b * b))),
    "hypot": _binary("(g a / y, g b / y)", lambda g, a, b, y, xp: (g * a / y, g * b / y), output=True),
}

WHERE = Backward(lambda g, xs, out, p, xp: (None, g * xs[0], g * ~xs[0]), True, False,
                 "(none, g where cond, g where not cond)")
ASTYPE = Backward(lambda g, xs, out, p, xp: (g,), False, False, "g cast back to the input dtype")


def _matmul(g: Any, xs: tuple[Any, ...], out: Any, p: dict[str, Any], xp: Any) -> tuple[Any, Any]:
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


MATMUL = Backward(_matmul, True, False, "(g @ b^T, a^T @ g), batch dims summed where broadcast")


def _expand(g: Any, p: dict[str, Any]) -> Any:
    """``g`` of a reduction with its reduced dims put back (size 1) when keepdim was False."""
    if p["keepdim"]:
        return g
    for axis in p["dim"]:
        g = g.reshape(g.shape[:axis] + (1,) + g.shape[axis:])
    return g


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


REDUCTIONS: dict[str, Backward] = {
    "sum": Backward(lambda g, xs, out, p, xp: (xp.broadcast_to(_expand(g, p), p["in_shapes"][0]),),
                    False, False, "g broadcast over the reduced dims"),
    "mean": Backward(lambda g, xs, out, p, xp: (
        xp.broadcast_to(_expand(g, p) / _count(p), p["in_shapes"][0]),), False, False,
        "g / n broadcast over the reduced dims (n: the global count)"),
    "max": Backward(_extreme, True, True, "g shared by the maxima (split on ties)"),
    "min": Backward(_extreme, True, True, "g shared by the minima (split on ties)"),
    "prod": Backward(lambda g, xs, out, p, xp: (_expand(g, p) * _others_product(xs[0], p["dim"], xp),),
                     True, False, "g times the product of the other elements (zeros included)"),
    "std": _spread(True),
    "var": _spread(False),
}

SOFTMAX = Backward(lambda g, xs, out, p, xp: (
    out * (g - xp.sum(g * out, axis=p["dim"], keepdims=True)),), False, True,
    "y (g - sum(g y))")
LOG_SOFTMAX = Backward(lambda g, xs, out, p, xp: (
    g - xp.exp(out) * xp.sum(g, axis=p["dim"], keepdims=True),), False, True,
    "g - exp(y) sum(g)")
CUMSUM = Backward(lambda g, xs, out, p, xp: (
    xp.flip(xp.cumsum(xp.flip(g, axis=p["dim"]), axis=p["dim"]), axis=p["dim"]),), False, False,
    "reversed cumulative sum of g")
PERMUTE = Backward(lambda g, xs, out, p, xp: (xp.transpose(g, np.argsort(p["perm"])),), False, False,
                   "g permuted back")
RESHAPE = Backward(lambda g, xs, out, p, xp: (g.reshape(p["in_shapes"][0]),), False, False,
                   "g reshaped back")


def _getitem(g: Any, xs: tuple[Any, ...], out: Any, p: dict[str, Any], xp: Any) -> tuple[Any]:
    grad = xp.zeros(p["in_shapes"][0], dtype=g.dtype)
    grad[p["key"]] = g
    return (grad,)


GETITEM = Backward(_getitem, False, False, "g placed at the indexed positions, zeros elsewhere")


def _cat(g: Any, xs: tuple[Any, ...], out: Any, p: dict[str, Any], xp: Any) -> tuple[Any, ...]:
    bounds = np.cumsum([shape[p["dim"]] for shape in p["in_shapes"]])[:-1]
    return tuple(xp.split(g, bounds, axis=p["dim"]))


def _stack(g: Any, xs: tuple[Any, ...], out: Any, p: dict[str, Any], xp: Any) -> tuple[Any, ...]:
    return tuple(xp.take(g, i, axis=p["dim"]) for i in range(len(p["in_shapes"])))


def _count(p: dict[str, Any]) -> int:
    """The global number of elements a reduction combined (its input spec's reduced dims)."""
    shape = p["in_specs"][0].shape
    return math.prod(shape[d] for d in p["dim"])


CAT = Backward(_cat, False, False, "g split along the joined dim")
STACK = Backward(_stack, False, False, "g taken along the new dim")


OTHER: dict[str, Backward] = {
    "where": WHERE, "astype": ASTYPE, "matmul": MATMUL, "softmax": SOFTMAX,
    "log_softmax": LOG_SOFTMAX, "cumsum": CUMSUM, "transpose": PERMUTE, "reshape": RESHAPE,
    "getitem": GETITEM, "cat": CAT, "stack": STACK,
}
BACKWARDS: dict[str, Backward] = {**UNARY, **BINARY, **REDUCTIONS, **OTHER}
"""Every differentiable operator's backward by operator name (ops/catalog.py attaches them to
the declarations; comparisons, logical/bitwise ops and argmax/argmin have none)."""
