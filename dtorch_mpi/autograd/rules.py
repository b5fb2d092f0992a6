"""Backward placement rules: the placement of each input's gradient, per mesh dim.

They are derived from the forward rule that matched, by one principle: the backward of a rule
that moves no data moves no data. Per mesh dim, for an input placed ``x`` and an output whose
gradient is placed ``g``:

=======================  =====================================================================
input                    its gradient
=======================  =====================================================================
``Shard(d)``             ``Shard(d)`` (the gradient of a piece is a piece)
``Replicate()``          ``g`` when the output is Replicate (``Replicate`` or ``Partial``);
                         ``Partial("sum")`` when the output is sharded (each rank holds the
                         contribution of its piece; a Replicate operand cut locally to a Shard
                         gets its gradient zero-padded back); the output's ``Partial(op)``
                         when the output is Partial (the input met the output's terms)
``Partial("sum"|"avg")`` ``Replicate()``: the gradient of the value is the gradient of each term
                         (``Partial("avg")``: of the mean, so every term's share is the same)
``Partial("max"|"min")`` none: it would need to know which rank's term won, which only
                         communication tells; redistribute to Replicate first
=======================  =====================================================================

``dtorch.signature(name)`` prints these next to each forward rule (``grads:``).
"""

from __future__ import annotations

from ..errors import PlacementError
from ..placement import Partial, Placement, Replicate, Shard

DIFFERENTIABLE_PARTIALS = ("sum", "avg")


def grad_placement(op: str, inp: Placement, out: Placement, grad: Placement, sliced: bool,
                   mesh_dim: int) -> Placement:
    """The placement of an input's gradient on one mesh dim (see the module table)."""
    if isinstance(inp, Shard):
        return inp
    if isinstance(inp, Partial):
        if inp.reduce_op not in DIFFERENTIABLE_PARTIALS:
            raise no_gradient(op, inp, mesh_dim)
        if isinstance(grad, Partial):
            raise PlacementError(
                f"{op} backward: the gradient of a Partial result arrived as {grad!r} on mesh dim "
                f"{mesh_dim}; give a Replicate gradient (redistribute it before backward())"
            )
        return Replicate()
    if sliced or isinstance(out, Shard):
        return Partial("sum")
    if isinstance(out, Partial):
        if out.reduce_op not in DIFFERENTIABLE_PARTIALS:
            raise no_gradient(op, out, mesh_dim)
        return out
    return grad


def no_gradient(op: str, p: Placement, mesh_dim: int) -> PlacementError:
    return PlacementError(
        f"{op} backward: no gradient through {p!r} on mesh dim {mesh_dim}: it needs to know which "
        f"rank's term won, which only communication tells. Redistribute to Replicate() before the "
        f"differentiable computation (e.g. x = x.redistribute(placements=[Replicate()]))"
    )


def pattern_text(kind: str, arg: object, out_kind: str, out_arg: object, sliced: bool) -> str:
    """The gradient column of ``signature()`` for one input pattern of a forward rule."""
    if kind == "S":
        return f"Shard({arg})"
    if kind == "P":
        return "Replicate()" if arg in DIFFERENTIABLE_PARTIALS else "none"
    if kind == "X":
        return "-"
    if sliced or out_kind == "S":
        return 'Partial("sum")'
    if out_kind == "P":
        return f'Partial("{out_arg}")' if out_arg in DIFFERENTIABLE_PARTIALS else "none"
    return "as the output's gradient"
