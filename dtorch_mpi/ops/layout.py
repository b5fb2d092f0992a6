"""Layout and shape operators: permute/transpose, reshape (view, flatten, squeeze, unsqueeze),
basic indexing, cat and stack. They move values without combining them, so Shard dims follow
the data and every Partial stays. Each declaration holds the op's rule table, kernel and
backward."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtensor import DTensor
from .apply import apply_getitem, apply_join, apply_permute, apply_reshape, tensor_spec
from .backward import Backward
from .planners import plan_cat, plan_getitem, plan_permute, plan_reshape, plan_stack
from .registry import Op
from .signature import P, R, Rule, S, Signature
from .tables import ALL_PARTIALS, follows_data

LAYOUT_DOC = "layout op: Shard dims follow the data; any Partial stays"

# --- permute / transpose -------------------------------------------------------------------
TRANSPOSE = Op("transpose", Signature("transpose", follows_data(), LAYOUT_DOC + " (d follows the permutation)"),
               plan_permute, lambda xp, x, perm: xp.transpose(x, perm), reference=np.transpose,
               backward=Backward(lambda g, xs, out, p, xp: (xp.transpose(g, np.argsort(p["perm"])),), False, False,
                                 "g permuted back"))


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

# --- reshape -------------------------------------------------------------------------------
RESHAPE = Op("reshape", Signature("reshape", follows_data(),
             "a sharded dim keeps its length and the product of the dims before it ([B, T, H] -> "
             "[B, T*H] keeps Shard(0)), or is the outermost dim of a block of dims that is split or "
             "merged where every rank's piece is the piece the new dim's Shard gives it, so no data "
             "moves ([B, T, 12] Shard(2) -> [B, T, 4, 3] Shard(2) at 4 ranks: one whole head each; "
             "not at 3 ranks, where 4 heads split 2/1/1). The decision uses the global shape and the "
             "mesh size only; also view, flatten, squeeze, unsqueeze"),
             plan_reshape, lambda xp, x, local_shape: x.reshape(local_shape), reference=np.reshape,
             backward=Backward(lambda g, xs, out, p, xp: (g.reshape(p["in_shapes"][0]),), False, False,
                               "g reshaped back"))


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


# --- basic indexing --------------------------------------------------------------------------
def _getitem_grad(g: Any, xs: tuple[Any, ...], out: Any, p: dict[str, Any], xp: Any) -> tuple[Any]:
    grad = xp.zeros(p["in_shapes"][0], dtype=g.dtype)
    grad[p["key"]] = g
    return (grad,)


GETITEM = Op("getitem", Signature("getitem", follows_data(),
             "basic indexing (ints, slices, None, ...); sharded dims must be taken whole ([:]): x[a:b] "
             "of a sharded dim leaves the rows on the ranks that held them, not the split rule's "
             "balanced layout of the result, so it needs data movement. Slice after making that dim "
             "whole (the suggested redistribute; .redistribute(placements=[Shard(d)]) of the result "
             "cuts it back locally), or index an unsharded dim"),
             plan_getitem, lambda xp, x, key: x[key], reference=lambda x, key: x[key],
             backward=Backward(_getitem_grad, False, False, "g placed at the indexed positions, zeros elsewhere"))
GETITEM.bind("__getitem__", lambda x, key: apply_getitem(GETITEM, x, key))


# --- cat / stack ---------------------------------------------------------------------------
def _joined(name: str, doc: str) -> Signature:
    """Two inputs with equal placements shown; the planner widens the table to n (tables.nary)."""
    return Signature(name, (Rule((S("d"), S("d")), S("d")), Rule((R, R), R)) + tuple(
        Rule((P(p), P(p)), P(p)) for p in ALL_PARTIALS), doc)


def _cat_grad(g: Any, xs: tuple[Any, ...], out: Any, p: dict[str, Any], xp: Any) -> tuple[Any, ...]:
    bounds = np.cumsum([shape[p["dim"]] for shape in p["in_shapes"]])[:-1]
    return tuple(xp.split(g, bounds, axis=p["dim"]))


def _stack_grad(g: Any, xs: tuple[Any, ...], out: Any, p: dict[str, Any], xp: Any) -> tuple[Any, ...]:
    return tuple(xp.take(g, i, axis=p["dim"]) for i in range(len(p["in_shapes"])))


CAT = Op("cat", _joined("cat", "n inputs with equal placements (shown for two); the joined dim must not be sharded"),
         plan_cat, lambda xp, *xs, dim: xp.concatenate(xs, axis=dim), reference=np.concatenate,
         backward=Backward(_cat_grad, False, False, "g split along the joined dim"))
STACK = Op("stack", _joined("stack", "n inputs with equal placements (shown for two); the new dim is unsharded"),
           plan_stack, lambda xp, *xs, dim: xp.stack(xs, axis=dim), reference=np.stack,
           backward=Backward(_stack_grad, False, False, "g taken along the new dim"))


@CAT.define()
def cat(tensors: Sequence[DTensor], dim: int = 0) -> DTensor:
    """Concatenate along an unsharded ``dim``; all inputs share placements."""
    return apply_join(CAT, tensors, dim, False)


@STACK.define()
def stack(tensors: Sequence[DTensor], dim: int = 0) -> DTensor:
    """Stack along a new ``dim``; all inputs share placements and shape."""
    return apply_join(STACK, tensors, dim, True)


__all__ = ["cat", "flatten", "permute", "reshape", "squeeze", "stack", "swapaxes", "transpose", "unsqueeze"]
