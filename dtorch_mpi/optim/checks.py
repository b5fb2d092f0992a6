"""What an optimizer checks before it changes anything: hyperparameters (PyTorch's ranges, plus
NaN/inf and types, which PyTorch lets through to a NaN model), a parameter's state (its ``step``
count; its tensors still have the parameter's mesh, placements, shape and dtype), and a
state_dict's layout. Every verdict is a function of metadata every rank shares, so every rank
raises the same error; none touches a parameter, a gradient or the state.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtensor import DTensor
from ..errors import DTypeMismatchError, MeshMismatchError, PlacementError, ShapeMismatchError, StateDictError


@dataclass(frozen=True)
class Range:
    """A real, finite hyperparameter in ``[low, high]`` (``[low, high)`` with ``open_high``)."""

    low: float = 0.0
    high: float = math.inf
    open_high: bool = False

    def describe(self) -> str:
        if self.high == math.inf:
            return f">= {self.low:g}"
        return f"in [{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"

    def holds(self, value: float) -> bool:
        return self.low <= value and (value < self.high if self.open_high else value <= self.high)


ANY_FINITE = Range(-math.inf)
NON_NEGATIVE = Range(0.0)
BETA = Range(0.0, 1.0, open_high=True)


def is_real(value: Any) -> bool:
    """A Python or NumPy real number (bools are flags, not numbers)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_real(owner: str, key: str, value: Any, rule: Range) -> None:
    if not is_real(value):
        raise ValueError(f"{owner}: invalid {key} {value!r}: a real number {rule.describe()} (got "
                         f"{type(value).__name__})")
    if not math.isfinite(value) or not rule.holds(value):
        raise ValueError(f"{owner}: invalid {key} {value!r} (must be finite and {rule.describe()})")


def check_flag(owner: str, key: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{owner}: invalid {key} {value!r} (must be True or False)")


def check_betas(owner: str, group: dict[str, Any]) -> None:
    """``betas``: two coefficients in [0, 1); normalised to a tuple of floats in ``group``."""
    betas = group["betas"]
    if isinstance(betas, np.ndarray):
        betas = betas.tolist()
    if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
        raise ValueError(f"{owner}: invalid betas {betas!r} (must be a pair (beta1, beta2), each in [0, 1))")
    for i, beta in enumerate(betas):
        check_real(owner, f"beta parameter at index {i}", beta, BETA)
    group["betas"] = (float(betas[0]), float(betas[1]))


def check_hyperparameters(owner: str, group: dict[str, Any], reals: Mapping[str, Range],
                          flags: Sequence[str]) -> None:
    """Every hyperparameter of ``reals`` and ``flags`` present and valid in ``group``."""
    for key, rule in reals.items():
        if key not in group:
            raise ValueError(f"{owner}: the parameter group lacks {key!r}")
        check_real(owner, key, group[key], rule)
    for key in flags:
        if key not in group:
            raise ValueError(f"{owner}: the parameter group lacks {key!r}")
        check_flag(owner, key, group[key])


def step_count(label: str, value: Any) -> int:
    """A state's ``step``: a whole number >= 0 (an int, or a float holding one, as PyTorch's
    float step tensors convert); anything else would poison the bias correction."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    elif isinstance(value, DTensor) or (hasattr(value, "shape") and not isinstance(value, np.generic)):
        raise StateDictError(f"{label}: its state has an unexpected tensor 'step' ({type(value).__name__}); "
                             f"the step is a count (a whole number >= 0)")
    whole = (isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))) or (
        is_real(value) and math.isfinite(value) and float(value).is_integer())
    if not whole or value < 0:
        raise StateDictError(f"{label}: its state's step is {value!r}; it must be a whole number >= 0 "
                             f"(how many updates the state holds)")
    return int(value)


def check_state(label: str, p: DTensor, state: Mapping[str, Any], names: Sequence[str]) -> None:
    """Before a step: ``state`` holds a valid ``step`` and every tensor in ``names`` with
    ``p``'s spec. A parameter re-placed after its state was made (``parallelize_module`` after
    the optimizer was built) is refused here, before any parameter is updated."""
    step_count(label, state.get("step"))
    for name in names:
        t = state.get(name)
        if not isinstance(t, DTensor):
            raise StateDictError(
                f"{label}: its optimizer state lacks the tensor {name!r} (got {type(t).__name__}): was a "
                f"hyperparameter that needs it (amsgrad, momentum) turned on after the state was made? "
                f"Load a state_dict that has it, or build the optimizer with it")
        _check_state_tensor(label, p, name, t)


_REHOME = ("re-home the state with opt.load_state_dict(opt.state_dict()) (it redistributes every state "
           "tensor to its parameter's current placements), or build the optimizer after parallelize_module")


# What a parameter's companion tensor (its gradient, an optimizer state tensor) shares with it,
# in the order checked: step() updates pieces in place, so the pieces must line up one to one.
_LIKE_PARAMETER = (
    ("device_mesh", MeshMismatchError),
    ("shape", ShapeMismatchError),
    ("placements", PlacementError),
    ("dtype", DTypeMismatchError),
)


def check_like_parameter(what: str, p: DTensor, t: DTensor, says: Mapping[str, str]) -> None:
    """``t`` has ``p``'s mesh, shape, placements and dtype; the first that differs raises its
    error with the message ``says[attribute]``, a template formatted with ``what``, ``p``, ``t``
    and ``placements`` (``t``'s, as a list). One order and one error class per attribute for
    every caller (metadata only: every rank gives the same verdict)."""
    for attribute, error in _LIKE_PARAMETER:
        if getattr(t, attribute) != getattr(p, attribute):
            raise error(says[attribute].format(what=what, p=p, t=t, placements=list(t.placements)))


_STATE_SAYS = {
    "device_mesh": "{what} lives on another mesh ({t.device_mesh!r}); load the state onto the parameter's "
                   "mesh (opt.load_state_dict with complete arrays)",
    "shape": "{what} has shape {t.shape}; the state belongs to another parameter",
    "placements": "{what} has placements {placements}: the parameter was re-placed after its state was made, "
                  "and step() moves no data; " + _REHOME,
    "dtype": "{what} is {t.dtype}, the parameter {p.dtype}; " + _REHOME,
}


def _check_state_tensor(label: str, p: DTensor, name: str, t: DTensor) -> None:
    check_like_parameter(f"{label} ({list(p.placements)}, shape {p.shape}): its optimizer state {name!r}",
                         p, t, _STATE_SAYS)


def state_index(key: Any) -> int:
    """A state_dict's parameter index: an int, or its decimal text (a checkpoint's key)."""
    if isinstance(key, (bool, np.bool_)):
        raise StateDictError(f"optimizer state key {key!r} is not a parameter index")
    if isinstance(key, numbers.Integral):
        return int(key)
    if isinstance(key, str) and key.isdigit():
        return int(key)
    raise StateDictError(f"optimizer state key {key!r} is not a parameter index (an int >= 0)")


def group_indices(saved: Any, where: str) -> list[int]:
    """A saved group's ``params``: parameter indices (ints >= 0)."""
    if not isinstance(saved, Mapping) or "params" not in saved:
        raise StateDictError(f"{where} is not a mapping with a 'params' list")
    params = saved["params"]
    if isinstance(params, np.ndarray):
        params = params.tolist()
    if not isinstance(params, Sequence) or isinstance(params, str):
        raise StateDictError(f"{where}'s params is {type(params).__name__}, not a list of parameter indices")
    out = []
    for i in params:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, numbers.Integral) or i < 0:
            raise StateDictError(f"{where}'s params holds {i!r}, not a parameter index (an int >= 0)")
        out.append(int(i))
    return out
