"""Elementwise operators that are the array library's own functions (NumPy's is the reference):
unary math, broadcasting binary ops, ``where``, ``clone`` and ``astype``. Each declaration
holds the op's rule table, kernel and backward; ops with kernels of their own (sigmoid, gelu,
clip, ...) are in activations.py.

To add one: ``name = unary(_unary("name", ALGEBRA, grad_x(...)))`` (or ``binary``), its name
in ``__all__``, then ``make docs``; tests/test_ops.py generates its forward tests from the
declaration.
"""

from __future__ import annotations

import builtins
import math
from typing import Any

import numpy as np

from ..dtensor import DTensor
from ..errors import PlacementError
from ..placement import Partial
from .apply import NO_PARAMS, apply_elementwise, binary, tensor_spec, unary
from .backward import ZERO, Backward, binary_grad, grad_g, grad_x, grad_y
from .planners import plan_elementwise
from .registry import Op
from .signature import P, R, Rule, Signature
from .tables import (
    ALL_PARTIALS,
    MONOTONE,
    NEGATING,
    PLAIN,
    Algebra,
    binary_signature,
    follows_data,
    pp,
    pr,
    rp,
    shard_rules,
    unary_signature,
)


def _unary(name: str, algebra: Algebra, backward: Backward | None = None, ufunc: str | None = None,
           **kw: Any) -> Op:
    """A unary op that is the array library's function ``ufunc`` (default: ``name``)."""
    fn = ufunc or name
    return Op(name, unary_signature(name, algebra), plan_elementwise, ufunc=fn, params=None,
              reference=getattr(np, fn), backward=backward, **kw)


def _binary(name: str, partial_rules: tuple[Rule, ...] = (), backward: Backward | None = None,
            ufunc: str | None = None, **kw: Any) -> Op:
    """A broadcasting binary op that is the array library's function ``ufunc``."""
    fn = ufunc or name
    return Op(name, binary_signature(name, partial_rules), plan_elementwise, ufunc=fn, params=None,
              reference=getattr(np, fn), backward=backward, **kw)


LN2, LN10 = math.log(2), math.log(10)

# --- unary ---------------------------------------------------------------------------------
neg = unary(_unary("neg", NEGATING, grad_g("-g", lambda g, xp: -g), "negative"), "__neg__", alias=("negative",))
negative = neg
exp = unary(_unary("exp", MONOTONE, grad_y("g * y", lambda g, y, xp: g * y)))
expm1 = unary(_unary("expm1", MONOTONE, grad_y("g * (y + 1)", lambda g, y, xp: g * (y + 1))))
log = unary(_unary("log", PLAIN, grad_x("g / x", lambda g, x, xp: g / x)))
log1p = unary(_unary("log1p", PLAIN, grad_x("g / (1 + x)", lambda g, x, xp: g / (1 + x))))
log2 = unary(_unary("log2", PLAIN, grad_x("g / (x ln 2)", lambda g, x, xp: g / (x * LN2))))
log10 = unary(_unary("log10", PLAIN, grad_x("g / (x ln 10)", lambda g, x, xp: g / (x * LN10))))
sqrt = unary(_unary("sqrt", PLAIN, grad_y("g / (2 y)", lambda g, y, xp: g / (2 * y))))
tanh = unary(_unary("tanh", MONOTONE, grad_y("g (1 - y^2)", lambda g, y, xp: g * (1 - y * y))))
floor = unary(_unary("floor", MONOTONE, ZERO))
ceil = unary(_unary("ceil", MONOTONE, ZERO))
trunc = unary(_unary("trunc", MONOTONE, ZERO))
rint = unary(_unary("rint", MONOTONE, ZERO))
arctan = unary(_unary("arctan", MONOTONE, grad_x("g / (1 + x^2)", lambda g, x, xp: g / (1 + x * x))))
arcsinh = unary(_unary("arcsinh", MONOTONE, grad_x("g / sqrt(x^2 + 1)", lambda g, x, xp: g / xp.sqrt(x * x + 1))))
cbrt = unary(_unary("cbrt", MONOTONE, grad_y("g / (3 y^2)", lambda g, y, xp: g / (3 * y * y))))
abs = unary(_unary("abs", PLAIN, grad_x("g sign(x)", lambda g, x, xp: g * xp.sign(x))), "__abs__")
sin = unary(_unary("sin", PLAIN, grad_x("g cos(x)", lambda g, x, xp: g * xp.cos(x))))
cos = unary(_unary("cos", PLAIN, grad_x("-g sin(x)", lambda g, x, xp: -g * xp.sin(x))))
tan = unary(_unary("tan", PLAIN, grad_y("g (1 + y^2)", lambda g, y, xp: g * (1 + y * y))))
sign = unary(_unary("sign", PLAIN, ZERO))
square = unary(_unary("square", PLAIN, grad_x("2 g x", lambda g, x, xp: 2 * g * x)))
reciprocal = unary(_unary("reciprocal", PLAIN, grad_y("-g y^2", lambda g, y, xp: -g * y * y)))
logical_not = unary(_unary("logical_not", PLAIN))
isnan = unary(_unary("isnan", PLAIN))
isinf = unary(_unary("isinf", PLAIN))
isfinite = unary(_unary("isfinite", PLAIN))
arcsin = unary(_unary("arcsin", PLAIN, grad_x("g / sqrt(1 - x^2)", lambda g, x, xp: g / xp.sqrt(1 - x * x)),
                      domain=("unit",)))
arccos = unary(_unary("arccos", PLAIN, grad_x("-g / sqrt(1 - x^2)", lambda g, x, xp: -g / xp.sqrt(1 - x * x)),
                      domain=("unit",)))
sinh = unary(_unary("sinh", PLAIN, grad_x("g cosh(x)", lambda g, x, xp: g * xp.cosh(x))))
cosh = unary(_unary("cosh", PLAIN, grad_x("g sinh(x)", lambda g, x, xp: g * xp.sinh(x))))
bitwise_not = unary(_unary("bitwise_not", PLAIN, domain=("int",)), "__invert__")


# --- binary --------------------------------------------------------------------------------
def _ties(g: Any, a: Any, b: Any, xp: Any, greater: bool) -> tuple[Any, Any]:
    win = (a > b) if greater else (a < b)
    tie = a == b
    return g * (win + 0.5 * tie), g * (~win & ~tie) + g * 0.5 * tie


POW_GRAD = Backward(lambda g, xs, y, p, xp: (
    g * xs[1] * xs[0] ** (xs[1] - 1),
    g * y * xp.log(xp.where(xs[0] > 0, xs[0], 1)) if p["needs"][1] else None), True, True,
    "(g b a^(b-1), g y ln a)")

add = binary(_binary("add", (pp("sum"), pp("avg"), pr("max"), rp("max"), pr("min"), rp("min")),
                     binary_grad("(g, g)", lambda g, a, b, y, xp: (g, g), inputs=False)),
             "__add__", reflected=("__radd__",), inplace=("__iadd__", "add_"))
sub = binary(_binary("sub", (pp("sum"), pp("avg"), pr("max"), rp("max", "min"), pr("min"), rp("min", "max")),
                     binary_grad("(g, -g)", lambda g, a, b, y, xp: (g, -g), inputs=False), "subtract"),
             "__sub__", reflected=("__rsub__",), inplace=("__isub__", "sub_"), alias=("subtract",))
subtract = sub
mul = binary(_binary("mul", (pr("sum"), rp("sum"), pr("avg"), rp("avg")),
                     binary_grad("(g b, g a)", lambda g, a, b, y, xp: (g * b, g * a)), "multiply"),
             "__mul__", reflected=("__rmul__",), inplace=("__imul__", "mul_"), alias=("multiply",))
multiply = mul
truediv = binary(_binary("truediv", (pr("sum"), pr("avg")),
                         binary_grad("(g / b, -g a / b^2)", lambda g, a, b, y, xp: (g / b, -g * a / (b * b))),
                         "true_divide"),
                 "__truediv__", reflected=("__rtruediv__",), inplace=("__itruediv__", "div_"), alias=("divide",))
divide = truediv
floordiv = binary(_binary("floordiv", (), binary_grad("0", lambda g, a, b, y, xp: (xp.zeros_like(g), xp.zeros_like(g)),
                                                      inputs=False), "floor_divide"),
                  "__floordiv__", reflected=("__rfloordiv__",), alias=("floor_divide",))
floor_divide = floordiv
mod = binary(_binary("mod", (), binary_grad("(g, -g floor(a / b))", lambda g, a, b, y, xp: (g, -g * xp.floor_divide(a, b))),
                     "remainder"), "__mod__", reflected=("__rmod__",), alias=("remainder",))
remainder = mod
pow = binary(_binary("pow", (), POW_GRAD, "power"), "__pow__", reflected=("__rpow__",), alias=("power",))
power = pow
maximum = binary(_binary("maximum", (pp("max"), pr("max"), rp("max")), binary_grad(
    "g to the larger (split on ties)", lambda g, a, b, y, xp: _ties(g, a, b, xp, True))))
minimum = binary(_binary("minimum", (pp("min"), pr("min"), rp("min")), binary_grad(
    "g to the smaller (split on ties)", lambda g, a, b, y, xp: _ties(g, a, b, xp, False))))
eq = binary(_binary("eq", ufunc="equal"), "__eq__")
ne = binary(_binary("ne", ufunc="not_equal"), "__ne__")
lt = binary(_binary("lt", ufunc="less"), "__lt__")
le = binary(_binary("le", ufunc="less_equal"), "__le__")
gt = binary(_binary("gt", ufunc="greater"), "__gt__")
ge = binary(_binary("ge", ufunc="greater_equal"), "__ge__")
logical_and = binary(_binary("logical_and"))
logical_or = binary(_binary("logical_or"))
logical_xor = binary(_binary("logical_xor"))
bitwise_and = binary(_binary("bitwise_and", domain=("int", "int")), "__and__")
bitwise_or = binary(_binary("bitwise_or", domain=("int", "int")), "__or__")
bitwise_xor = binary(_binary("bitwise_xor", domain=("int", "int")), "__xor__")
arctan2 = binary(_binary("arctan2", (), binary_grad("(g b, -g a) / (a^2 + b^2)", lambda g, a, b, y, xp: (
    g * b / (a * a + b * b), -g * a / (a * a + b * b)))))
hypot = binary(_binary("hypot", (), binary_grad("(g a / y, g b / y)", lambda g, a, b, y, xp: (g * a / y, g * b / y),
                                                output=True)))

# --- where, clone, astype -------------------------------------------------------------------
WHERE = Op("where", Signature("where", tuple(shard_rules(3) + [Rule((R, P(op), P(op)), P(op)) for op in ALL_PARTIALS]),
                              "where(cond, a, b): broadcasting; a Replicate cond selects between Partial terms"),
           plan_elementwise, lambda xp, cond, a, b: xp.where(cond, a, b), reference=np.where,
           domain=("bool", "real", "real"),
           backward=Backward(lambda g, xs, out, p, xp: (None, g * xs[0], g * ~xs[0]), True, False,
                             "(none, g where cond, g where not cond)"))


@WHERE.define()
def where(cond: Any, a: Any, b: Any) -> DTensor:
    """``numpy.where`` on DTensors (broadcasting; see ``signature("where")``)."""
    return apply_elementwise(WHERE, (cond, a, b), NO_PARAMS)


CLONE = Op("clone", Signature("clone", follows_data()), plan_elementwise, lambda xp, x: x.copy(),
           reference=np.copy, backward=grad_g("g", lambda g, xp: g))


@CLONE.define("clone")
def clone(x: DTensor) -> DTensor:
    """A copy with the same placements."""
    tensor_spec(x, "clone")
    return apply_elementwise(CLONE, (x,), NO_PARAMS)


ASTYPE = Op("astype", Signature("astype", follows_data("only to a floating or complex dtype")), plan_elementwise,
            lambda xp, x, dtype: x.astype(dtype), params=("dtype",), reference=lambda x, dtype: x.astype(dtype),
            examples=({"dtype": np.float32},),
            backward=Backward(lambda g, xs, out, p, xp: (g,), False, False, "g cast back to the input dtype"))


@ASTYPE.define("astype")
def astype(x: DTensor, dtype: Any) -> DTensor:
    """A cast. Partial inputs only to floating or complex dtypes (other casts are not linear)."""
    from ..dtypes import check_dtype

    spec = tensor_spec(x, "astype")
    dt = check_dtype(dtype)
    if dt.kind not in "fc" and builtins.any(isinstance(p, Partial) for p in spec.placements):
        raise PlacementError(
            f"astype({dt}): casting a Partial value to a non-floating dtype does not commute with "
            f"its reduction; redistribute first, e.g. x = x.redistribute(placements="
            f"{[p if not isinstance(p, Partial) else 'Replicate()' for p in spec.placements]})"
        )
    return apply_elementwise(ASTYPE, (x,), {"dtype": dt})


ASTYPE.bind("to", astype)
ASTYPE.bind("double", lambda x: astype(x, np.float64))
ASTYPE.bind("float", lambda x: astype(x, np.float32))  # a method: Python's float(x) is __float__
CLONE.bind("copy", clone)

__all__ = [
    "abs", "add", "arccos", "arcsin", "arcsinh", "arctan", "arctan2", "astype", "bitwise_and", "bitwise_not",
    "bitwise_or", "bitwise_xor", "cbrt", "ceil", "clone", "cos", "cosh", "divide", "eq", "exp", "expm1", "floor",
    "floor_divide", "floordiv", "ge", "gt", "hypot", "isfinite", "isinf", "isnan", "le", "log", "log10", "log1p",
    "log2", "logical_and", "logical_not", "logical_or", "logical_xor", "lt", "maximum", "minimum", "mod", "mul",
    "multiply", "ne", "neg", "negative", "pow", "power", "reciprocal", "remainder", "rint", "sign", "sin", "sinh",
    "sqrt", "square", "sub", "subtract", "tan", "tanh", "truediv", "trunc", "where",
]
