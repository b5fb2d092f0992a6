"""The operators' placement signatures as data (ops/catalog.py declares each op with its table).

Rules are per mesh dim. ``Shard(d)``: sharded on a dim that survives into the output (``d``
in output coordinates); ``Shard(r)``: sharded on a dim the op reduces away; ``Shard(-1)``,
``Shard(-2)``: fixed dims (matmul's matrix dims). A scalar operand counts as ``Replicate()``.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product

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


def _unary(name: str, partials: tuple[tuple[str, str], ...], doc: str = "") -> Signature:
    rules = [Rule((S("d"),), S("d")), Rule((R,), R)]
    rules += [Rule((P(a),), P(b)) for a, b in partials]
    return Signature(name, tuple(rules), doc)


MONOTONE = (("max", "max"), ("min", "min"))
LAYOUT = tuple((p, p) for p in ALL_PARTIALS)

UNARY_LINEAR = {"neg": (("sum", "sum"), ("avg", "avg"), ("max", "min"), ("min", "max"))}
UNARY_MONOTONE = ("exp", "expm1", "tanh", "sigmoid", "relu", "floor", "ceil", "trunc", "rint",
                  "arctan", "arcsinh", "cbrt")
"""Monotone increasing on all reals, so they commute with max/min of the terms. (log and sqrt
are monotone only on their domain: a term outside it would poison the max with NaN.)"""
UNARY_OTHER = ("log", "log1p", "log2", "log10", "sqrt", "abs", "sin", "cos", "tan", "sign",
               "square", "reciprocal", "logical_not",
               "isnan", "isinf", "isfinite", "arcsin", "arccos", "sinh", "cosh", "gelu",
               "silu", "softplus", "clip", "bitwise_not")


def _binary(name: str, partial_rules: list[Rule], doc: str = "") -> Signature:
    return Signature(name, tuple(shard_rules(2) + partial_rules), doc)


def _pp(op: str) -> Rule:
    return Rule((P(op), P(op)), P(op))


def _pr(op: str, out: str | None = None) -> Rule:
    return Rule((P(op), R), P(out or op))


def _rp(op: str, out: str | None = None) -> Rule:
    return Rule((R, P(op)), P(out or op))


BROADCAST_DOC = ("broadcasting binary op: a Replicate operand is cut locally to the other "
                 "operand's Shard (zero bytes move), dims aligned from the right; a Shard on a dim "
                 "that broadcasting stretches from size 1 matches no rule")

BINARY: dict[str, Signature] = {
    "add": _binary("add", [_pp("sum"), _pp("avg"), _pr("max"), _rp("max"), _pr("min"),
                           _rp("min")], BROADCAST_DOC),
    "sub": _binary("sub", [_pp("sum"), _pp("avg"), _pr("max"), _rp("max", "min"), _pr("min"),
                           _rp("min", "max")], BROADCAST_DOC),
    "mul": _binary("mul", [_pr("sum"), _rp("sum"), _pr("avg"), _rp("avg")], BROADCAST_DOC),
    "truediv": _binary("truediv", [_pr("sum"), _pr("avg")], BROADCAST_DOC),
    "maximum": _binary("maximum", [_pp("max"), _pr("max"), _rp("max")], BROADCAST_DOC),
    "minimum": _binary("minimum", [_pp("min"), _pr("min"), _rp("min")], BROADCAST_DOC),
}
for _name in ("floordiv", "mod", "pow", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
              "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "arctan2",
              "hypot"):
    BINARY[_name] = _binary(_name, [], BROADCAST_DOC)

UNARY: dict[str, Signature] = {}
for _name, _parts in UNARY_LINEAR.items():
    UNARY[_name] = _unary(_name, _parts, "linear: Partial(sum|avg) stays; Partial(max) <-> Partial(min)")
for _name in UNARY_MONOTONE:
    UNARY[_name] = _unary(_name, MONOTONE, "monotone increasing: commutes with Partial(max|min)")
for _name in UNARY_OTHER:
    UNARY[_name] = _unary(_name, ())

WHERE = Signature("where", tuple(shard_rules(3) + [
    Rule((R, P(op), P(op)), P(op)) for op in ALL_PARTIALS]),
    "where(cond, a, b): broadcasting; a Replicate cond selects between Partial terms")

LAYOUT_DOC = "layout op: Shard dims follow the data; any Partial stays"
REDUCE_DOC = ("Shard(r) on a reduced dim: each rank reduces its piece and the result is Partial; "
              "mean divides the local sum by the global count (exact on uneven pieces)")


SPREAD_DOC = ("the reduced dims must not be sharded (a variance is no single Partial term); over a "
              "sharded dim d, with one small explicit all-reduce of the means: m = x.mean(d, keepdim=True)"
              ".redistribute(placements=[Replicate()]); ((x - m) ** 2).mean(d) (sqrt of it for std), "
              "a Partial(\"sum\") result. ddof=0 (NumPy's default; torch's correction=1 is ddof=1)")


ARG_DOC = ("the dim must not be sharded: over a sharded dim each rank's best (value, global index) "
           "would have to be combined across ranks (MPI_MAXLOC), which is communication, and "
           "operators never communicate. Make that dim whole first (the suggested redistribute), or "
           "take the values alone with max/min (a Partial result)")


def _reduction(name: str, partial_out: str | None, keeps: tuple[str, ...]) -> Signature:
    rules = [Rule((S("d"),), S("d")), Rule((R,), R)]
    if partial_out:
        rules.append(Rule((S("r"),), P(partial_out)))
    rules += [Rule((P(p),), P(p)) for p in keeps]
    return Signature(name, tuple(rules), REDUCE_DOC if partial_out else
                     "reduced dims must not be sharded (no Partial reduce op for it)")


OTHER: dict[str, Signature] = {
    "astype": Signature("astype", (Rule((S("d"),), S("d")), Rule((R,), R)) + tuple(
        Rule((P(p),), P(p), note="only to a floating or complex dtype") for p in ALL_PARTIALS)),
    "clone": Signature("clone", (Rule((S("d"),), S("d")), Rule((R,), R)) + tuple(
        Rule((P(p),), P(p)) for p in ALL_PARTIALS)),
    "matmul": Signature("matmul", (
        Rule((S(-2), R), S(-2), note="rows of a: (Shard(0), Replicate()) -> Shard(0) for 2-D"),
        Rule((R, S(-1)), S(-1), note="columns of b: (Replicate(), Shard(1)) -> Shard(1) for 2-D"),
        Rule((S(-1), S(-2)), P("sum"), note='contraction dim: (Shard(1), Shard(0)) -> Partial("sum") for 2-D'),
        Rule((R, R), R),
        Rule((S("d"), S("d")), S("d"), note="batch dims"),
        Rule((S("d"), R), S("d"), slices=(1,), note="batch dims"),
        Rule((R, S("d")), S("d"), slices=(0,), note="batch dims"),
        _pr("sum"), _rp("sum"), _pr("avg"), _rp("avg"),
    ), "NumPy matmul semantics (1-D operands promoted, batch dims broadcast)"),
    "sum": _reduction("sum", "sum", LINEAR_PARTIALS),
    "mean": _reduction("mean", "sum", LINEAR_PARTIALS),
    "max": _reduction("max", "max", ("max",)),
    "min": _reduction("min", "min", ("min",)),
    "prod": _reduction("prod", None, ()),
    "all": replace(_reduction("all", "min", ()), doc=(
        'Shard(r) on a reduced dim: each rank reduces its piece and the result is Partial("min") '
        "(booleans: min is and; an empty piece gives True, the identity)")),
    "any": replace(_reduction("any", "max", ()), doc=(
        'Shard(r) on a reduced dim: each rank reduces its piece and the result is Partial("max") '
        "(booleans: max is or; an empty piece gives False, the identity)")),
    "std": replace(_reduction("std", None, ()), doc=SPREAD_DOC),
    "var": replace(_reduction("var", None, ()), doc=SPREAD_DOC),
    "argmax": replace(_reduction("argmax", None, ()), doc=ARG_DOC),
    "argmin": replace(_reduction("argmin", None, ()), doc=ARG_DOC),
    "softmax": Signature("softmax", (Rule((S("d"),), S("d")), Rule((R,), R)),
                         "the softmax dim must not be sharded; not defined on Partial"),
    "log_softmax": Signature("log_softmax", (Rule((S("d"),), S("d")), Rule((R,), R)),
                             "the softmax dim must not be sharded; not defined on Partial"),
    "transpose": Signature("transpose", (Rule((S("d"),), S("d")), Rule((R,), R)) + tuple(
        Rule((P(p),), P(p)) for p in ALL_PARTIALS), LAYOUT_DOC + " (d follows the permutation)"),
    "reshape": Signature("reshape", (Rule((S("d"),), S("d")), Rule((R,), R)) + tuple(
        Rule((P(p),), P(p)) for p in ALL_PARTIALS),
        "a sharded dim keeps its length and the product of the dims before it ([B, T, H] -> "
        "[B, T*H] keeps Shard(0)), or is the outermost dim of a block of dims that is split or "
        "merged where every rank's piece is the piece the new dim's Shard gives it, so no data "
        "moves ([B, T, 12] Shard(2) -> [B, T, 4, 3] Shard(2) at 4 ranks: one whole head each; "
        "not at 3 ranks, where 4 heads split 2/1/1). The decision uses the global shape and the "
        "mesh size only; also view, flatten, squeeze, unsqueeze"),
    "getitem": Signature("getitem", (Rule((S("d"),), S("d")), Rule((R,), R)) + tuple(
        Rule((P(p),), P(p)) for p in ALL_PARTIALS),
        "basic indexing (ints, slices, None, ...); sharded dims must be taken whole ([:]): x[a:b] "
        "of a sharded dim leaves the rows on the ranks that held them, not the split rule's "
        "balanced layout of the result, so it needs data movement. Slice after making that dim "
        "whole (the suggested redistribute; .redistribute(placements=[Shard(d)]) of the result "
        "cuts it back locally), or index an unsharded dim"),
    "cat": Signature("cat", (Rule((S("d"), S("d")), S("d")), Rule((R, R), R)) + tuple(
        Rule((P(p), P(p)), P(p)) for p in ALL_PARTIALS),
        "n inputs with equal placements (shown for two); the joined dim must not be sharded"),
    "stack": Signature("stack", (Rule((S("d"), S("d")), S("d")), Rule((R, R), R)) + tuple(
        Rule((P(p), P(p)), P(p)) for p in ALL_PARTIALS),
        "n inputs with equal placements (shown for two); the new dim is unsharded"),
}

def nary(sig: Signature, n: int) -> Signature:
    """``cat``/``stack`` rules for ``n`` inputs (the table shows two)."""
    rules = []
    for rule in sig.rules:
        rules.append(Rule((rule.inputs[0],) * n, rule.output, rule.slices, rule.communicates))
    return Signature(sig.op, tuple(rules), sig.doc)


__all__ = ["BINARY", "OTHER", "UNARY", "WHERE", "Pat", "nary", "shard_rules"]
