"""Parameters made where their placements are known (deferred initialisation).

A layer's parameter starts as a recipe: its global shape, dtype, mesh and placements, and the
fill that makes the values of any piece of it (for a random one, the key the layer drew at
construction, so the random sequence advances exactly as if the values had been made then).
The piece is made at the latest moment:

- a parallel style (``_shard_param``) or ``materialize(param, placements)`` makes only this
  rank's piece in the new placements; the sharding-invariant RNG gives it the values the
  complete parameter would have had, so no rank ever holds the complete parameter;
- anything else that touches the piece (an operator, ``to_local()``, ``state_dict`` loading,
  an optimizer) makes it in the parameter's own placements on first touch.

Either way the parameter then is a plain ``Parameter``: it changes class in place, so
nothing after pays for the deferral, and nothing can see a parameter without its values.
Building a model therefore allocates nothing, and sharding it allocates only the shards.
"""

from __future__ import annotations

from typing import Any

from ..arrays import array_namespace, to_host
from ..dtensor import DTensor
from ..factory import Fill, make_piece
from ..placement import Placement, normalize_placements
from ..spec import DTensorSpec
from .module import Parameter

_SLOT: Any = vars(DTensor)["_local"]  # the slot that holds the piece (here: the recipe until it is made)


class _Recipe:
    __slots__ = ("fill",)

    def __init__(self, fill: Fill) -> None:
        self.fill = fill


class DeferredParameter(Parameter):
    """A ``Parameter`` whose piece is made on first use (see the module docstring)."""

    __slots__ = ()

    @property  # type: ignore[override]
    def _local(self) -> Any:
        held = _SLOT.__get__(self, DTensor)
        if not isinstance(held, _Recipe):
            return held
        piece = make_piece(self._spec, held.fill)
        self._local = piece
        return piece

    @_local.setter
    def _local(self, value: Any) -> None:
        _SLOT.__set__(self, value)
        if not isinstance(value, _Recipe):
            self.__class__ = Parameter  # type: ignore[assignment]


def deferred_parameter(spec: DTensorSpec, fill: Fill, requires_grad: bool = True) -> Parameter:
    """A parameter of ``spec`` whose pieces ``fill(local_shape, offset, xp)`` makes on demand."""
    param = object.__new__(DeferredParameter)
    _SLOT.__set__(param, _Recipe(fill))
    param._spec = spec
    param._pending = None
    param._requires_grad = False
    param._grad_fn = None
    if requires_grad:
        param.requires_grad_(True)
    return param


def is_deferred(param: Any) -> bool:
    """True while ``param``'s piece has not been made."""
    return type(param) is DeferredParameter


def leading_values(param: DTensor, count: int) -> Any:
    """The first ``count`` (at most) values of a replicated ``param``'s first row, on the host:
    made by its recipe where it is deferred (only those values, its piece still unmade), else
    read from its piece. Equal on every rank that holds the same parameter."""
    shape = tuple(param.shape)
    block = tuple(1 for _ in shape[:-1]) + (min(shape[-1], count),) if shape else ()
    if is_deferred(param):
        xp = array_namespace(param.spec.mesh.device_type)
        values = _SLOT.__get__(param, DTensor).fill(block, tuple(0 for _ in shape), xp)
    else:
        values = param.to_local()[tuple(slice(0, n) for n in block)]
    return to_host(values)


def materialize(param: Parameter, placements: tuple[Placement, ...] | list[Placement] | None = None) -> Parameter:
    """Make ``param``'s piece in ``placements`` (default: its own) and return it. A deferred
    parameter makes only its own piece there (no communication, no complete value); one that
    already has its values is redistributed, its new piece in an allocation of its own."""
    spec = param.spec
    target = (spec.placements if placements is None
              else normalize_placements(placements, spec.mesh.ndim, len(spec.shape)))
    if is_deferred(param):
        held = _SLOT.__get__(param, DTensor)
        new = spec if target == spec.placements else spec.with_placements(target)
        param._replace(make_piece(new, held.fill), new)
        return param
    if target != spec.placements:
        moved = param.redistribute(placements=list(target))
        param._replace(own_piece(moved.to_local()), moved.spec)
    return param


def materialize_as(param: Parameter, spec: DTensorSpec) -> Parameter:
    """Make a deferred ``param``'s piece as ``spec``: the same global shape and dtype on the
    same ranks, any mesh order and placements (fully_shard's store layout, whose mesh may be a
    transposed 2-D mesh); only this rank's piece is made."""
    if not is_deferred(param):
        raise ValueError("materialize_as: the parameter already has its values; use materialize(param, placements)")
    if tuple(spec.shape) != tuple(param.shape) or spec.dtype != param.dtype:
        raise ValueError(f"materialize_as: spec {tuple(spec.shape)} {spec.dtype} is not the parameter's "
                         f"{tuple(param.shape)} {param.dtype}")
    held = _SLOT.__get__(param, DTensor)
    piece = make_piece(spec, held.fill)
    if getattr(piece, "base", None) is not None:  # a fill's reshape or broadcast: own the bytes
        piece = piece.copy(order="C")
    param._replace(piece, spec)
    return param


def own_piece(local: Any) -> Any:
    """``local`` as an array that owns its bytes (C-ordered): a copy where it is a view of a
    larger array or not C-contiguous, else ``local`` itself. The buffers of collectives (a
    page more than their bytes: comm/pool.py) count as owned."""
    base = getattr(local, "base", None)
    if local.flags.c_contiguous and (base is None or base.nbytes <= local.nbytes + 4096):
        return local
    return local.copy(order="C")
