"""Recording operators and redistributes: the bridge from the forward to the graph.

``record_op`` is called once per operator call with the op's plan (its matched placements and
the local slices it cut), its operands, the local inputs it computed on, its result and its
parameters. When nothing requires grad (or under ``no_grad``) it returns at once: the forward
hot path pays one flag test and one attribute test per operand.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..dtensor import DTensor
from ..errors import PlacementError
from ..placement import Partial, Placement, Replicate, Shard
from .graph import attach
from .rules import DIFFERENTIABLE_PARTIALS, grad_placement, no_gradient

if TYPE_CHECKING:
    from ..ops.backward import Backward
    from ..ops.dispatch import OpPlan
    from ..spec import DTensorSpec


def needs_recording(operands: Sequence[Any]) -> bool:
    """True when some operand requires grad (the caller tests grad mode first)."""
    return any(isinstance(t, DTensor) and t._requires_grad for t in operands)


def version_of(t: "DTensor") -> int:
    """How many in-place ops changed ``t`` (0 until the first)."""
    return getattr(t, "_version", 0)


def mark_changed(t: "DTensor") -> None:
    """``t``'s values were changed in place (an in-place operator, an optimizer step, a load),
    as PyTorch's version counter counts it: a backward through a graph that saved the old value
    refuses, and fully_shard gathers again what it gathered before."""
    t._version = version_of(t) + 1  # type: ignore[attr-defined]


_STEP_LISTENERS: list[Callable[[Sequence[DTensor]], None]] = []


def on_optimizer_step(listener: Callable[[Sequence[DTensor]], None]) -> None:
    """Call ``listener(params)`` at the end of every optimizer step, with the parameters the
    step may have changed (fully_shard starts its next forward's first all-gather there)."""
    if listener not in _STEP_LISTENERS:
        _STEP_LISTENERS.append(listener)


def optimizer_stepped(params: Sequence[DTensor]) -> None:
    """An optimizer step has changed ``params`` (each already :func:`mark_changed`)."""
    for listener in list(_STEP_LISTENERS):
        listener(params)


def differentiable(t: Any) -> bool:
    """A DTensor operand that requires grad and has a floating dtype."""
    return isinstance(t, DTensor) and t._requires_grad and t.dtype.kind in "fc"


def unbroadcast(g: Any, shape: tuple[int, ...], xp: Any) -> Any:
    """Sum a broadcast gradient back to ``shape`` (leading dims and stretched size-1 dims)."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    if lead:
        g = xp.sum(g, axis=tuple(range(lead)))
    stretched = tuple(d for d, n in enumerate(shape) if n == 1 and g.shape[d] != 1)
    if stretched:
        g = xp.sum(g, axis=stretched, keepdims=True)
    return g


def unslice(g: Any, cut: "DTensorSpec", whole: "DTensorSpec", xp: Any) -> Any:
    """The adjoint of a local cut (Replicate -> Shard): ``g`` zero-padded back into the piece
    it was cut from (the result is that piece's ``Partial("sum")`` contribution)."""
    (shape, offset), (cut_shape, cut_offset) = whole.local_shape_and_offset, cut.local_shape_and_offset
    if tuple(cut_shape) == tuple(shape):
        return g
    region = tuple(slice(co - o, co - o + n) for co, o, n in zip(cut_offset, offset, cut_shape))
    full = xp.zeros(shape, dtype=g.dtype)
    full[region] = g
    return full


def check_grad_layout(name: str, out: "DTensorSpec", grad: "DTensor") -> None:
    """A gradient must be placed as its tensor allows: a Shard's as that Shard, a Partial's as
    Replicate, a Replicate's as Replicate or Partial("sum"|"avg")."""
    if grad.device_mesh is not out.mesh or grad.shape != out.shape:
        raise PlacementError(
            f"{name}: the gradient has shape {grad.shape} on {grad.device_mesh!r}; the tensor has "
            f"shape {out.shape} on {out.mesh!r}"
        )
    for k, (p, g) in enumerate(zip(out.placements, grad.placements)):
        ok = (g == p if isinstance(p, Shard) else
              isinstance(g, Replicate) if isinstance(p, Partial) else
              isinstance(g, Replicate) or (isinstance(g, Partial) and g.reduce_op in DIFFERENTIABLE_PARTIALS))
        if not ok:
            want = p if isinstance(p, Shard) else Replicate()
            raise PlacementError(
                f"{name}: a gradient placed {g!r} on mesh dim {k} does not fit a tensor placed {p!r}; "
                f"redistribute the gradient to {want!r} on that mesh dim"
            )


def record_op(op: str, bw: Backward, plan: "OpPlan", operands: Sequence[Any], inputs: Sequence[Any],
              out: "DTensor", params: Mapping[str, Any]) -> "DTensor":
    """Attach ``op``'s backward ``bw`` to ``out`` (some operand requires grad).

    ``plan``: the op's plan (each input's local cut in ``plan.prepare``); ``inputs``: the local
    pieces the kernel ran on; ``params``: the op's parameters, which the kernel also gets,
    with ``in_shapes`` (the inputs' local shapes) and ``in_specs`` (the operands' specs).
    """
    if out.dtype.kind not in "fc":
        return out
    wants = tuple(differentiable(t) for t in operands)
    if not any(wants):
        return out
    specs = tuple(t.spec if w else None for t, w in zip(operands, wants))
    cuts = tuple(p.out_spec if p is not None else None for p in plan.prepare)
    shapes = tuple(getattr(x, "shape", ()) for x in inputs)
    kernel_params = {**params, "in_shapes": shapes, "needs": wants,
                     "in_specs": tuple(getattr(t, "spec", None) for t in operands)}
    xp = plan.xp
    saved_inputs = tuple(inputs) if bw.saves_inputs else ()
    saved_out = out.to_local() if bw.saves_output else None
    versions = tuple((t, version_of(t)) for t in operands if isinstance(t, DTensor)) if bw.saves_inputs else ()
    out_spec = out.spec

    def backward(grad: "DTensor") -> list["DTensor | None"]:
        from ..dtensor import DTensor

        for t, version in versions:
            if version_of(t) != version:
                raise RuntimeError(
                    f"{op} backward: an input was modified in place after {op} saved it for "
                    f"backward; use the out-of-place form (e.g. x = x + y instead of x += y)"
                )
        check_grad_layout(f"{op} backward", out_spec, grad)
        for k, p in enumerate(out_spec.placements):
            if isinstance(p, Partial) and p.reduce_op not in DIFFERENTIABLE_PARTIALS:
                raise no_gradient(op, p, k)
        local_grads = bw.kernel(grad.to_local(), saved_inputs, saved_out, kernel_params, xp)
        results: list[DTensor | None] = []
        for i, spec in enumerate(specs):
            gi = local_grads[i] if spec is not None else None
            if spec is None or gi is None:
                results.append(None)
                continue
            cut = cuts[i] or spec
            gi = unbroadcast(xp.asarray(gi), shapes[i], xp)
            gi = unslice(gi, cut, spec, xp)
            placements = tuple(
                grad_placement(op, p_in, p_out, p_g, p_cut != p_in, k)
                for k, (p_in, p_cut, p_out, p_g) in enumerate(
                    zip(spec.placements, cut.placements, out_spec.placements, grad.placements)))
            results.append(DTensor(gi.astype(spec.dtype, copy=False), spec.with_placements(placements)))
        return results

    return attach(out, op, operands, backward, (bw.saves_inputs, bw.saves_output))


def record_redistribute(src: "DTensor", out: "DTensor") -> "DTensor":
    """The backward of a redistribute is a redistribute (its adjoint), per mesh dim:
    Shard(d) source <- the gradient redistributed to Shard(d) (slice, reduce-scatter or
    all-to-all); Partial source <- Replicate (all-reduce only when the gradient is Partial);
    Replicate source cut to a Shard <- the gradient zero-padded, Partial("sum") (no data moves:
    the forward moved none), or all-gathered to Replicate where a later mesh dim shards the same
    tensor dim (nested sharding: the forward's cut moved data too); a mesh dim the forward left alone keeps the gradient's placement."""
    src_spec, out_spec = src.spec, out.spec

    def backward(grad: "DTensor") -> list["DTensor | None"]:
        from ..arrays import array_namespace
        from ..dtensor import DTensor

        check_grad_layout("redistribute backward", out_spec, grad)
        via: list[Placement] = []
        padded: list[int] = []
        for k, (s, d, g) in enumerate(zip(src_spec.placements, out_spec.placements, grad.placements)):
            if s == d:
                via.append(g)
            elif isinstance(s, Shard):
                via.append(s)
            elif isinstance(s, Partial):
                if s.reduce_op not in DIFFERENTIABLE_PARTIALS:
                    raise no_gradient("redistribute", s, k)
                via.append(Replicate())
            elif isinstance(d, Shard):
                via.append(g)  # Replicate cut to a Shard: pad locally below
                padded.append(k)
            else:
                via.append(g)  # Replicate -> Partial: the value's gradient is the source's
        for k in list(padded):
            if any(j > k and via[j] == via[k] for j in range(len(via))):
                # a later mesh dim splits the same tensor dim (nested sharding): the forward's
                # cut was not local, so neither is its adjoint: gather the gradient instead
                via[k] = Replicate()
                padded.remove(k)
        moved = grad.redistribute(placements=via) if tuple(via) != grad.placements else grad
        if not padded:
            return [DTensor(moved.to_local(), moved.spec)]
        target = tuple(Partial("sum") if k in padded else p for k, p in enumerate(via))
        whole = moved.spec.with_placements(tuple(Replicate() if k in padded else p for k, p in enumerate(via)))
        xp = array_namespace(src_spec.mesh.device_type)
        local = unslice(moved.to_local(), moved.spec, whole, xp)
        return [DTensor(local, moved.spec.with_placements(target))]

    return attach(out, "redistribute", (src,), backward)
