"""Optimizer base: param groups, per-parameter state with the parameter's spec, the gradient
placement check, zero_grad, and PyTorch's state_dict layout. Hyperparameters, state and
state_dicts are checked (``checks.py``) before anything changes: a refused ``step()`` or load
leaves every parameter and the state as they were."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from .._mpi import library_world
from ..arrays import array_namespace
from ..autograd.record import mark_changed, optimizer_stepped
from ..dtensor import DTensor
from ..errors import PlacementError, StateDictError
from ..spmd import agreed
from .checks import check_like_parameter, check_state, group_indices, state_index, step_count

ParamsArg = Iterable[DTensor] | Iterable[tuple[str, DTensor]] | Iterable[dict[str, Any]]

_FIX = "call dtorch.nn.utils.reduce_gradients(params) after backward() and before step()"


class Optimizer:
    """Base class. Subclasses name the tensors each parameter's state holds
    (``_state_names(group)``) and implement ``_update(group, param, grad, state, xp)`` on
    local pieces, in place."""

    def __init__(self, params: ParamsArg, defaults: dict[str, Any]) -> None:
        self.defaults = defaults
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[DTensor, dict[str, Any]] = {}
        self._names: dict[int, str] = {}
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(cast(dict[str, Any], group))

    # --- groups ---------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: ``{"params": [...], **hyperparameters}``; missing ones take defaults.
        Parameters may be given as ``(name, param)`` pairs (``module.named_parameters()``):
        errors then name them."""
        group = dict(param_group)
        params = group["params"]
        entries = [params] if isinstance(params, DTensor) else list(params)
        for entry in entries:
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
                self._names[id(entry[1])] = entry[0]
        group["params"] = [e[1] if isinstance(e, tuple) and len(e) == 2 else e for e in entries]
        for p in group["params"]:
            if not isinstance(p, DTensor):
                raise TypeError(f"optimizer parameters must be DTensors, got {type(p).__name__}")
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in group["params"]):
            raise ValueError("a parameter appears in more than one parameter group")
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        self._validate(group)
        self.param_groups.append(group)

    def _validate(self, group: dict[str, Any]) -> None:
        """Raise ValueError for a bad hyperparameter (subclasses check theirs, with
        ``checks.check_hyperparameters``; they may normalise a value in ``group``)."""

    def _label(self, index: int, p: DTensor) -> str:
        """How errors name a parameter: its name when given as ``(name, param)``."""
        return self._names.get(id(p), f"parameter {index}")

    def _indexed(self) -> list[tuple[int, dict[str, Any], DTensor]]:
        """``(index, group, param)`` in PyTorch's state_dict numbering (across groups)."""
        out, i = [], 0
        for group in self.param_groups:
            for p in group["params"]:
                out.append((i, group, p))
                i += 1
        return out

    # --- stepping -------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (``set_to_none``) or fill it with zeros in place."""
        for _, _, p in self._indexed():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.to_local()[...] = 0

    def step(self) -> None:
        """One update of every parameter with a gradient; local on each rank's piece.

        Everything is checked before the first update (hyperparameters, which a scheduler may
        have changed in place; every gradient; every existing state, whose tensors must still
        have their parameter's placements): a refused step changes nothing."""
        for group in self.param_groups:
            self._validate(group)
        work = []
        for index, group, p in self._indexed():
            if p.grad is not None:
                label = self._label(index, p)
                _check_grad(label, p, p.grad)
                state = self.state.get(p)
                if state is not None:
                    check_state(label, p, state, self._state_names(group))
                work.append((group, p))
        for group, p in work:
            xp = array_namespace(p.device_mesh.device_type)
            state = self.state.get(p)
            if state is None:
                state = self.state[p] = self._init_state(group, p, xp)
            self._update(group, p.to_local(), p.grad.to_local(), state, xp)  # type: ignore[union-attr]
            mark_changed(p)  # a backward through an older graph refuses; fully_shard gathers again
        optimizer_stepped([p for _, p in work])  # fully_shard prefetches its next forward's first gather

    def _init_state(self, group: dict[str, Any], p: DTensor, xp: Any) -> dict[str, Any]:
        state: dict[str, Any] = {"step": 0}
        for name in self._state_names(group):
            state[name] = DTensor(xp.zeros(p.spec.local_shape, dtype=p.dtype), p.spec)
        return state

    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state tensors (each with its parameter's spec) a parameter of ``group`` has."""
        raise NotImplementedError

    def _update(self, group: dict[str, Any], param: Any, grad: Any, state: dict[str, Any], xp: Any) -> None:
        raise NotImplementedError

    # --- state_dict -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {name: DTensor | int}}, "param_groups": [{..., "params": [index]}]}``,
        PyTorch's layout. State tensors are the live DTensors (their parameter's placements)."""
        index_of = {id(p): i for i, _, p in self._indexed()}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index_of[id(p)] for p in group["params"]]
            groups.append(packed)
        state = {index_of[id(p)]: dict(s) for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore hyperparameters and state. State tensors may be DTensors on the parameter's
        mesh (redistributed to its placements when they differ) or complete arrays (each rank
        keeps its piece); values are checked on every rank before anything changes, and a
        refusal on any rank (e.g. a state_dict that differs between ranks) raises on every rank
        (agreed over the library's world, as ``load_into`` agrees its checks)."""
        from ..nn.module import Parameter
        from ..nn.state import load_into

        with agreed(library_world()):
            pending = self.prepare_load(state_dict)
        load_into(cast(dict[str, Parameter], pending.targets), pending.values)
        pending.apply()

    def prepare_load(self, state_dict: Mapping[str, Any]) -> PendingLoad:
        """Check ``state_dict`` and build the new groups and state without changing anything:
        each state tensor is a new zero DTensor with its parameter's current spec (``targets``,
        by ``"index.name"``) to be filled from ``values`` (the state_dict's tensors, any object
        with a ``shape``) before ``apply()``. ``dtorch.load`` fills them from a checkpoint."""
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"state", "param_groups"}:
            raise StateDictError('an optimizer state_dict is a mapping with keys "state" and "param_groups"')
        saved_groups, saved_states = state_dict["param_groups"], state_dict["state"]
        if isinstance(saved_groups, (Mapping, str)) or not isinstance(saved_groups, Iterable):
            raise StateDictError(f"the state_dict's param_groups is a {type(saved_groups).__name__}, not a list")
        if not isinstance(saved_states, Mapping):
            raise StateDictError(f"the state_dict's state is a {type(saved_states).__name__}, not a mapping")
        saved_groups = list(saved_groups)
        indices = [group_indices(s, f"the state_dict's param_groups[{k}]") for k, s in enumerate(saved_groups)]
        if len(saved_groups) != len(self.param_groups) or any(
                len(i) != len(g["params"]) for i, g in zip(indices, self.param_groups)):
            raise StateDictError(
                "the state_dict's parameter groups do not match this optimizer's: saved sizes "
                f"{[len(i) for i in indices]}, here {[len(g['params']) for g in self.param_groups]}")
        flat = [i for group_ix in indices for i in group_ix]
        if len(set(flat)) != len(flat):
            raise StateDictError(f"the state_dict's param_groups name a parameter index twice: {flat}")
        new_groups = [{**group, **{k: copy.deepcopy(v) for k, v in saved.items() if k != "params"}}
                      for saved, group in zip(saved_groups, self.param_groups)]
        for k, group in enumerate(new_groups):
            try:
                self._validate(group)
            except ValueError as exc:  # a malformed value, not a layout that does not fit: ValueError
                raise ValueError(f"the state_dict's param_groups[{k}]: {exc}") from exc
        owner: dict[int, tuple[dict[str, Any], DTensor]] = {}
        for group_ix, group in zip(indices, new_groups):
            owner.update((i, (group, p)) for i, p in zip(group_ix, group["params"]))
        pending = PendingLoad(self, new_groups)
        for key_, saved_state in saved_states.items():
            index = state_index(key_)  # a checkpoint may give the indices back as strings
            if index not in owner:
                raise StateDictError(f"state for parameter {index}, which no group holds")
            group, p = owner[index]
            if p in pending.state:
                raise StateDictError(f"the state_dict holds parameter {index}'s state twice")
            label = self._label(index, p)
            pending.state[p] = self._checked_entry(label, index, group, p, saved_state, pending)
        return pending

    def _checked_entry(self, label: str, index: int, group: dict[str, Any], p: DTensor, saved: Any,
                       pending: PendingLoad) -> dict[str, Any]:
        """One parameter's loaded state: exactly ``step`` (a count) and the group's state
        tensors, each a new zero DTensor with ``p``'s spec to be filled from the saved value."""
        names = self._state_names(group)
        if not isinstance(saved, Mapping):
            raise StateDictError(f"state of {label} is a {type(saved).__name__}, not a mapping")
        unexpected, missing = set(saved) - {"step", *names}, {"step", *names} - set(saved)
        if unexpected or missing:
            raise StateDictError(
                f"state of {label} has entries {sorted(map(str, saved))}; this optimizer's state (for its "
                f"hyperparameters) holds exactly {sorted(['step', *names])}"
                + (f": unexpected {sorted(map(str, unexpected))}" if unexpected else "")
                + (f": lacks {sorted(missing)}" if missing else ""))
        entry: dict[str, Any] = {"step": step_count(label, saved["step"])}
        xp = array_namespace(p.device_mesh.device_type)
        for name in names:
            value = saved[name]  # its kind and shape are checked by whoever fills the target
            key = f"{index}.{name}"
            entry[name] = pending.targets[key] = DTensor(xp.zeros(p.spec.local_shape, dtype=p.dtype), p.spec)
            pending.values[key] = value
        return entry

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {v}" for k, v in sorted(group.items()) if k != "params"]
        return "\n".join(lines) + "\n)"


@dataclass
class PendingLoad:
    """A checked optimizer load: new groups and state whose tensors (``targets``) are filled from
    ``values`` by the caller; ``apply()`` then installs them (it cannot fail)."""

    optimizer: Optimizer
    groups: list[dict[str, Any]]
    state: dict[DTensor, dict[str, Any]] = field(default_factory=dict)
    targets: dict[str, DTensor] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)

    def apply(self) -> None:
        self.optimizer.param_groups = self.groups
        self.optimizer.state = self.state


_GRAD_SAYS = {
    "device_mesh": "{what}: its gradient lives on another mesh ({t.device_mesh!r})",
    "shape": "{what}: its gradient has shape {t.shape}",
    "placements": "{what}: its gradient has placements {placements}; step() moves no data, so gradients must "
                  "have their parameters' placements: " + _FIX,
    "dtype": "{what} is {p.dtype}: its gradient is {t.dtype}; cast the gradient",
}


def _check_grad(label: str, p: DTensor, g: DTensor) -> None:
    """A gradient must match its parameter's spec (metadata only: the same verdict everywhere)."""
    name = f"{label} ({list(p.placements)}, shape {p.shape})"
    if any(pl.is_partial() for pl in p.placements):
        raise PlacementError(
            f"{name} is Partial: an optimizer update is not local on Partial terms; "
            f"redistribute the parameter to Replicate() or Shard() before optimizing it")
    if not isinstance(g, DTensor):
        raise TypeError(f"{name}: .grad is a {type(g).__name__}, not a DTensor")
    check_like_parameter(name, p, g, _GRAD_SAYS)
