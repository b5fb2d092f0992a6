"""The vocabulary of placement rule tables, shared by the operator families (each family module
states its ops' tables with it, next to their kernels and backwards).

Rules are per mesh dim. ``Shard(d)``: sharded on a dim that survives into the output (``d``
in output coordinates); ``Shard(r)``: sharded on a dim the op reduces away; ``Shard(-1)``,
``Shard(-2)``: fixed dims (matmul's matrix dims). A scalar operand counts as ``Replicate()``.
"""

from __future__ import annotations

from itertools import product
from typing import NamedTuple

from .signature import P, Pat, R, Rule, S, Signature

LINEAR_PARTIALS = ("sum", "avg")
ALL_PARTIALS = ("sum", "avg", "max", "min")


def shard_rules(arity: int) -> list[Rule]:
    """Elementwise sharding: all operands share ``Shard(d)``; ``Replicate`` operands are cut
    locally to the shard (the one documented exception: zero bytes move); all ``Replicate``."""
    rules = []
    for pattern in product((True, False), repeat=arity):
        if not any(pattern):
            continue
        inputs = tuple(S("d") if sharded else R for sharded in pattern)
        sliced = tuple(i for i, sharded in enumerate(pattern) if not sharded)
        rules.append(Rule(inputs, S("d"), slices=sliced))
    rules.append(Rule((R,) * arity, R))
    return rules


class Algebra(NamedTuple):
    """Which Partial inputs a unary elementwise op keeps (input reduce op -> output reduce op)."""

    partials: tuple[tuple[str, str], ...]
    doc: str


NEGATING = Algebra((("sum", "sum"), ("avg", "avg"), ("max", "min"), ("min", "max")),
                   "linear: Partial(sum|avg) stays; Partial(max) <-> Partial(min)")
MONOTONE = Algebra((("max", "max"), ("min", "min")), "monotone increasing: commutes with Partial(max|min)")
"""Monotone increasing on all reals, so it commutes with max/min of the terms. (log and sqrt
are monotone only on their domain: a term outside it would poison the max with NaN.)"""
PLAIN = Algebra((), "")
"""No Partial input: the op is neither linear nor monotone."""


def unary_signature(name: str, algebra: Algebra = PLAIN) -> Signature:
    """A unary elementwise op's table: Shard and Replicate follow the data, plus ``algebra``."""
    rules = [Rule((S("d"),), S("d")), Rule((R,), R)]
    rules += [Rule((P(a),), P(b)) for a, b in algebra.partials]
    return Signature(name, tuple(rules), algebra.doc)


BROADCAST_DOC = ("broadcasting binary op: a Replicate operand is cut locally to the other "
                 "operand's Shard (zero bytes move), dims aligned from the right; a Shard on a dim "
                 "that broadcasting stretches from size 1 matches no rule")


def binary_signature(name: str, partial_rules: tuple[Rule, ...] = ()) -> Signature:
    """A broadcasting binary op's table: the sharding rules plus its ``partial_rules``."""
    return Signature(name, tuple(shard_rules(2)) + partial_rules, BROADCAST_DOC)


def pp(op: str) -> Rule:
    """``(Partial(op), Partial(op)) -> Partial(op)``."""
    return Rule((P(op), P(op)), P(op))


def pr(op: str, out: str | None = None) -> Rule:
    """``(Partial(op), Replicate()) -> Partial(out or op)``."""
    return Rule((P(op), R), P(out or op))


def rp(op: str, out: str | None = None) -> Rule:
    """``(Replicate(), Partial(op)) -> Partial(out or op)``."""
    return Rule((R, P(op)), P(out or op))


def follows_data(note: str = "") -> tuple[Rule, ...]:
    """A one-input op that moves values without combining them: Shard and Replicate follow the
    data, and every Partial stays (``note`` on the Partial rules)."""
    return (Rule((S("d"),), S("d")), Rule((R,), R)) + tuple(Rule((P(p),), P(p), note=note) for p in ALL_PARTIALS)


def nary(sig: Signature, n: int) -> Signature:
    """``cat``/``stack`` rules for ``n`` inputs (the table shows two)."""
    rules = []
    for rule in sig.rules:
        rules.append(Rule((rule.inputs[0],) * n, rule.output, rule.slices, rule.communicates))
    return Signature(sig.op, tuple(rules), sig.doc)


__all__ = ["ALL_PARTIALS", "Algebra", "BROADCAST_DOC", "LINEAR_PARTIALS", "MONOTONE", "NEGATING", "PLAIN", "Pat",
           "binary_signature", "follows_data", "nary", "pp", "pr", "rp", "shard_rules", "unary_signature"]
