"""The early stop of activation checkpointing's recompute: operations whose result nothing in
backward needs are recorded without being computed.

Backward through a recomputed function needs what its nodes saved, not every value the
function made: in a block ``x + fc2(h)`` the last matmul saves ``h`` and the weight, and
neither its result nor the two additions' results are read by any backward. PyTorch's
non-reentrant checkpoint stops recomputing once every saved tensor is back
(``torch.utils.checkpoint.set_checkpoint_early_stop``); here the recompute still records those
operations, so the graph is the forward's, but their kernels are skipped and their results are
zeros of the forward's local shape and dtype.

:func:`plan` decides from what the forward recorded (each node's edges and what its backward
saves, nodes in recording order) which nodes may be skipped: a node whose backward keeps its
own output never; otherwise one whose every consumer among the recorded nodes is skipped too and
keeps no input (so a zero result is never saved, nor computed from), and only when no node
recorded after the first skipped one is computed from, or keeps, a tensor operand no edge
describes: a value an unrecorded operation made (``t.detach() * 2``), which could come from a
zero result (scalar operands are constants). A node whose
recorder did not say what it saves (a redistribute, an embedding, a loss) is computed, and so
are its producers. :func:`stand_in` is asked by every operator before its kernel runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .graph import Node, Saves


@dataclass
class Recorded:
    """One node a function recorded: the node, what its backward keeps, its local result's
    shape and dtype, and its operands' shapes (what a recompute's operation must match)."""

    node: Node
    saves: Saves
    shape: tuple[int, ...]
    dtype: Any
    operands: tuple[Any, ...]


@dataclass(frozen=True)
class Skip:
    """What a recompute needs of a node it skips (never the node: it holds the forward's saved
    values, which checkpointing frees): its name, result's shape and dtype, operands' shapes."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    operands: tuple[Any, ...]


@dataclass
class Plan:
    """A recompute's skips (recording index -> what the forward recorded there) and ``count``,
    the nodes the recompute has recorded so far."""

    skip: dict[int, Skip]
    count: int = 0


ACTIVE: Plan | None = None
"""The plan of the recompute running now (None outside one)."""


def operand_shapes(operands: Sequence[Any]) -> tuple[Any, ...]:
    """Each operand's global shape; None for a scalar (a constant, never a computed value)."""
    return tuple(t.shape if hasattr(t, "_spec") else None for t in operands)


def plan(recorded: Sequence[Recorded]) -> dict[int, Skip]:
    """The recording indices a recompute of the function that recorded ``recorded`` may skip
    (module docstring), with their records."""
    index = {id(r.node): i for i, r in enumerate(recorded)}
    consumers: list[list[int]] = [[] for _ in recorded]
    for j, r in enumerate(recorded):
        for e in r.node.next:
            if e is not None and id(e) in index:
                consumers[index[id(e)]].append(j)
    skip: set[int] = set()
    for i in range(len(recorded) - 1, -1, -1):
        saves = recorded[i].saves
        if saves is None or saves[1]:
            continue
        if all(j in skip and not _keeps_inputs(recorded[j]) for j in consumers[i]):
            skip.add(i)
    if skip:  # a tensor no edge describes, used after the first skip, could come from a zero result
        first = min(skip)
        for j in range(first + 1, len(recorded)):
            r = recorded[j]
            unknown = any(e is None and shape is not None for e, shape in zip(r.node.next, r.operands))
            if unknown and (j not in skip or _keeps_inputs(r)):
                return {}
    return {i: Skip(r.node.name, r.shape, r.dtype, r.operands) for i in sorted(skip) for r in [recorded[i]]}


def _keeps_inputs(r: Recorded) -> bool:
    return r.saves is None or r.saves[0]


def stand_in(name: str, operands: Sequence[Any], xp: Any) -> Any:
    """For the operation ``name`` on ``operands``, about to be recorded (the caller checked) as
    the next node of the recompute running now: a kernel returning zeros of the forward's result
    where that node is skipped (the same name and operand shapes as the forward recorded there),
    else None (run the real kernel)."""
    active = ACTIVE
    assert active is not None
    r = active.skip.get(active.count)
    if r is None or r.name != name or r.operands != operand_shapes(operands):
        return None
    shape, dtype = r.shape, r.dtype
    return lambda *args, **kwargs: xp.zeros(shape, dtype)
