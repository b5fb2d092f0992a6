"""Operator declarations: one ``Op`` per operator, and everything derived from the registry.

An ``Op`` holds what defines an operator: its name, placement signature (rule table), local
kernel, plan builder, the public functions and DTensor methods/operators that reach it, its
NumPy reference, its docstring and its backward rule. The ``dtorch`` namespace, the DTensor
methods, ``signature()``, docs/signatures.md and the generated tests are all derived from
``OPS``; declarations live in the family modules gathered by ``dtorch_mpi/ops/catalog.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from .signature import Signature

if TYPE_CHECKING:
    from ..spec import DTensorSpec
    from .backward import Backward
    from .dispatch import OpPlan

F = TypeVar("F", bound=Callable[..., Any])

Planner = Callable[["Op", "tuple[DTensorSpec | None, ...]", "tuple[Any, ...]"], "OpPlan"]
"""Builds an op's plan from its input specs and hashable parameters (metadata only, cached)."""


@dataclass(frozen=True, eq=False)
class Op:
    """One operator, declared once. Compared and hashed by identity (plan cache keys)."""

    name: str
    signature: Signature
    planner: Planner
    kernel: Callable[..., Any] | None = None
    """``kernel(xp, *local_inputs, **params) -> local output`` (None when ``ufunc`` names it)."""
    ufunc: str | None = None
    """Name of the array library's own function (``xp.<ufunc>``), used as the kernel."""
    params: tuple[str, ...] | None = ()
    """Keyword parameters an elementwise function accepts (None: the array library's own)."""
    reference: Callable[..., Any] | None = None
    """NumPy on complete arrays: what the op computes (the generated tests compare with it)."""
    domain: tuple[str, ...] = ("real",)
    """Per operand, the values it is defined on: "real", "unit" ([-1, 1]), "int" or "bool"."""
    examples: tuple[dict[str, Any], ...] = ({},)
    """Keyword parameters the generated tests call the op with."""
    doc: str = ""
    backward: Backward | None = None
    """The backward rule (local gradient kernel, what it saves, its formula; gradient placements
    per forward rule follow from autograd/rules.py). ``signature()`` and docs/signatures.md
    show it; None: not differentiable."""
    functions: dict[str, Callable[..., Any]] = field(default_factory=dict, repr=False)
    """Public ``dtorch`` functions that reach this op (name -> function)."""
    methods: dict[str, Any] = field(default_factory=dict, repr=False)
    """DTensor attributes bound to this op (methods, operators, properties)."""

    def __post_init__(self) -> None:
        if self.backward is not None and self.signature.backward is None:
            object.__setattr__(self, "signature", replace(self.signature, backward=self.backward))
        if self.name in OPS:
            raise ValueError(f"operator {self.name!r} is declared twice")
        OPS[self.name] = self

    def define(self, *methods: str, alias: tuple[str, ...] = ()) -> Callable[[F], F]:
        """Register a public function of this op, also bound as the DTensor ``methods``
        (and exported under each ``alias``); returns the function unchanged."""

        def register(fn: F) -> F:
            for name in (fn.__name__, *alias):
                self.functions[name] = fn
            for name in methods:
                self.bind(name, fn)
            return fn

        return register

    def bind(self, method: str, value: Any) -> None:
        """Bind DTensor attribute ``method`` (a method, operator or property) to this op."""
        self.methods[method] = value


OPS: dict[str, Op] = {}
"""Every declared operator by name (filled by the family modules dtorch_mpi.ops.catalog gathers)."""

def lookup(name: str) -> Op:
    """The operator a public name, method or operator (``"divide"``, ``"T"``, ``"__add__"``) reaches."""
    op = OPS.get(name)
    if op is not None:
        return op
    for op in OPS.values():
        if name in op.functions or name in op.methods:
            return op
    raise KeyError(f"no operator named {name!r}; known: {', '.join(sorted(OPS))}")


def signature(name: str) -> Signature:
    """The placement signature (rule table) of operator ``name`` (or any of its aliases), with
    the op's backward rule (gradient placements per rule) when it has one."""
    return lookup(name).signature


def exported() -> dict[str, Callable[..., Any]]:
    """Every public operator function by its ``dtorch`` name."""
    return {name: fn for op in OPS.values() for name, fn in op.functions.items()}


def install_methods(cls: type) -> None:
    """Bind every declared method, operator and property onto ``cls`` (called once by
    ``dtorch_mpi/__init__.py``; explicit rather than an import side effect of this module)."""
    for op in OPS.values():
        for name, value in op.methods.items():
            setattr(cls, name, value)
    cls.__pos__ = lambda self: self  # type: ignore[attr-defined,operator]
    cls.__hash__ = object.__hash__  # type: ignore[assignment]  # __eq__ is elementwise


__all__ = ["OPS", "Op", "Planner", "exported", "install_methods", "lookup", "signature"]
