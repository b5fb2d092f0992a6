"""The recorded graph and the engine that replays it backward.

A ``Node`` is one recorded operation: ``backward(grad_out)`` maps the gradient of its output
(a DTensor) to the gradients of its inputs, one per edge. Edges point at the producers'
nodes, or at an ``AccumulateGrad`` for a leaf, never at the input tensors themselves, so an
intermediate result's piece is kept alive only when a backward kernel saved it.

Every rank records the same graph (SPMD), and the engine visits nodes in reverse creation
order, so every rank runs the same backward collectives in the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .accumulate import accumulate
from .grad_mode import no_grad

if TYPE_CHECKING:
    from ..dtensor import DTensor

_sequence = itertools.count()

BackwardFn = Callable[["DTensor"], Sequence["DTensor | None"]]


class Node:
    """One recorded operation: its name, backward function and input edges."""

    __slots__ = ("name", "next", "_backward", "seq")

    def __init__(self, name: str, next_nodes: tuple[Node | None, ...], backward: BackwardFn) -> None:
        self.name = name
        self.next = next_nodes
        self._backward: BackwardFn | None = backward
        self.seq = next(_sequence)

    def apply(self, grad: "DTensor", retain_graph: bool) -> Sequence["DTensor | None"]:
        fn = self._backward
        if fn is None:
            raise RuntimeError(
                f"backward through {self.name} a second time: its saved values were freed by the "
                f"first backward; pass retain_graph=True to the first backward() to keep them"
            )
        if not retain_graph:
            self._backward = None
        return fn(grad)

    def __repr__(self) -> str:
        return f"<{self.name}Backward>"


class AccumulateGrad(Node):
    """The edge into a leaf: adds incoming gradients to ``leaf.grad``."""

    __slots__ = ("leaf",)

    def __init__(self, leaf: "DTensor") -> None:
        super().__init__("AccumulateGrad", (), lambda g: ())
        self.leaf = leaf

    def apply(self, grad: "DTensor", retain_graph: bool) -> Sequence["DTensor | None"]:
        leaf = self.leaf
        if leaf.grad is None:
            # the leaf's own writable, C-ordered array: a backward kernel may hand the same
            # buffer to several inputs (add), or a read-only broadcast view (sum), and
            # optimizers and clip_grad_norm_ update .grad in place
            leaf.grad = type(grad)(grad.to_local().copy(order="C"), grad.spec)
        else:
            leaf.grad = accumulate(leaf.grad, grad)
        return ()


def edge(t: Any) -> Node | None:
    """The graph edge into ``t``: its producer node, its leaf accumulator, or None."""
    if not getattr(t, "_requires_grad", False):
        return None
    if t._grad_fn is not None:
        return t._grad_fn
    acc = getattr(t, "_grad_acc", None)  # one per leaf: its contributions sum before .grad
    if acc is None:
        acc = t._grad_acc = AccumulateGrad(t)
    return acc


def attach(out: "DTensor", name: str, inputs: Sequence[Any], backward: BackwardFn) -> "DTensor":
    """Make ``out`` the result of a recorded op over ``inputs`` (when any requires grad)."""
    edges = tuple(edge(t) for t in inputs)
    if any(e is not None for e in edges):
        out._grad_fn = Node(name, edges, backward)
        out._requires_grad = True
    return out


def run_backward(root: "DTensor", grad: "DTensor", retain_graph: bool = False) -> None:
    """Propagate ``grad`` (d loss / d root) to every leaf that requires grad.

    Nodes run in reverse creation order (a topological order that is the same on every rank);
    a node runs once all its consumers have contributed to its gradient.
    """
    start = edge(root)
    if start is None:
        raise RuntimeError(
            "backward(): the tensor does not require grad and has no grad_fn; mark a leaf with "
            "requires_grad=True (or requires_grad_()) before computing it"
        )
    reachable: dict[int, Node] = {}
    stack = [start]
    while stack:
        node = stack.pop()
        if id(node) in reachable:
            continue
        reachable[id(node)] = node
        stack.extend(n for n in node.next if n is not None)
    pending: dict[int, DTensor] = {id(start): grad}
    with no_grad():
        for node in sorted(reachable.values(), key=lambda n: n.seq, reverse=True):
            g = pending.pop(id(node), None)
            if g is None:
                continue  # reachable only through inputs that got no gradient
            grads = node.apply(g, retain_graph)
            for nxt, gi in zip(node.next, grads):
                if nxt is None or gi is None:
                    continue
                prev = pending.get(id(nxt))
                pending[id(nxt)] = gi if prev is None else accumulate(prev, gi)
