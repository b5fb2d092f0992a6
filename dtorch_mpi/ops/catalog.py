"""Every operator, declared once: rule table, kernel, public functions, DTensor methods.

Each public name below is a real module-level binding with a precise type (what mypy and
IDEs see as ``dtorch_mpi.<name>``); ``dtorch_mpi/__init__.py`` re-exports this module's
``__all__``, which is derived from the declarations (tests/test_ops.py checks that the two
agree). To add an operator: one ``Op(...)`` plus its public function here, its kernel here or
in kernels.py; rules, docs, methods and tests follow from the declaration.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..autograd.kernels import BACKWARDS
from ..dtensor import DTensor
from ..errors import PlacementError
from ..placement import Partial
from . import kernels as K
from .apply import (
    NO_PARAMS,
    apply_along_dim,
    apply_elementwise,
    apply_getitem,
    apply_join,
    apply_matmul,
    apply_permute,
    apply_reduce,
    apply_reshape,
    arg_reduction,
    binary,
    reduction,
    spelling,
    tensor_spec,
    unary,
)
from .planners import (
    plan_along_dim,
    plan_cat,
    plan_elementwise,
    plan_getitem,
    plan_matmul,
    plan_permute,
    plan_reduce,
    plan_reshape,
    plan_stack,
)
from .registry import Op
from .signature import P, R, Rule, S, Signature
from .tables import BINARY, OTHER, UNARY, WHERE


def _ufunc(name: str, ufunc: str | None = None, **kw: Any) -> Op:
    """An op that is the array library's own function ``ufunc`` (NumPy's is its reference)."""
    fn = ufunc or name
    sig = UNARY.get(name) or BINARY[name]
    return Op(name, sig, plan_elementwise, ufunc=fn, params=None, reference=getattr(np, fn),
              backward=BACKWARDS.get(name), **kw)


def _local(name: str, kernel: Any, reference: Any, **kw: Any) -> Op:
    return Op(name, UNARY[name], plan_elementwise, kernel, reference=reference, backward=BACKWARDS[name], **kw)


# --- elementwise unary ---------------------------------------------------------------------
neg = unary(_ufunc("neg", "negative"), "__neg__", alias=("negative",))
negative = neg
exp = unary(_ufunc("exp"))
expm1 = unary(_ufunc("expm1"))
log = unary(_ufunc("log"))
log1p = unary(_ufunc("log1p"))
log2 = unary(_ufunc("log2"))
log10 = unary(_ufunc("log10"))
sqrt = unary(_ufunc("sqrt"))
tanh = unary(_ufunc("tanh"))
floor = unary(_ufunc("floor"))
ceil = unary(_ufunc("ceil"))
trunc = unary(_ufunc("trunc"))
rint = unary(_ufunc("rint"))
arctan = unary(_ufunc("arctan"))
arcsinh = unary(_ufunc("arcsinh"))
cbrt = unary(_ufunc("cbrt"))
abs = unary(_ufunc("abs"), "__abs__")
sin = unary(_ufunc("sin"))
cos = unary(_ufunc("cos"))
tan = unary(_ufunc("tan"))
sign = unary(_ufunc("sign"))
square = unary(_ufunc("square"))
reciprocal = unary(_ufunc("reciprocal"))
logical_not = unary(_ufunc("logical_not"))
isnan = unary(_ufunc("isnan"))
isinf = unary(_ufunc("isinf"))
isfinite = unary(_ufunc("isfinite"))
arcsin = unary(_ufunc("arcsin", domain=("unit",)))
arccos = unary(_ufunc("arccos", domain=("unit",)))
sinh = unary(_ufunc("sinh"))
cosh = unary(_ufunc("cosh"))
bitwise_not = unary(_ufunc("bitwise_not", domain=("int",)), "__invert__")
sigmoid = unary(_local("sigmoid", K.sigmoid, lambda x: 1 / (1 + np.exp(-x))))
relu = unary(_local("relu", K.relu, lambda x: np.maximum(x, 0)))
silu = unary(_local("silu", K.silu, lambda x: x / (1 + np.exp(-x))))
softplus = unary(_local("softplus", K.softplus, lambda x: np.log1p(np.exp(x))))


def _gelu_reference(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return x * np.vectorize(lambda v: 0.5 * math.erfc(-v / math.sqrt(2)), otypes=[x.dtype])(x)


GELU = _local("gelu", K.gelu, _gelu_reference, params=("approximate",),
              examples=({}, {"approximate": "tanh"}))


@GELU.define("gelu")
def gelu(x: DTensor, approximate: str = "none") -> DTensor:
    """PyTorch's GELU: ``approximate="none"`` (default) is ``x * Phi(x)`` with the exact erf;
    ``"tanh"`` is the tanh approximation. Rules: ``signature("gelu")``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return apply_elementwise(GELU, (x,), {"approximate": approximate})


CLIP = _local("clip", K.clip, lambda x, lo=None, hi=None: np.clip(x, lo, hi), params=("lo", "hi"),
              examples=({"lo": 2, "hi": 5}, {"lo": 3}, {"hi": 4}))


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


# --- elementwise binary --------------------------------------------------------------------
add = binary(_ufunc("add"), "__add__", reflected=("__radd__",), inplace=("__iadd__", "add_"))
sub = binary(_ufunc("sub", "subtract"), "__sub__", reflected=("__rsub__",), inplace=("__isub__", "sub_"),
             alias=("subtract",))
subtract = sub
mul = binary(_ufunc("mul", "multiply"), "__mul__", reflected=("__rmul__",), inplace=("__imul__", "mul_"),
             alias=("multiply",))
multiply = mul
truediv = binary(_ufunc("truediv", "true_divide"), "__truediv__", reflected=("__rtruediv__",),
                 inplace=("__itruediv__", "div_"), alias=("divide",))
divide = truediv
floordiv = binary(_ufunc("floordiv", "floor_divide"), "__floordiv__", reflected=("__rfloordiv__",),
                  alias=("floor_divide",))
floor_divide = floordiv
mod = binary(_ufunc("mod", "remainder"), "__mod__", reflected=("__rmod__",), alias=("remainder",))
remainder = mod
pow = binary(_ufunc("pow", "power"), "__pow__", reflected=("__rpow__",), alias=("power",))
power = pow
maximum = binary(_ufunc("maximum"))
minimum = binary(_ufunc("minimum"))
eq = binary(_ufunc("eq", "equal"), "__eq__")
ne = binary(_ufunc("ne", "not_equal"), "__ne__")
lt = binary(_ufunc("lt", "less"), "__lt__")
le = binary(_ufunc("le", "less_equal"), "__le__")
gt = binary(_ufunc("gt", "greater"), "__gt__")
ge = binary(_ufunc("ge", "greater_equal"), "__ge__")
logical_and = binary(_ufunc("logical_and"))
logical_or = binary(_ufunc("logical_or"))
logical_xor = binary(_ufunc("logical_xor"))
bitwise_and = binary(_ufunc("bitwise_and", domain=("int", "int")), "__and__")
bitwise_or = binary(_ufunc("bitwise_or", domain=("int", "int")), "__or__")
bitwise_xor = binary(_ufunc("bitwise_xor", domain=("int", "int")), "__xor__")
arctan2 = binary(_ufunc("arctan2"))
hypot = binary(_ufunc("hypot"))

WHERE_OP = Op("where", WHERE, plan_elementwise, K.where, reference=np.where, domain=("bool", "real", "real"), backward=BACKWARDS["where"])


@WHERE_OP.define()
def where(cond: Any, a: Any, b: Any) -> DTensor:
    """``numpy.where`` on DTensors (broadcasting; see ``signature("where")``)."""
    return apply_elementwise(WHERE_OP, (cond, a, b), NO_PARAMS)


CLONE = Op("clone", OTHER["clone"], plan_elementwise, K.clone, reference=np.copy, backward=BACKWARDS["clone"])


@CLONE.define("clone")
def clone(x: DTensor) -> DTensor:
    """A copy with the same placements."""
    tensor_spec(x, "clone")
    return apply_elementwise(CLONE, (x,), NO_PARAMS)


ASTYPE = Op("astype", OTHER["astype"], plan_elementwise, K.astype, params=("dtype",),
            reference=lambda x, dtype: x.astype(dtype), examples=({"dtype": np.float32},), backward=BACKWARDS["astype"])


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

# --- matmul --------------------------------------------------------------------------------
MATMUL = Op("matmul", OTHER["matmul"], plan_matmul, K.matmul, reference=np.matmul, backward=BACKWARDS["matmul"])


@MATMUL.define("matmul", "__matmul__")
def matmul(a: DTensor, b: DTensor) -> DTensor:
    """``a @ b`` (NumPy semantics). See ``signature("matmul")``."""
    return apply_matmul(MATMUL, a, b)


MATMUL.bind("__rmatmul__", lambda a, b: matmul(b, a))

# --- reductions ----------------------------------------------------------------------------
sum = reduction(Op("sum", OTHER["sum"], plan_reduce, K.reduce_sum, reference=np.sum, backward=BACKWARDS["sum"]))
mean = reduction(Op("mean", OTHER["mean"], plan_reduce, K.reduce_mean, reference=np.mean, backward=BACKWARDS["mean"]))
max = reduction(Op("max", OTHER["max"], plan_reduce, K.reduce_max, reference=np.max, backward=BACKWARDS["max"]))
min = reduction(Op("min", OTHER["min"], plan_reduce, K.reduce_min, reference=np.min, backward=BACKWARDS["min"]))
prod = reduction(Op("prod", OTHER["prod"], plan_reduce, K.reduce_prod, reference=np.prod, backward=BACKWARDS["prod"]))
all = reduction(Op("all", OTHER["all"], plan_reduce, K.reduce_all, reference=np.all, domain=("bool",)))
any = reduction(Op("any", OTHER["any"], plan_reduce, K.reduce_any, reference=np.any, domain=("bool",)))
STD = Op("std", OTHER["std"], plan_reduce, K.reduce_std, reference=np.std, backward=BACKWARDS["std"])
VAR = Op("var", OTHER["var"], plan_reduce, K.reduce_var, reference=np.var, backward=BACKWARDS["var"])


def _spread(op: Op, x: DTensor, dim: Any, keepdim: Any, ddof: Any, axis: Any, keepdims: Any,
            correction: Any) -> DTensor:
    return apply_reduce(op, x, spelling(op.name, "dim", dim, "axis", axis, None),
                        spelling(op.name, "keepdim", keepdim, "keepdims", keepdims, False),
                        ddof=int(spelling(op.name, "correction", correction, "ddof", ddof, 0)))


@STD.define("std")
def std(x: DTensor, dim: int | Sequence[int] | None = None, keepdim: bool | None = None, *, ddof: int | None = None,
        axis: int | Sequence[int] | None = None, keepdims: bool | None = None, correction: int | None = None) -> DTensor:
    """Standard deviation over unsharded ``dim`` (NumPy's ``ddof=0`` default; torch's
    ``correction=`` is the same parameter). Over a sharded dim: see ``signature("std")``."""
    return _spread(STD, x, dim, keepdim, ddof, axis, keepdims, correction)


@VAR.define("var")
def var(x: DTensor, dim: int | Sequence[int] | None = None, keepdim: bool | None = None, *, ddof: int | None = None,
        axis: int | Sequence[int] | None = None, keepdims: bool | None = None, correction: int | None = None) -> DTensor:
    """Variance over unsharded ``dim`` (NumPy's ``ddof=0`` default; torch's ``correction=`` is
    the same parameter). Over a sharded dim: see ``signature("var")``."""
    return _spread(VAR, x, dim, keepdim, ddof, axis, keepdims, correction)


argmax = arg_reduction(Op("argmax", OTHER["argmax"], plan_reduce, K.arg_reduce("argmax"), reference=np.argmax))
argmin = arg_reduction(Op("argmin", OTHER["argmin"], plan_reduce, K.arg_reduce("argmin"), reference=np.argmin))


# --- along one dim -------------------------------------------------------------------------
def _softmax_reference(x: np.ndarray, dim: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=dim, keepdims=True, initial=-np.inf))
    return e / e.sum(axis=dim, keepdims=True)


SOFTMAX = Op("softmax", OTHER["softmax"], plan_along_dim, K.softmax, reference=_softmax_reference, backward=BACKWARDS["softmax"])
LOG_SOFTMAX = Op("log_softmax", OTHER["log_softmax"], plan_along_dim, K.log_softmax,
                 reference=lambda x, dim: np.log(_softmax_reference(x, dim)), backward=BACKWARDS["log_softmax"])


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
    plan_along_dim, lambda xp, x, dim: xp.cumsum(x, axis=dim), reference=lambda x, dim: np.cumsum(x, axis=dim), backward=BACKWARDS["cumsum"])


@CUMSUM.define("cumsum")
def cumsum(x: DTensor, dim: int) -> DTensor:
    """Cumulative sum along an unsharded ``dim``. Rules: ``signature("cumsum")``."""
    return apply_along_dim(CUMSUM, x, dim)


# --- layout --------------------------------------------------------------------------------
TRANSPOSE = Op("transpose", OTHER["transpose"], plan_permute, K.permute, reference=np.transpose, backward=BACKWARDS["transpose"])


@TRANSPOSE.define("permute")
def permute(x: DTensor, *dims: Any) -> DTensor:
    """Reorder dims; Shard dims follow the data."""
    ndim = len(tensor_spec(x, "permute").shape)
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    perm = tuple(int(d) % (ndim or 1) for d in dims)
    if sorted(perm) != list(range(ndim)):
        raise ValueError(f"permute: {dims} is not a permutation of {ndim} dims")
    return apply_permute(TRANSPOSE, x, perm)


@TRANSPOSE.define("transpose", "swapaxes", alias=("swapaxes",))
def transpose(x: DTensor, dim0: int = -2, dim1: int = -1) -> DTensor:
    """Swap two dims (a 2-D tensor's transpose by default)."""
    ndim = len(tensor_spec(x, "transpose").shape)
    perm = list(range(ndim))
    if ndim >= 2:
        a, b = dim0 % ndim, dim1 % ndim
        perm[a], perm[b] = perm[b], perm[a]
    return apply_permute(TRANSPOSE, x, tuple(perm))


swapaxes = transpose
TRANSPOSE.bind("T", property(transpose))

RESHAPE = Op("reshape", OTHER["reshape"], plan_reshape, K.reshape, reference=np.reshape, backward=BACKWARDS["reshape"])


@RESHAPE.define("reshape", "view")
def reshape(x: DTensor, *shape: Any) -> DTensor:
    """Reshape where the result is expressible without moving data (see its signature)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return apply_reshape(RESHAPE, x, shape)


@RESHAPE.define("flatten")
def flatten(x: DTensor, start_dim: int = 0, end_dim: int = -1) -> DTensor:
    """Merge dims ``start_dim..end_dim`` into one."""
    shape = tensor_spec(x, "flatten").shape
    if not shape:
        return reshape(x, (1,))
    s, e = start_dim % len(shape), end_dim % len(shape)
    return reshape(x, shape[:s] + (math.prod(shape[s : e + 1]),) + shape[e + 1 :])


@RESHAPE.define("squeeze")
def squeeze(x: DTensor, dim: int | None = None) -> DTensor:
    """Drop length-1 dims (only ``dim`` when given; unchanged when it is not length 1)."""
    shape = tensor_spec(x, "squeeze").shape
    if dim is None:
        return reshape(x, tuple(n for n in shape if n != 1))
    d = dim % (len(shape) or 1)
    if not shape or shape[d] != 1:
        return x
    return reshape(x, shape[:d] + shape[d + 1 :])


@RESHAPE.define("unsqueeze")
def unsqueeze(x: DTensor, dim: int) -> DTensor:
    """Insert a length-1 dim at ``dim``."""
    shape = tensor_spec(x, "unsqueeze").shape
    d = dim % (len(shape) + 1)
    return reshape(x, shape[:d] + (1,) + shape[d:])


GETITEM = Op("getitem", OTHER["getitem"], plan_getitem, K.getitem, reference=lambda x, key: x[key], backward=BACKWARDS["getitem"])
GETITEM.bind("__getitem__", lambda x, key: apply_getitem(GETITEM, x, key))

CAT = Op("cat", OTHER["cat"], plan_cat, K.cat, reference=np.concatenate, backward=BACKWARDS["cat"])
STACK = Op("stack", OTHER["stack"], plan_stack, K.stack, reference=np.stack, backward=BACKWARDS["stack"])


@CAT.define()
def cat(tensors: Sequence[DTensor], dim: int = 0) -> DTensor:
    """Concatenate along an unsharded ``dim``; all inputs share placements."""
    return apply_join(CAT, tensors, dim, False)


@STACK.define()
def stack(tensors: Sequence[DTensor], dim: int = 0) -> DTensor:
    """Stack along a new ``dim``; all inputs share placements and shape."""
    return apply_join(STACK, tensors, dim, True)


__all__ = [  # every public operator name; tests/test_ops.py checks it against OPS
    "abs", "add", "all", "any", "arccos", "arcsin", "arcsinh", "arctan", "arctan2", "argmax", "argmin", "astype",
    "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "cat", "cbrt", "ceil", "clamp", "clip", "clone",
    "cos", "cosh", "cumsum", "divide", "eq", "exp", "expm1", "flatten", "floor", "floor_divide", "floordiv", "ge",
    "gelu", "gt", "hypot", "isfinite", "isinf", "isnan", "le", "log", "log10", "log1p", "log2",
    "log_softmax", "logical_and", "logical_not", "logical_or", "logical_xor", "lt", "matmul", "max",
    "maximum", "mean", "min", "minimum", "mod", "mul", "multiply", "ne", "neg", "negative", "permute",
    "pow", "power", "prod", "reciprocal", "relu", "remainder", "reshape", "rint", "sigmoid", "sign",
    "silu", "sin", "sinh", "softmax", "softplus", "sqrt", "square", "squeeze", "stack", "std", "sub",
    "subtract", "sum", "swapaxes", "tan", "tanh", "transpose", "truediv", "trunc", "unsqueeze", "var", "where",
]
