"""The ``Stateful`` protocol: what checkpoints (and ``load_state_dict``) need from a stateful object.

As in PyTorch DCP, a stateful object has ``state_dict()`` and ``load_state_dict()``. Loading here
is checked in two phases, so a refused load changes nothing: ``prepare_load(state_dict)`` checks
the state_dict and returns a :class:`PendingLoad` whose ``targets`` (DTensors by key) the caller
fills from ``values`` (arrays, datasets or DTensors, same keys), then ``apply()`` installs them
(it cannot fail). Modules (their parameters are the targets, filled in place), optimizers (new
state tensors with their parameters' placements) and ``fully_shard``-ed modules implement it;
``dtorch_mpi.checkpoint`` knows objects only through it. ``check_fill`` is the check before a
fill (keys, meshes, shapes, dtypes), shared by ``load_state_dict`` and checkpoint loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, runtime_checkable

import numpy as np

from .dtensor import DTensor
from .dtypes import check_dtype
from .errors import DTypeMismatchError, MeshMismatchError, ShapeMismatchError, StateDictError


@runtime_checkable
class PendingLoad(Protocol):
    """A checked load: fill ``targets[k]`` from ``values[k]`` for every key, then ``apply()``."""

    @property
    def targets(self) -> Mapping[str, DTensor]: ...

    @property
    def values(self) -> Mapping[str, Any]: ...

    def apply(self) -> None: ...


@runtime_checkable
class Stateful(Protocol):
    """``state_dict()``, ``load_state_dict()`` and the checked two-phase ``prepare_load()``."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> Any: ...

    def prepare_load(self, state_dict: Mapping[str, Any]) -> PendingLoad: ...


_STATEFUL_TYPES: dict[type, bool] = {}


def _stateful_type(cls: type) -> bool:
    known = _STATEFUL_TYPES.get(cls)
    if known is None:
        known = _STATEFUL_TYPES[cls] = all(callable(getattr(cls, name, None))
                                           for name in ("state_dict", "load_state_dict", "prepare_load"))
    return known


def is_stateful(value: Any) -> TypeGuard[Stateful]:
    """``isinstance(value, Stateful)`` decided once per type (its class defines the three methods):
    a checkpoint asks it of every node of its tree, and a runtime protocol check costs tens of
    microseconds each on Python 3.11."""
    return _stateful_type(type(value))


def loads_in_place(obj: Stateful) -> Mapping[str, DTensor] | None:
    """The live DTensors of ``obj`` when its ``state_dict()`` is a flat mapping of them (a
    Module: a load fills them in place, as DCP does); ``None`` when it must be loaded through
    ``prepare_load`` (an Optimizer: its state_dict holds copies of steps and hyperparameters)."""
    state = obj.state_dict()
    if isinstance(state, Mapping) and all(isinstance(v, DTensor) for v in state.values()):
        return state
    return None


def check_fill(targets: Mapping[str, DTensor], values: Mapping[str, Any], strict: bool) -> list[str]:
    """The keys of ``targets`` that ``values`` fills, after checking each value fits its target
    (an array-like of the target's shape and a same-kind castable dtype, or a DTensor on its
    mesh); ``strict`` also requires the same keys. Raises ``StateDictError`` (or the mismatch's
    own error type) naming the key; changes nothing."""
    if not isinstance(values, Mapping):
        raise StateDictError(f"load_state_dict needs a mapping of name -> array, got {type(values).__name__}")
    missing = [k for k in targets if k not in values]
    unexpected = [k for k in values if k not in targets]
    if strict and (missing or unexpected):
        raise StateDictError(
            "state_dict does not match the module: "
            + (f"missing keys {missing}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected keys {unexpected}" if unexpected else "")
            + ". Pass strict=False to load a subset."
        )
    keys = [k for k in targets if k in values]
    for key in keys:
        _check_value(key, targets[key], values[key])
    return keys


def _check_value(key: str, target: DTensor, value: Any) -> None:
    if isinstance(value, DTensor):
        if value.device_mesh != target.device_mesh:
            raise MeshMismatchError(f"{key}: the DTensor value lives on another mesh than the parameter")
    elif not (hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "__getitem__")):
        raise StateDictError(
            f"{key}: value is a {type(value).__name__}, not an array; pass a NumPy/CuPy array, "
            f"an h5py dataset, a memory-mapped array or a DTensor"
        )
    shape = tuple(int(s) for s in value.shape)
    if shape != target.shape:
        raise ShapeMismatchError(f"{key}: value has shape {shape}, the parameter has {target.shape}")
    src = check_dtype(value.dtype)
    if not np.can_cast(src, target.dtype, casting="same_kind"):
        raise DTypeMismatchError(
            f"{key}: cannot load {src} into a {target.dtype} parameter (only same-kind casts, "
            f"e.g. float64 -> float32, are done); cast the value first"
        )


@dataclass
class InPlaceLoad:
    """A checked load whose targets are the live tensors themselves: filling them is the load."""

    targets: dict[str, DTensor] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)

    def apply(self) -> None:
        """Nothing left to install once the targets are filled."""
