"""The recorded graph and the engine that replays it backward.

A ``Node`` is one recorded operation: ``backward(grad_out)`` maps the gradient of its output
(a DTensor) to the gradients of its inputs, one per edge. Edges point at the producers'
nodes, or at an ``AccumulateGrad`` for a leaf, never at the input tensors themselves, so an
intermediate result's piece is kept alive only when a backward kernel saved it.

Every rank records the same graph (SPMD), and the engine runs nodes in reverse creation
order, so every rank runs the same backward collectives in the same order. A leaf's
accumulator runs as soon as its last contribution arrived (its gradient is complete then),
not at its place in that order: accumulators of leaves made long ago would otherwise all wait
for the end of backward.

Hooks (docs/autograd.md "Hooks"), the points that sharded data parallel (``fully_shard``) and
bucketed gradient reduction build on; each is called at the same point on every rank:

- ``register_hook(t, fn)``: ``fn(grad)`` when the gradient with respect to ``t`` is complete,
  before it flows into the operation that produced ``t`` (a *pre-backward* point: a hook on a
  module's outputs runs before any of the module's backward);
- ``register_post_accumulate_grad_hook(leaf, fn)``: ``fn(leaf)`` once ``leaf.grad`` holds this
  backward's whole contribution (a *gradient complete* point);
- ``queue_callback(fn)``: ``fn()`` when the running backward has visited every node (a
  *backward finished* point).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import timeline as _trace
from ..grad_mode import no_grad
from .accumulate import accumulate

if TYPE_CHECKING:
    from ..dtensor import DTensor

_sequence = itertools.count()

BackwardFn = Callable[["DTensor"], Sequence["DTensor | None"]]
GradHook = Callable[["DTensor"], "DTensor | None"]
LeafHook = Callable[["DTensor"], None]
_hook_ids = itertools.count()


class RemovableHandle:
    """What a ``register_*`` call returns: ``remove()`` unregisters the hook (idempotent)."""

    __slots__ = ("_hooks", "_key")

    def __init__(self, hooks: dict[int, Any], key: int) -> None:
        self._hooks, self._key = hooks, key

    def remove(self) -> None:
        self._hooks.pop(self._key, None)


def _add_hook(hooks: dict[int, Any], fn: Any) -> RemovableHandle:
    if not callable(fn):
        raise TypeError(f"a hook must be callable, got {type(fn).__name__}")
    key = next(_hook_ids)
    hooks[key] = fn
    return RemovableHandle(hooks, key)


class Node:
    """One recorded operation: its name, backward function and input edges.

    ``pre_hooks`` (None until one is registered): called in registration order with the
    node's complete output gradient before ``apply``; a hook may return a replacement.
    ``fresh_outputs``: every array its backward returns is new or derived from the incoming
    gradient (``_owned``); a node that runs other nodes inside, whose hooks the engine does not
    see (a checkpoint's recompute), says no, and its outputs are never kept uncopied."""

    __slots__ = ("name", "next", "_backward", "seq", "pre_hooks")
    fresh_outputs = True

    def __init__(self, name: str, next_nodes: tuple[Node | None, ...], backward: BackwardFn) -> None:
        self.name = name
        self.next = next_nodes
        self._backward: BackwardFn | None = backward
        self.seq = next(_sequence)
        self.pre_hooks: dict[int, GradHook] | None = None

    def register_prehook(self, fn: GradHook) -> RemovableHandle:
        """Run ``fn(grad)`` before this node's backward (see ``register_hook``)."""
        hooks = getattr(self, "pre_hooks", None)
        if hooks is None:
            hooks = self.pre_hooks = {}
        return _add_hook(hooks, fn)

    def apply(self, grad: "DTensor", retain_graph: bool, owned: bool = False) -> Sequence["DTensor | None"]:
        """The gradients of the inputs (``owned`` matters to an accumulator only)."""
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
    """The edge into a leaf: adds incoming gradients to ``leaf.grad``; then runs its
    ``post_hooks`` (the leaf's gradient is complete for this backward)."""

    __slots__ = ("leaf", "post_hooks")

    def __init__(self, leaf: "DTensor") -> None:
        super().__init__("AccumulateGrad", (), lambda g: ())
        self.leaf = leaf
        self.post_hooks: dict[int, LeafHook] = {}

    def apply(self, grad: "DTensor", retain_graph: bool, owned: bool = False) -> Sequence["DTensor | None"]:
        leaf = self.leaf
        if leaf.grad is None:
            # the leaf's own writable, C-ordered array (optimizers and clip_grad_norm_ update
            # .grad in place): ``grad``'s own when C-ordered and the engine knows nothing else
            # refers to it (``owned``: see ``_owned``), else a copy (a backward kernel may hand
            # the same buffer to several inputs (add), or a read-only broadcast view (sum))
            local = grad.to_local()
            keep = owned and local.flags.c_contiguous
            leaf.grad = type(grad)(local if keep else local.copy(order="C"), grad.spec)
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


Saves = tuple[bool, bool] | None
"""What a node's backward keeps: (its inputs, its output); None where the recorder did not say."""

Observer = Callable[[Node, "DTensor", Saves, Sequence[Any]], None]
_observer: Observer | None = None


def observe(observer: Observer | None) -> Observer | None:
    """Call ``observer(node, out, saves, inputs)`` for every node recorded from now on (None: stop);
    returns the observer it replaces. Activation checkpointing watches what its function
    records (nn/checkpoint.py)."""
    global _observer
    previous, _observer = _observer, observer
    return previous


def attach(out: "DTensor", name: str, inputs: Sequence[Any], backward: BackwardFn,
           saves: Saves = None) -> "DTensor":
    """Make ``out`` the result of a recorded op over ``inputs`` (when any requires grad);
    ``saves``: what ``backward`` keeps (an observer's business only)."""
    edges = tuple(edge(t) for t in inputs)
    if any(e is not None for e in edges):
        node = out._grad_fn = Node(name, edges, backward)
        out._requires_grad = True
        if _observer is not None:
            _observer(node, out, saves, inputs)
    return out


def register_hook(t: "DTensor", fn: GradHook) -> RemovableHandle:
    """Call ``fn(grad)`` each backward when the gradient with respect to ``t`` is complete and
    before it flows on (into ``t``'s producer; for a leaf, into ``t.grad``). ``fn`` may
    return a replacement gradient (same shape, legal placements) or None to keep it. On a
    module's outputs this is the point before any of the module's backward runs."""
    if not getattr(t, "_requires_grad", False):
        raise RuntimeError("register_hook: the tensor does not require grad, so no gradient will reach it")
    node = edge(t)
    assert node is not None
    return node.register_prehook(fn)


def register_post_accumulate_grad_hook(leaf: "DTensor", fn: LeafHook) -> RemovableHandle:
    """Call ``fn(leaf)`` each backward once ``leaf.grad`` holds all of this backward's
    contributions (the leaf's accumulator ran; a backward that reaches no use of the leaf
    does not call it)."""
    if not getattr(leaf, "_requires_grad", False) or getattr(leaf, "_grad_fn", None) is not None:
        raise RuntimeError(
            "register_post_accumulate_grad_hook needs a leaf that requires grad (a Parameter or a "
            "tensor made with requires_grad=True); this tensor is computed by an operation or needs no grad")
    acc = edge(leaf)
    assert isinstance(acc, AccumulateGrad)
    return _add_hook(acc.post_hooks, fn)


class _Frame:
    """One running backward: the callbacks queued for its end."""

    __slots__ = ("callbacks",)

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []


_frames: list[_Frame] = []


def current_backward() -> _Frame | None:
    """The running backward (an opaque token, the same object for its whole run), or None."""
    return _frames[-1] if _frames else None


def queue_callback(fn: Callable[[], None]) -> None:
    """Call ``fn()`` when the running backward has run every node (callbacks run in the order
    queued; one may queue another). Only during a backward, e.g. from a hook."""
    if not _frames:
        raise RuntimeError("queue_callback: no backward is running; call it from a hook during backward()")
    if not callable(fn):
        raise TypeError(f"queue_callback needs a callable, got {type(fn).__name__}")
    _frames[-1].callbacks.append(fn)


class BackwardJoin:
    """A hook user's hold on the backward it works for (fully_shard, replicate): its hooks call
    ``join``, and the first call during a backward queues the user's end callback for it. A
    previous backward that raised before its end (so its callback never ran) is discarded
    first; the end callback calls ``leave()``."""

    __slots__ = ("frame",)

    def __init__(self) -> None:
        self.frame: _Frame | None = None  # the backward joined, until its end callback leaves

    def join(self, discard: Callable[[], None], finish: Callable[[], None]) -> bool:
        """Join the running backward: True when this call did (the caller starts its
        per-backward state then), False outside a backward or when joined already."""
        frame = current_backward()
        if frame is None or frame is self.frame:
            return False
        if self.frame is not None:  # the previous backward raised before its end callback
            discard()
        self.frame = frame
        queue_callback(finish)
        return True

    def leave(self) -> None:
        self.frame = None


def run_backward(root: "DTensor", grad: "DTensor", retain_graph: bool = False) -> None:
    """Propagate ``grad`` (d loss / d root) to every leaf that requires grad.

    A node runs once all its consumers have contributed to its gradient; among the nodes
    that may run, the latest created runs first (a topological order that is the same on
    every rank), and a leaf's accumulator runs as soon as it may (its gradient is complete).
    """
    start = edge(root)
    if start is None:
        raise RuntimeError(
            "backward(): the tensor does not require grad and has no grad_fn; mark a leaf with "
            "requires_grad=True (or requires_grad_()) before computing it"
        )
    consumers: dict[int, int] = {}  # per node: edges into it from reachable nodes not yet run
    seen = {id(start)}
    stack = [start]
    while stack:
        node = stack.pop()
        for nxt in node.next:
            if nxt is None:
                continue
            consumers[id(nxt)] = consumers.get(id(nxt), 0) + 1
            if id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append(nxt)
    pending: dict[int, DTensor] = {id(start): grad}
    ready: list[tuple[int, Node]] = [(-start.seq, start)]
    frame = _Frame()
    _frames.append(frame)
    try:
        with no_grad(), _trace.backward_span("backward()"):
            owned: set[int] = set()  # the root gradient is the caller's
            while ready:
                _, node = heapq.heappop(ready)
                _run_node(node, pending, consumers, ready, retain_graph, owned)
            for fn in frame.callbacks:  # a callback may queue more: the list grows as it runs
                fn()
    finally:
        _frames.remove(frame)


def step(node: Node, grad: "DTensor", retain_graph: bool) -> Sequence["DTensor | None"]:
    """Run one node backward on its complete output gradient: its pre-hooks, its backward,
    and (an accumulator) its leaf's post-accumulate hooks. Every loop that runs nodes (the
    engine's, a checkpoint's recompute) runs them through this, so hooks fire wherever the
    node runs."""
    return _step(node, grad, retain_graph, False)[0]


def _step(node: Node, grad: "DTensor", retain_graph: bool,
          owned: bool) -> tuple[Sequence["DTensor | None"], "DTensor", bool]:
    """``step``, and the gradient the node ran on with whether only the engine refers to its
    array: ``owned`` says so of ``grad``; a pre-hook (which may keep what it is shown, or
    return a replacement it keeps) makes it shared."""
    pre_hooks = getattr(node, "pre_hooks", None)  # a Node subclass may skip Node.__init__
    if pre_hooks:
        owned = False
        for hook in list(pre_hooks.values()):
            replaced = hook(grad)
            if replaced is not None:
                grad = replaced
    if _trace.current is None:
        grads = node.apply(grad, retain_graph, owned)
    else:
        with _trace.backward_span(node.name):
            grads = node.apply(grad, retain_graph, owned)
    if isinstance(node, AccumulateGrad):
        for leaf_hook in list(node.post_hooks.values()):
            leaf_hook(node.leaf)
    return grads, grad, owned


def _array_of(t: Any) -> Any:
    """``t``'s piece without waiting (None while a nonblocking redistribute is pending)."""
    return t._local if t._pending is None else None


def _root(arr: Any) -> Any:
    """The array that owns ``arr``'s memory (a NumPy view's ``base``)."""
    base = getattr(arr, "base", None)
    return arr if base is None else base


def _whole_buffer(arr: Any) -> bool:
    """A writable NumPy array spanning all of its owner's memory (itself, or a view such as a
    product's ``.T``); not a NumPy scalar (a 0-d sum's result is one, read-only), not a slice
    or broadcast of a larger array. Host arrays only: a device copy comes from CuPy's memory
    pool without page faults, and the ownership test relies on NumPy's ``base`` identity."""
    if type(arr) is not np.ndarray or not arr.flags.writeable:
        return False
    root = _root(arr)  # (a view of a memory map or of bytes has no NumPy owner: not whole)
    return root is arr or (type(root) is np.ndarray and root.base is None and root.nbytes == arr.nbytes)


def _owned(grads: Sequence["DTensor | None"], i: int, incoming: Any, incoming_owned: bool) -> bool:
    """Whether output ``i`` of a node's backward is an array nothing else refers to. It spans
    its own buffer (``_whole_buffer``) that no other output shares (add hands one buffer to
    both inputs) and that is either new or the node's incoming gradient's when the engine
    owned that one (a kernel passing ``g`` on, or a view of it such as a transpose). Backward
    kernels never return arrays they saved from forward (tests/test_autograd.py checks every
    op's), so a new buffer is the kernel's fresh result; an accumulator may keep it as the
    leaf's ``.grad`` instead of copying it (PyTorch's AccumulateGrad steals the same way): a
    2 MB gradient's copy took up to 1 ms of page faults."""
    arr = _array_of(grads[i])
    if arr is None or not _whole_buffer(arr):
        return False
    root = _root(arr)
    if incoming is not None and root is _root(incoming) and not incoming_owned:
        return False
    for j, other in enumerate(grads):
        if j != i and other is not None:
            local = _array_of(other)
            if local is None or _root(local) is root:
                return False
    return True


def _run_node(node: Node, pending: dict[int, "DTensor"], consumers: dict[int, int],
              ready: list[tuple[int, Node]], retain_graph: bool, owned: set[int]) -> None:
    """Run ``node`` on its pending gradient and pass its input gradients on. ``owned``: the
    nodes whose pending gradient's array only the engine refers to (a sum it made, or a
    kernel's fresh output: ``_owned``)."""
    g = pending.pop(id(node), None)
    grads: Sequence[DTensor | None] = ()
    incoming, incoming_owned = None, False
    if g is not None:  # else reachable only through inputs that got no gradient
        was_owned = id(node) in owned
        owned.discard(id(node))
        grads, g, incoming_owned = _step(node, g, retain_graph, was_owned)
        incoming = _array_of(g)
    for i, nxt in enumerate(node.next):
        if nxt is None:
            continue
        gi = grads[i] if i < len(grads) else None
        if gi is not None:
            key = id(nxt)
            prev = pending.get(key)
            if prev is None:
                pending[key] = gi
                if node.fresh_outputs and _owned(grads, i, incoming, incoming_owned):
                    owned.add(key)
            else:
                pending[key] = total = accumulate(prev, gi)  # a new array
                if _whole_buffer(_array_of(total)):
                    owned.add(key)
                else:
                    owned.discard(key)
        consumers[id(nxt)] -= 1
        if consumers[id(nxt)] == 0:
            if isinstance(nxt, AccumulateGrad):
                _run_node(nxt, pending, consumers, ready, retain_graph, owned)  # a leaf: its gradient is complete
            else:
                heapq.heappush(ready, (-nxt.seq, nxt))
