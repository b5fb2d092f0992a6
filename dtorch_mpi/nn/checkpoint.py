"""Activation checkpointing: ``checkpoint(fn, *args)`` keeps only ``fn``'s inputs for backward
and recomputes ``fn`` there.

The forward runs ``fn`` recording as usual, so the boundary of what it recorded (the edges into
its inputs' producers and into the accumulators of the parameters it used) is found without
asking the caller which parameters ``fn`` touches. That subgraph is then replaced by one node
whose edges are the boundary: the subgraph, and every activation its backward kernels saved,
is freed as soon as ``fn`` returns. In backward the node runs ``fn`` again on the same inputs,
recording, with the random generator set back to where the forward found it (dropout draws the
same masks), backpropagates through the recomputed subgraph down to the boundary, and hands the
engine each boundary edge's gradient in the order the engine would have met it without
checkpointing: gradients are bit-identical. The recompute stops early, as PyTorch's
non-reentrant checkpoint can: operations whose results no backward reads (a block's last matmul
and additions) are recorded without computing them (autograd/skipping.py). Hooks compose: the result's hooks move to the
checkpoint node, and the recomputed nodes run through the engine's ``step`` (autograd/graph.py),
so the hooks the recompute registers (fully_shard's pre-backward) fire there. ``fn`` must record the same operations when run
again (as torch's checkpoint assumes); a different graph raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import random as _random
from ..autograd import skipping
from ..autograd.accumulate import accumulate
from ..autograd.graph import AccumulateGrad, Node, observe, step
from ..autograd.record import version_of
from ..dtensor import DTensor
from ..grad_mode import _GradMode, enable_grad, no_grad
from .module import Module


def _marker() -> int:
    """A sequence number below every node recorded from now on."""
    return Node("CheckpointMarker", (), lambda g: ()).seq


def _subgraph(root: Node, after: int) -> tuple[list[Node], list[Node]]:
    """The nodes recorded after ``after`` that ``root`` reaches through such nodes (newest
    first: the engine's order), and the edges leaving them (the boundary), in that order:
    node by node, edge by edge, so the engine meets them in the order it would meet them."""
    def inner(n: Node) -> bool:
        return n.seq > after and not isinstance(n, AccumulateGrad)

    seen: dict[int, Node] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen[id(node)] = node
            stack.extend(n for n in node.next if n is not None and inner(n))
    nodes = sorted(seen.values(), key=lambda n: n.seq, reverse=True)
    boundary = [n for node in nodes for n in node.next if n is not None and not inner(n)]
    return nodes, boundary


def _backprop(nodes: list[Node], grad: DTensor) -> list[DTensor | None]:
    """Run the recomputed subgraph ``nodes`` (newest first, ``nodes[0]`` its root) backward from
    ``grad``; return one gradient (or None) per boundary edge, in ``_subgraph``'s order."""
    ids = {id(n) for n in nodes}
    pending: dict[int, DTensor] = {id(nodes[0]): grad}
    out: list[DTensor | None] = []
    for node in nodes:
        g = pending.pop(id(node), None)
        if g is None:
            grads: Sequence[DTensor | None] = ()
        elif node is nodes[0]:  # its hooks are the Checkpoint node's, which ran already
            grads = node.apply(g, False)
        else:  # through the engine's step: the hooks the recompute registered fire, once each
            grads = step(node, g, False)
        for k, nxt in enumerate(node.next):
            gi = grads[k] if k < len(grads) else None
            if nxt is None:
                continue
            if id(nxt) not in ids:
                out.append(gi)
            elif gi is not None:
                prev = pending.get(id(nxt))
                pending[id(nxt)] = gi if prev is None else accumulate(prev, gi)
    return out


def _recorded_root(out: Any, after: int, fn: Callable[..., Any]) -> Node | None:
    """The node ``fn`` recorded last for its result ``out``, or None when it recorded nothing
    that needs recomputing (nothing requires grad, or ``out`` was made before ``fn``)."""
    if isinstance(out, (tuple, list)) and any(isinstance(t, DTensor) and t.requires_grad for t in out):
        raise TypeError(f"checkpoint: {getattr(fn, '__name__', fn)!r} returned {len(out)} values; checkpoint "
                        f"takes a function of one DTensor result (checkpoint each output's computation)")
    if not isinstance(out, DTensor):
        return None
    root = out.grad_fn
    if root is None or isinstance(root, AccumulateGrad) or root.seq <= after:
        return None
    return root  # type: ignore[no-any-return]


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping only the inputs for backward: the activations ``fn``
    makes are freed when it returns and recomputed during backward (the random generator
    replayed, so dropout masks repeat); gradients are bit-identical to calling ``fn``.
    ``fn`` returns one DTensor (or something that needs no gradient: then it is just called).
    Inputs must not be modified in place before backward (that raises there)."""
    if not _GradMode.recording:
        return fn(*args, **kwargs)
    rng = _random.state()
    after = _marker()
    records: list[skipping.Recorded] = []
    outer = observe(lambda node, result, saves, inputs: records.append(skipping.Recorded(
        node, saves, result.to_local().shape, result.to_local().dtype, skipping.operand_shapes(inputs))))
    try:
        out = fn(*args, **kwargs)
    finally:
        observe(outer)
    root = _recorded_root(out, after, fn)
    if root is None:
        return out
    recorded, boundary = _subgraph(root, after)
    names = [n.name for n in recorded]  # what a faithful recompute records again
    seen = {id(r.node) for r in records}
    # the early stop (autograd/skipping.py), unless a node was made that the observer did not
    # see (a nested checkpoint's): its inputs could be results left uncomputed
    skip = skipping.plan(records) if all(id(n) in seen for n in recorded) else {}
    del recorded, seen
    records.clear()  # the forward's nodes (and what they saved) are freed below
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, DTensor)]
    versions = [(t, version_of(t)) for t in inputs]
    spec = out.spec
    name = getattr(fn, "__name__", type(fn).__name__)

    def backward(grad: DTensor) -> list[DTensor | None]:
        for t, version in versions:
            if version_of(t) != version:
                raise RuntimeError(f"checkpoint backward: an input of {name!r} was modified in place after "
                                   f"the forward; recomputing it would give other values (use out-of-place ops)")
        resume = _random.state()
        _random.set_state(rng)
        plan = skipping.Plan(skip)
        outer_plan, skipping.ACTIVE = skipping.ACTIVE, plan
        outer = observe(lambda node, result, saves, inputs: setattr(plan, "count", plan.count + 1))
        try:
            with enable_grad():
                again_after = _marker()
                again = fn(*args, **kwargs)
        finally:
            observe(outer)
            skipping.ACTIVE = outer_plan
            _random.set_state(resume)
        again_root = _recorded_root(again, again_after, fn)
        nodes, again_boundary = ([], []) if again_root is None else _subgraph(again_root, again_after)
        if (again_root is None or again.spec != spec or [n.name for n in nodes] != names
                or len(again_boundary) != len(boundary) or any(a is not b for a, b in zip(again_boundary, boundary))):
            raise RuntimeError(f"checkpoint backward: recomputing {name!r} recorded other operations than its "
                               f"forward did; a checkpointed function must compute the same way each time")
        with no_grad():
            return _backprop(nodes, grad)

    node = _Checkpoint("Checkpoint", tuple(boundary), backward)
    node.pre_hooks = root.pre_hooks  # hooks on the result (fully_shard's pre-backward) now fire on this node
    out._grad_fn = node
    return out


class _Checkpoint(Node):
    """The node that stands for a checkpointed function: its backward recomputes and runs the
    function's nodes, whose hooks may keep the gradients it returns (so never kept uncopied)."""

    __slots__ = ()
    fresh_outputs = False


def checkpoint_sequential(functions: Module | Sequence[Callable[..., Any]], segments: int, input: Any) -> Any:
    """Run ``functions`` (a ``Sequential`` or a list of callables) on ``input`` in ``segments``
    consecutive segments of about equal length, each but the last under ``checkpoint`` (as
    torch's: the last segment's activations are needed at once by backward)."""
    layers: list[Callable[..., Any]] = (list(functions._modules.values()) if isinstance(functions, Module)
                                        else list(functions))
    if segments < 1:
        raise ValueError(f"checkpoint_sequential: segments must be >= 1, got {segments}")
    size, extra = divmod(len(layers), segments)
    bounds, start = [], 0
    for i in range(min(segments, len(layers))):
        stop = start + size + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop

    def run(part: list[Callable[..., Any]]) -> Callable[[Any], Any]:
        def segment(x: Any) -> Any:
            for f in part:
                x = f(x)
            return x
        return segment

    x = input
    for i, (a, b) in enumerate(bounds):
        seg = run(layers[a:b])
        x = seg(x) if i == len(bounds) - 1 else checkpoint(seg, x)
    return x


def checkpoint_module(module: Module) -> Module:
    """Make every call of ``module`` checkpointed (in place; returns it; names and
    ``state_dict`` keys unchanged). Apply it after any parallel style on the same module (a
    style replaces the module's forward)."""
    forward = module.forward
    if getattr(forward, "_dtorch_checkpointed", False):
        return module

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, **kwargs)

    checkpointed._dtorch_checkpointed = True  # type: ignore[attr-defined]
    object.__setattr__(module, "forward", checkpointed)
    return module


def apply_activation_checkpointing(model: Module, check_fn: Callable[[Module], bool]) -> Module:
    """``checkpoint_module`` on every submodule of ``model`` (itself included) for which
    ``check_fn`` is true, e.g. ``lambda m: isinstance(m, Block)`` for one per transformer
    block; returns ``model``."""
    for m in list(model.modules()):
        if check_fn(m):
            checkpoint_module(m)
    return model
