"""Operators: placement signatures (data), inference (metadata only) and local compute."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..dtensor import DTensor
from . import functions as F
from .signature import Pat, Rule, Signature
from .tables import ALIASES, SIGNATURES, signature


def _unary_fn(name: str) -> Callable[..., DTensor]:
    def fn(x: DTensor, **kwargs: Any) -> DTensor:
        return F.unary(name, x, **kwargs)

    fn.__name__ = name
    fn.__doc__ = f"Elementwise {name}. Placement rules: dtorch_mpi.signature({name!r})."
    return fn


def _binary_fn(name: str) -> Callable[..., DTensor]:
    def fn(a: Any, b: Any) -> DTensor:
        return F.binary(name, a, b)

    fn.__name__ = name
    fn.__doc__ = (f"Elementwise {name} with broadcasting. A Replicate operand is sliced locally to "
                  f"the other operand's Shard (no communication). Rules: signature({name!r}).")
    return fn


UNARY_FUNCTIONS = {name: _unary_fn(name) for name in F.LOCAL_UNARY}
BINARY_FUNCTIONS = {name: _binary_fn(name) for name in F.LOCAL_BINARY}


def clip(x: DTensor, lo: Any = None, hi: Any = None) -> DTensor:
    """Clip to scalar bounds (monotone: keeps Partial max/min)."""
    return F.unary("clip", x, lo=lo, hi=hi)


UNARY_FUNCTIONS["clip"] = clip

def _reduction_fn(name: str, arg: bool) -> Callable[..., DTensor]:
    def fn(x: DTensor, dim: Any = None, keepdim: bool = False) -> DTensor:
        return F.arg_reduce(name, x, dim, keepdim) if arg else F.reduce(name, x, dim, keepdim)

    fn.__name__ = name
    fn.__doc__ = (f"{name} over ``dim`` (all dims when None). Over a sharded dim the result is "
                  f"Partial; rules: dtorch_mpi.signature({name!r}).")
    return fn


REDUCTIONS = {name: _reduction_fn(name, False) for name in ("sum", "mean", "max", "min", "prod")}
ARG_REDUCTIONS = {name: _reduction_fn(name, True) for name in ("argmax", "argmin")}

_OPERATORS = {
    "__add__": lambda a, b: F.binary_fast("add", a, b), "__radd__": lambda a, b: F.binary("add", b, a),
    "__sub__": lambda a, b: F.binary_fast("sub", a, b), "__rsub__": lambda a, b: F.binary("sub", b, a),
    "__mul__": lambda a, b: F.binary_fast("mul", a, b), "__rmul__": lambda a, b: F.binary("mul", b, a),
    "__truediv__": lambda a, b: F.binary("truediv", a, b),
    "__rtruediv__": lambda a, b: F.binary("truediv", b, a),
    "__floordiv__": lambda a, b: F.binary("floordiv", a, b),
    "__rfloordiv__": lambda a, b: F.binary("floordiv", b, a),
    "__mod__": lambda a, b: F.binary("mod", a, b), "__rmod__": lambda a, b: F.binary("mod", b, a),
    "__pow__": lambda a, b: F.binary("pow", a, b), "__rpow__": lambda a, b: F.binary("pow", b, a),
    "__matmul__": lambda a, b: F.matmul(a, b), "__rmatmul__": lambda a, b: F.matmul(b, a),
    "__eq__": lambda a, b: F.binary("eq", a, b), "__ne__": lambda a, b: F.binary("ne", a, b),
    "__lt__": lambda a, b: F.binary("lt", a, b), "__le__": lambda a, b: F.binary("le", a, b),
    "__gt__": lambda a, b: F.binary("gt", a, b), "__ge__": lambda a, b: F.binary("ge", a, b),
    "__and__": lambda a, b: F.binary("logical_and" if a.dtype == bool else "bitwise_and", a, b),
    "__or__": lambda a, b: F.binary("logical_or" if a.dtype == bool else "bitwise_or", a, b),
    "__xor__": lambda a, b: F.binary("logical_xor" if a.dtype == bool else "bitwise_xor", a, b),
    "__neg__": lambda a: F.unary("neg", a), "__pos__": lambda a: a, "__abs__": lambda a: F.unary("abs", a),
    "__invert__": lambda a: F.unary("logical_not" if a.dtype == bool else "bitwise_not", a),
    "__getitem__": F.getitem,
    "__iadd__": lambda a, b: F.inplace("add", F.LOCAL_BINARY["add"], a, b),
    "__isub__": lambda a, b: F.inplace("sub", F.LOCAL_BINARY["sub"], a, b),
    "__imul__": lambda a, b: F.inplace("mul", F.LOCAL_BINARY["mul"], a, b),
    "__itruediv__": lambda a, b: F.inplace("truediv", F.LOCAL_BINARY["truediv"], a, b),
}
_METHODS = {
    "add_": _OPERATORS["__iadd__"], "sub_": _OPERATORS["__isub__"], "mul_": _OPERATORS["__imul__"],
    "div_": _OPERATORS["__itruediv__"],
    "matmul": F.matmul, "astype": F.astype, "clone": F.clone, "softmax": F.softmax,
    "log_softmax": F.log_softmax, "transpose": F.transpose, "permute": F.permute,
    "swapaxes": F.transpose, "reshape": F.reshape, "view": F.reshape, "flatten": F.flatten,
    "squeeze": F.squeeze, "unsqueeze": F.unsqueeze, "clip": clip,
    **REDUCTIONS, **ARG_REDUCTIONS,
}


def _install_methods() -> None:
    for name, fn in {**_OPERATORS, **_METHODS}.items():
        setattr(DTensor, name, fn)
    for name, fn in UNARY_FUNCTIONS.items():
        if not hasattr(DTensor, name):
            setattr(DTensor, name, fn)
    DTensor.T = property(lambda self: F.transpose(self))  # type: ignore[assignment]
    DTensor.__hash__ = object.__hash__  # type: ignore[assignment]


_install_methods()

__all__ = ["ALIASES", "ARG_REDUCTIONS", "BINARY_FUNCTIONS", "F", "Pat", "REDUCTIONS", "Rule",
           "SIGNATURES", "Signature", "UNARY_FUNCTIONS", "clip", "signature"]
