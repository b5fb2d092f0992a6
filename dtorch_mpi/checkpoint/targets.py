"""What ``load`` restores: a target's parts matched with a checkpoint's contents.

A target is a ``Stateful`` (dtorch_mpi/stateful.py: a Module, whose parameters are filled in
place, or an Optimizer, loaded through its checked ``prepare_load``), a DTensor, or a mapping of
these (nested, keys joined with ``.`` as in ``save``); any other value in a mutable
mapping is a slot that receives the stored value (a Python scalar or container, NumPy arrays
for tensors). Matching builds a :class:`Restore` without changing anything: the DTensors to
read into (module parameters in place; an optimizer's state tensors new, with their parameters'
current placements) and the commits that install the rest once every read is verified.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..dtensor import DTensor
from ..errors import CheckpointError, StateDictError
from ..stateful import Stateful, is_stateful, loads_in_place
from .reader import read_whole
from .tree import Children, check_members, decode, join, walk
from .validate import Listing


@dataclass
class Parts:
    """A target taken apart by dotted key."""

    tensors: dict[str, DTensor] = field(default_factory=dict)
    optimizers: dict[str, Stateful] = field(default_factory=dict)  # each loaded by prepare_load
    slots: dict[str, tuple[MutableMapping[Any, Any], Any]] = field(default_factory=dict)


@dataclass
class Restore:
    """The DTensors to read (file key -> destination) and what to install after they are verified."""

    tensors: dict[str, DTensor] = field(default_factory=dict)
    commits: list[Callable[[], None]] = field(default_factory=list)


def parts(target: Any) -> Parts:
    """Take ``target`` apart; ``TypeError`` for what cannot be loaded into."""
    found = Parts()

    def visit(value: Any, key: str, holder: MutableMapping[Any, Any] | None, name: Any) -> Children | None:
        if is_stateful(value):
            live = loads_in_place(value)
            if live is None:
                found.optimizers[key] = value
                return None
            return ((str(k), k, p) for k, p in live.items())
        if isinstance(value, DTensor):
            found.tensors[key] = value
        elif isinstance(value, Mapping):
            if _is_live_optimizer_state(value):
                raise CheckpointError(
                    f"load() target {key or 'the root'!r} is an optimizer's state_dict(): its moments are the "
                    f"optimizer's own tensors but its step counts and hyperparameters are copies, so loading into "
                    f"it would restore the moments only; pass the Optimizer itself ({{{key or 'key'!r}: optimizer}}), "
                    f"or load into a slot ({{{key or 'key'!r}: None}}) and call optimizer.load_state_dict() with it")
            return ((str(k), k, v) for k, v in value.items())
        elif holder is not None:
            found.slots[key] = (holder, name)
        else:
            raise TypeError(f"load() target {key or ''}: a {type(value).__name__} cannot be loaded into in place; "
                            f"pass a Module, an Optimizer, DTensors, or a mutable mapping holding it")
        return None

    walk(target, visit)
    return found


def _is_live_optimizer_state(value: Mapping[Any, Any]) -> bool:
    """An optimizer's ``state_dict()`` (keys ``state`` and ``param_groups``) holding DTensors:
    those are the optimizer's live moments, while its steps and hyperparameters are copies."""
    if set(value) != {"state", "param_groups"} or not isinstance(value["state"], Mapping):
        return False
    return any(isinstance(v, DTensor) for entry in value["state"].values() if isinstance(entry, Mapping)
               for v in entry.values())


def match(found: Parts, listing: Listing, path: str, strict: bool) -> Restore:
    """Check the target against the file (keys, optimizer state) and plan the restore."""
    members = check_members(listing.groups, [*listing.tensors, *listing.scalars], path)
    _check_kinds(found, listing, path)
    stored = [*listing.tensors, *listing.scalars]
    present = set(stored) | set(listing.groups)
    wholes = [*found.optimizers, *found.slots]  # each takes the whole subtree at its key
    covered = {k for k in stored if k in found.tensors or any(_under(k, w) for w in wholes)}
    missing = [k for k in [*found.tensors, *wholes] if k not in present]
    unexpected = [k for k in stored if k not in covered]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{path} does not match the target: "
            + (f"missing keys {missing} " if missing else "")
            + (f"unexpected keys {unexpected}" if unexpected else "")
            + "; pass strict=False to load a subset")
    restore = Restore(tensors={k: t for k, t in found.tensors.items() if k in listing.tensors})
    for key, optimizer in found.optimizers.items():
        if key in present:
            _plan_optimizer(restore, key, optimizer, decode(listing, members, key, path, lambda e: e.dataset), path)
    for key, (holder, name) in found.slots.items():
        if key in present:
            value = decode(listing, members, key, path,
                           lambda e: read_whole(e, path, _key_of(e.dataset)))
            restore.commits.append(partial(holder.__setitem__, name, value))
    return restore


def _stored_kind(listing: Listing, key: str) -> str:
    """What the file holds at ``key``, in words (for a kind mismatch)."""
    if key in listing.tensors:
        return "a tensor dataset"
    if key in listing.scalars:
        return f"a Python {listing.scalars[key][1]} (not a tensor)"
    kind = listing.groups.get(key, "")
    return f"a {kind or 'mapping'} group (a container, not a tensor)"


def _check_kinds(found: Parts, listing: Listing, path: str) -> None:
    """A key stored as another kind than the target expects is an error whatever ``strict``
    says (skipping it would leave the target's value standing as if loaded): a tensor target
    needs a tensor dataset, an optimizer a group of its state."""
    wrong = [(key, "a tensor") for key in found.tensors if key in listing.scalars or key in listing.groups]
    wrong += [(key, "an optimizer's state (a group)") for key in found.optimizers
              if key in listing.tensors or key in listing.scalars]
    if wrong:
        raise CheckpointError(f"{path} does not match the target: "
                              + "; ".join(f"{key!r} is {_stored_kind(listing, key)} in the file, the target expects "
                                          f"{want}" for key, want in wrong)
                              + "; nothing was loaded")


def _plan_optimizer(restore: Restore, key: str, optimizer: Stateful, state_dict: Any, path: str) -> None:
    """The optimizer's checked load: its new state tensors join the reads; installing it is a commit."""
    try:
        pending = optimizer.prepare_load(state_dict)
    except StateDictError as exc:
        raise CheckpointError(f"{path}: the optimizer state at {key!r} does not fit the optimizer: {exc}") from exc
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError) as exc:
        raise CheckpointError(f"{path}: the optimizer state at {key!r} is malformed ({type(exc).__name__}: "
                              f"{exc})") from exc
    for name, target in pending.targets.items():
        value = pending.values[name]
        if not _is_dataset(value):
            raise CheckpointError(f"{path}: optimizer state {join(key, 'state.' + name)!r} is not a tensor dataset")
        restore.tensors[_key_of(value)] = target
    restore.commits.append(pending.apply)


def _is_dataset(value: Any) -> bool:
    return hasattr(value, "id") and hasattr(value, "read_direct")


def _under(key: str, root: str) -> bool:
    return not root or key == root or key.startswith(root + ".")


def _key_of(dataset: Any) -> str:
    """The dotted key of a listed dataset (``name`` is its path in the file)."""
    return str(dataset.name)[1:].replace("/", ".")
