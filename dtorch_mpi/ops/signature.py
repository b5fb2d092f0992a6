"""Placement signatures: an operator's rule table as data, and matching against it.

A rule says, for ONE mesh dim, which input placements give which output placement. Patterns
are parametric in tensor dims: ``Shard(d)`` is "sharded on a dim that survives into the
output" (``d`` named in output coordinates, so one rule covers every dim), ``Shard(r)`` is
"sharded on a dim the op reduces away", ``Shard(-1)`` is a fixed input dim. On an n-D mesh
every mesh dim is matched on its own. Matching is metadata only: no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..placement import Partial, Placement, Replicate, Shard


@dataclass(frozen=True)
class Pat:
    """One position of a rule: ``R``, ``S`` (dim variable ``"d"``/``"r"`` or a fixed int) or ``P``."""

    kind: str
    arg: str | int | None = None

    def __repr__(self) -> str:
        if self.kind == "R":
            return "Replicate()"
        if self.kind == "S":
            return f"Shard({self.arg})"
        if self.kind == "X":
            return "scalar"
        return f'Partial("{self.arg}")'


R = Pat("R")
SCALAR = Pat("X")


def S(dim: str | int = "d") -> Pat:
    return Pat("S", dim)


def P(op: str = "sum") -> Pat:
    return Pat("P", op)


@dataclass(frozen=True)
class Rule:
    """``inputs -> output`` for one mesh dim.

    ``slices``: inputs given as ``Replicate`` that are cut locally to the output's shard (the
    broadcasting exception: zero bytes move). ``communicates``: the op itself moves data
    under this rule (no rule does today; the flag is part of the table's contract).
    """

    inputs: tuple[Pat, ...]
    output: Pat
    slices: tuple[int, ...] = ()
    communicates: bool = False
    note: str = ""

    def __repr__(self) -> str:
        text = f"({', '.join(map(repr, self.inputs))}) -> {self.output!r}"
        tags = []
        if self.slices:
            tags.append("Replicate input sliced locally, no communication")
        if self.communicates:
            tags.append("communicates")
        if self.note:
            tags.append(self.note)
        return text + (f"   [{'; '.join(tags)}]" if tags else "")


@dataclass(frozen=True)
class Signature:
    op: str
    rules: tuple[Rule, ...]
    doc: str = ""
    aliases: tuple[str, ...] = field(default=())
    backward: Any = field(default=None, compare=False)
    """The operator's backward rule when declared (shown by ``table()``); see ops/registry.py."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def table(self) -> str:
        lines = [f"{self.op}:"] + [f"  {r!r}" for r in self.rules]
        if self.doc:
            lines.append(f"  note: {self.doc}")
        if self.backward is not None:
            lines.append("  backward:")
            lines += [f"    {line}" for line in self.backward.describe(self.rules)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()


class DimMap(Protocol):
    """How an op relates each input's tensor dims to the output's."""

    def to_out(self, i: int, dim: int) -> int | None:
        """Output dim of input ``i``'s ``dim``; None when the op removes it."""

    def stretched(self, i: int, dim: int) -> bool:
        """True when broadcasting stretches input ``i``'s ``dim`` from size 1."""

    def in_dim(self, i: int, out_dim: int) -> int | None:
        """Input ``i``'s dim that becomes ``out_dim`` (None: the input has no such dim)."""

    def fixed(self, i: int, dim: int) -> int | None:
        """Input ``i``'s dim for a rule's fixed (possibly negative) dim ``dim``."""

    def out_fixed(self, dim: int) -> int | None:
        """The output dim for a rule's fixed output dim ``dim`` (None: not in the output)."""


@dataclass(frozen=True)
class Match:
    rule: Rule
    output: Placement
    slice_to: tuple[tuple[int, int], ...]
    """``(input index, input dim)`` pairs to cut locally to the output's shard."""


def match_mesh_dim(
    sig: Signature, placements: Sequence[Placement | None], dmap: DimMap
) -> Match | None:
    """The first rule of ``sig`` that ``placements`` (None = a scalar) satisfy on one mesh dim."""
    for rule in sig.rules:
        if len(rule.inputs) != len(placements):
            continue
        m = _match_rule(rule, placements, dmap)
        if m is not None:
            return m
    return None


def _match_rule(rule: Rule, placements: Sequence[Placement | None], dmap: DimMap) -> Match | None:
    binding: dict[str, int] = {}
    for i, (pat, p) in enumerate(zip(rule.inputs, placements)):
        if pat.kind == "X":
            if p is not None:
                return None
            continue
        if p is None:
            # a scalar behaves as Replicate wherever a rule accepts Replicate
            if pat.kind != "R":
                return None
            continue
        if pat.kind == "R":
            if not isinstance(p, Replicate):
                return None
        elif pat.kind == "P":
            if not (isinstance(p, Partial) and p.reduce_op == pat.arg):
                return None
        else:
            if not isinstance(p, Shard):
                return None
            if isinstance(pat.arg, int):
                if dmap.fixed(i, pat.arg) != p.dim:
                    return None
                continue
            if dmap.stretched(i, p.dim):
                return None
            out_dim = dmap.to_out(i, p.dim)
            if pat.arg == "r":
                if out_dim is not None:
                    return None
                continue
            if out_dim is None:
                return None
            assert isinstance(pat.arg, str)
            if binding.setdefault(pat.arg, out_dim) != out_dim:
                return None
    out = rule.output
    if out.kind == "R":
        output: Placement = Replicate()
    elif out.kind == "P":
        output = Partial(str(out.arg))
    elif isinstance(out.arg, int):
        od = dmap.out_fixed(out.arg)
        if od is None:
            return None
        output = Shard(od)
    else:
        if out.arg not in binding:
            return None
        output = Shard(binding[str(out.arg)])
    slice_to = []
    if isinstance(output, Shard):
        for i in rule.slices:
            if placements[i] is None:
                continue
            d = dmap.in_dim(i, output.dim)
            if d is not None and not dmap.stretched(i, d):
                slice_to.append((i, d))
    return Match(rule, output, tuple(slice_to))
