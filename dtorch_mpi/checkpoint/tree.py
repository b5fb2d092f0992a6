"""Nested training state <-> HDF5 groups and datasets.

``save`` flattens a nested mapping into leaves keyed by dotted paths (a mapping key ``a`` holding
``{"b.c": x}`` gives ``a.b.c``, the dataset ``/a/b/c``): DTensors, complete NumPy arrays, and
Python scalars (pytypes.py); a ``Stateful`` (a Module, an Optimizer) stands for its ``state_dict()``. Keys are
``str`` (non-empty words, no ``/`` or NUL; ``.`` separates groups) or ``int`` (not both in one mapping).
``walk`` is the one traversal of such a tree, shared by ``save`` (``flatten``) and ``load``
(targets.py). ``load`` rebuilds any subtree from a file's listing, with each tensor dataset left as its
validated :class:`~.validate.Entry` for the caller to read where it belongs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dtensor import DTensor
from ..errors import CheckpointError
from ..stateful import is_stateful
from . import pytypes
from .validate import Entry, Listing


@dataclass(frozen=True)
class Leaf:
    """One dataset to write: a DTensor, or a complete array (with its ``pytype`` for a scalar)."""

    key: str
    value: Any
    pytype: str | None = None


@dataclass
class Layout:
    """What ``save`` writes: leaves and groups (group key -> its ``pytype``, "" for str keys)."""

    leaves: list[Leaf] = field(default_factory=list)
    groups: dict[str, str] = field(default_factory=dict)


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _name(key: Any, where: str) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise CheckpointError(f"{where or 'the root'}: key {key!r} is a {type(key).__name__}; keys are str or int")
    name = str(key)
    if not name or "/" in name or "\0" in name or any(not part for part in name.split(".")):
        raise CheckpointError(f"state_dict key {join(where, name)!r} cannot be a dataset name (dotted words only, "
                              f"no '/', no NUL character (HDF5 would store the name cut there), no empty word)")
    return name


Children = Iterable[tuple[str, Any, Any]]
"""What a visitor descends into: (name in the dotted key, the container's own key, value)."""


def walk(root: Any, visit: Callable[[Any, str, MutableMapping[Any, Any] | None, Any], Children | None]) -> None:
    """Depth first: ``visit(value, key, holder, name)`` handles one value (``holder[name]`` is
    where it sits, when that is a mutable mapping) and returns the children to descend into
    (``None`` for a leaf). A stack of the open containers' children rather than a recursive
    closure, which would be a reference cycle: every save and load left it (and what its frames
    held) to the cycle collector."""
    pending: list[Iterator[tuple[Any, str, MutableMapping[Any, Any] | None, Any]]] = [
        iter([(root, "", None, None)])]
    while pending:
        item = next(pending[-1], None)
        if item is None:
            pending.pop()
            continue
        value, key, holder, name = item
        children = visit(value, key, holder, name)
        if children is not None:
            pending.append(_below(value, key, children))


def _below(value: Any, key: str, children: Children) -> Iterator[tuple[Any, str, MutableMapping[Any, Any] | None, Any]]:
    """``walk``'s items for ``value``'s children (lazily: a visitor's errors come in visiting order)."""
    parent = value if isinstance(value, MutableMapping) else None
    for label, own_key, child in children:
        yield child, join(key, label), parent, own_key


def flatten(obj: Mapping[Any, Any]) -> Layout:
    """The leaves and groups of ``obj``; raises ``CheckpointError`` naming any value or key it cannot store."""
    layout = Layout()

    def visit(value: Any, key: str, *_where: Any) -> Children | None:
        if is_stateful(value):
            value = value.state_dict()
        encoded = pytypes.encode(value, key)
        if encoded is not None:
            layout.leaves.append(Leaf(key, *encoded))
        elif isinstance(value, (DTensor, np.ndarray, np.generic)):
            layout.leaves.append(Leaf(key, value))
        elif isinstance(value, Mapping):
            kinds = {type(k) for k in value}
            if len(kinds) > 1:
                raise CheckpointError(f"{key or 'the root'}: a mapping mixes key types {sorted(k.__name__ for k in kinds)}"
                                      f"; use str or int keys")
            layout.groups[key] = "dict[int]" if kinds == {int} else ""
            return ((_name(k, key), k, v) for k, v in value.items())  # lazily: errors in visiting order
        elif type(value) in (list, tuple):
            layout.groups[key] = type(value).__name__
            return ((str(i), i, v) for i, v in enumerate(value))
        else:
            raise CheckpointError(f"{key or 'the root'}: cannot save a {type(value).__name__}; save() takes nested "
                                  f"mappings of DTensors, NumPy arrays and Python scalars (int, float, bool, str, "
                                  f"None, lists and tuples of them)")
        return None

    try:
        walk(obj, visit)
    except UnicodeEncodeError as exc:
        raise CheckpointError(f"a str cannot be stored as UTF-8 ({exc})") from exc
    keys = [leaf.key for leaf in layout.leaves]
    for key in [*keys, *layout.groups]:  # a dotted str key's implicit groups are plain mappings
        while key:
            key = key.rpartition(".")[0]
            layout.groups.setdefault(key, "")
    check_members(layout.groups, keys, "save()")
    return layout


def check_members(groups: Mapping[str, str], leaves: list[str], where: str) -> dict[str, list[str]]:
    """Each group's member names, checked against its type: every key names one value (not two,
    not a value and a group), ``dict[int]`` members are canonical integers, list/tuple members
    are ``0 .. n-1``. Every key's parent must be a group."""
    members: dict[str, list[str]] = {key: [] for key in groups}
    seen: set[str] = set()
    for key in leaves:
        if key in seen or key in groups:
            raise CheckpointError(f"{where}: key {key!r} names two values (dotted keys and nesting collide)")
        seen.add(key)
    for key in [*leaves, *groups]:
        if key:
            parent, _, name = key.rpartition(".")
            members[parent].append(name)
    for key, kind in groups.items():
        names = members[key]
        if kind in ("list", "tuple") and set(names) != {str(i) for i in range(len(names))}:
            raise CheckpointError(f"{where}: {kind} group {key!r} must hold members 0..{len(names) - 1}, has {names}")
        if kind == "dict[int]" and any(_index(n) is None for n in names):
            raise CheckpointError(f"{where}: dict[int] group {key!r} has non-integer member names {names}")
    return members


def _index(name: str) -> Any:
    try:
        value = int(name)
    except ValueError:
        return None
    return value if str(value) == name else None


def decode(listing: Listing, members: Mapping[str, list[str]], key: str, path: str,
           tensor: Callable[[Entry], Any]) -> Any:
    """The Python value of the subtree at ``key``: scalars read and verified, containers with
    their types, each tensor dataset given to ``tensor``."""
    from .reader import read_whole

    if key in listing.tensors:
        return tensor(listing.tensors[key])
    if key in listing.scalars:
        entry, pytype = listing.scalars[key]
        return pytypes.decode(pytype, read_whole(entry, path, key), f"{path}: dataset /{key.replace('.', '/')}")
    kind = listing.groups[key]
    children = {name: decode(listing, members, join(key, name), path, tensor) for name in members[key]}
    if kind in ("list", "tuple"):
        return (list if kind == "list" else tuple)(children[str(i)] for i in range(len(children)))
    if kind == "dict[int]":
        return {int(name): children[name] for name in sorted(children, key=int)}
    return children
