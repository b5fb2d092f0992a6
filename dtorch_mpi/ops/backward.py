"""An operator's backward rule as data: its local gradient kernel, what the forward saves for
it, and the formula ``signature()`` prints.

Each family module (elementwise.py, reductions.py, ...) declares its ops' backwards inline in
their ``Op(...)``; autograd/record.py runs them (``record_op``) and autograd/rules.py derives
each input gradient's placement from the forward rule that matched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..autograd.rules import pattern_text

Kernel = Callable[[Any, tuple[Any, ...], Any, dict[str, Any], Any], tuple[Any, ...]]
"""``kernel(g, saved_inputs, saved_output, params, xp) -> one local gradient per input``
(None for an input that gets none); ``params`` holds the op's parameters plus ``in_shapes``,
``in_specs`` and ``needs`` (which inputs want a gradient)."""


@dataclass(frozen=True)
class Backward:
    """An operator's backward: its kernel and what the forward must save for it."""

    kernel: Kernel
    saves_inputs: bool = True
    saves_output: bool = False
    formula: str = ""
    """The gradient in words, shown by ``signature()``."""

    def describe(self, rules: Sequence[Any]) -> list[str]:
        """Lines for ``signature()``: the local gradient and, per forward rule, the placement of
        each input's gradient (derived by autograd/rules.py)."""
        lines = [f"gradient: {self.formula}"] if self.formula else []
        for rule in rules:
            grads = ", ".join(pattern_text(p.kind, p.arg, rule.output.kind, rule.output.arg, i in rule.slices)
                              for i, p in enumerate(rule.inputs))
            head = f"({', '.join(map(repr, rule.inputs))}) -> {rule.output!r}"
            lines.append(f"{head}   grads: ({grads})")
        return lines


def unary_grad(formula: str, fn: Callable[[Any, Any, Any, Any], Any], *, inputs: bool = True,
               output: bool = False) -> Backward:
    """An elementwise one-input backward ``fn(g, x, y, xp)``; ``inputs``/``output``: whether it
    reads ``x``/``y`` (what the forward saves; the other is None)."""
    return Backward(lambda g, xs, out, p, xp: (fn(g, xs[0] if xs else None, out, xp),),
                    inputs, output, formula)


def binary_grad(formula: str, fn: Callable[[Any, Any, Any, Any, Any], tuple[Any, Any]], *,
                inputs: bool = True, output: bool = False) -> Backward:
    """An elementwise two-input backward ``fn(g, a, b, y, xp) -> (grad a, grad b)``."""
    return Backward(lambda g, xs, out, p, xp: fn(g, xs[0] if xs else None, xs[1] if xs else None,
                                                  out, xp), inputs, output, formula)


def grad_x(formula: str, fn: Callable[[Any, Any, Any], Any]) -> Backward:
    """A unary backward ``fn(g, x, xp)`` of the input (the forward saves its input)."""
    return unary_grad(formula, lambda g, x, y, xp: fn(g, x, xp))


def grad_y(formula: str, fn: Callable[[Any, Any, Any], Any]) -> Backward:
    """A unary backward ``fn(g, y, xp)`` of the output (the forward saves only its output)."""
    return unary_grad(formula, lambda g, x, y, xp: fn(g, y, xp), inputs=False, output=True)


def grad_g(formula: str, fn: Callable[[Any, Any], Any]) -> Backward:
    """A unary backward ``fn(g, xp)`` of the incoming gradient alone (the forward saves nothing)."""
    return unary_grad(formula, lambda g, x, y, xp: fn(g, xp), inputs=False)


ZERO = grad_g("0", lambda g, xp: xp.zeros_like(g))
"""The backward of a piecewise-constant function (floor, sign, ...)."""

__all__ = ["ZERO", "Backward", "Kernel", "binary_grad", "grad_g", "grad_x", "grad_y", "unary_grad"]
