"""Gradients against float64 central finite differences of NumPy references, rule by rule.

For every operator and every forward rule of its signature (instantiated as in test_ops.py,
with real Partial terms that differ per rank), on uneven shapes including empty pieces: the
gradient of ``sum(f(x...) * C)`` (a random cotangent C) equals the finite-difference gradient
of the same NumPy function, and every gradient's placements are the ones the backward rule
declares (an input's Shard stays, a Partial input gets Replicate, a Replicate input gets
Partial("sum") from a sharded output and the output's placement otherwise). Rules that have
no gradient (Partial max/min) must raise PlacementError on every rank.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import test_ops
from conftest import SIZE, Checker
from test_ops import MATMUL_SHAPES, assert_all_rules_ran, dist, placement_for

import dtorch_mpi as dt
from dtorch_mpi.ops import functions as F

R = dt.Replicate()
rule_hits = test_ops.rule_hits  # the fixture that records which forward rules ran
op_tests_only_on_auto = pytest.mark.skipif(
    os.environ.get("DTORCH_COMM_PATH", "auto") != "auto",
    reason="operator backward never communicates: one collective path is enough")


def values(shape: tuple[int, ...], seed: int, low: float = 0.5, high: float = 2.0) -> np.ndarray:
    """Distinct non-integer values in an interval (no ties, no kinks of floor/abs/relu)."""
    return np.random.default_rng(seed).uniform(low, high, size=shape)


def numeric_grad(f: Callable[..., np.ndarray], arrays: Sequence[np.ndarray], i: int,
                 cot: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d sum(f(arrays) * cot) / d arrays[i] by central differences in float64."""
    base = [a.astype(np.float64).copy() for a in arrays]
    grad = np.zeros_like(base[i])
    flat = grad.reshape(-1)
    for j in range(base[i].size):
        plus = [a.copy() for a in base]
        minus = [a.copy() for a in base]
        plus[i].reshape(-1)[j] += eps
        minus[i].reshape(-1)[j] -= eps
        flat[j] = (np.sum(f(*plus) * cot) - np.sum(f(*minus) * cot)) / (2 * eps)
    return grad


def expected_grad_placement(inp: dt.Placement, out: dt.Placement) -> dt.Placement:
    if isinstance(inp, dt.Shard):
        return inp
    if isinstance(inp, dt.Partial):
        return R
    if isinstance(out, dt.Shard):
        return dt.Partial("sum")
    return out


def grad_check(fn: Callable[..., dt.DTensor], ref: Callable[..., np.ndarray], arrays: Sequence[np.ndarray],
               plcs: Sequence[list[dt.Placement]], mesh: dt.DeviceMesh, check: Checker, label: str,
               allow_placement_error: bool = False) -> None:
    """Forward ``fn`` on DTensors, backward ``sum(y * C)``, compare every input's gradient."""
    xs = [dist(a, mesh, p).requires_grad_() for a, p in zip(arrays, plcs)]
    try:
        y = fn(*xs)
    except dt.PlacementError:
        if allow_placement_error:
            return
        raise
    want = ref(*arrays)
    cot = values(want.shape, 99, -1.0, 1.0)
    c = dt.distribute_tensor(cot, mesh, [R] * mesh.ndim, src_data_rank=None)
    no_grad_rule = [p for p in y.placements if isinstance(p, dt.Partial) and p.reduce_op in ("max", "min")]
    no_grad_rule += [p for x in xs for p in x.placements if isinstance(p, dt.Partial) and p.reduce_op in ("max", "min")]
    if no_grad_rule:
        loss = (y.redistribute(placements=[R] * mesh.ndim) * c).sum()
        with pytest.raises(dt.PlacementError, match="no gradient through"):
            loss.backward()
        return
    loss = (y * c).sum()
    loss.backward()
    for i, x in enumerate(xs):
        if x.grad is None:
            check.true(False, f"{label}: input {i} got no gradient")
            continue
        check.equal(x.grad.to_torch(), numeric_grad(ref, arrays, i, cot), f"{label} d/d{i}",
                    exact=False, rtol=1e-5, atol=1e-6)
        want_plc = tuple(expected_grad_placement(pi, po) for pi, po in zip(x.placements, y.placements))
        if not any(isinstance(p, dt.Replicate) for p in x.placements) or all(
                isinstance(po, (dt.Shard, dt.Partial)) for po in y.placements):
            check.true(x.grad.placements == want_plc,
                       f"{label} d/d{i}: placements {x.grad.placements}, declared {want_plc}")


UNARY_REF: dict[str, tuple[Callable[[np.ndarray], np.ndarray], float, float]] = {
    "neg": (np.negative, 0.5, 2), "exp": (np.exp, 0.5, 2), "expm1": (np.expm1, 0.5, 2),
    "log": (np.log, 0.5, 2), "log1p": (np.log1p, 0.5, 2), "log2": (np.log2, 0.5, 2),
    "log10": (np.log10, 0.5, 2), "sqrt": (np.sqrt, 0.5, 2), "tanh": (np.tanh, -1, 1),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), -2, 2), "relu": (lambda x: np.maximum(x, 0), -2, 2),
    "silu": (lambda x: x / (1 + np.exp(-x)), -2, 2), "softplus": (lambda x: np.logaddexp(0, x), -2, 2),
    "abs": (np.abs, -2, 2), "sin": (np.sin, -2, 2), "cos": (np.cos, -2, 2), "tan": (np.tan, -1, 1),
    "square": (np.square, -2, 2), "reciprocal": (np.reciprocal, 0.5, 2), "arctan": (np.arctan, -2, 2),
    "arcsinh": (np.arcsinh, -2, 2), "cbrt": (np.cbrt, 0.5, 2), "arcsin": (np.arcsin, -0.9, 0.9),
    "arccos": (np.arccos, -0.9, 0.9), "sinh": (np.sinh, -2, 2), "cosh": (np.cosh, -2, 2),
    "floor": (np.floor, -2, 2), "ceil": (np.ceil, -2, 2), "trunc": (np.trunc, -2, 2),
    "rint": (np.rint, -2, 2), "sign": (np.sign, -2, 2), "clone": (lambda x: x.copy(), -2, 2),
}
UNARY_REF["gelu"] = (lambda x: 0.5 * x * (1 + np.vectorize(math.erf, otypes=[float])(x / np.sqrt(2))), -2, 2)


@op_tests_only_on_auto
@pytest.mark.parametrize("op", sorted(UNARY_REF))
def test_unary_backward_every_rule(op: str, mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    ref, low, high = UNARY_REF[op]
    sig = dt.signature(op)
    fn = getattr(dt, op) if op != "clone" else F.clone
    for n in (0, 1, SIZE + 1):
        full = values((n, 3), n, low, high)
        for rule in sig.rules:
            for d in (0, 1):
                plc = placement_for(rule.inputs[0], 2, d)
                if plc is not None:
                    grad_check(fn, ref, [full], [plc], mesh1d, check, f"{op} {plc} n={n}")
    check.done()
    assert_all_rules_ran(rule_hits, [op])


BINARY_REF = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.divide,
              "maximum": np.maximum, "minimum": np.minimum, "pow": np.power, "arctan2": np.arctan2,
              "hypot": np.hypot, "mod": np.mod}
BINARY_SHAPES = [((SIZE + 2, 3), (SIZE + 2, 3)), ((SIZE + 2, 3), (3,)), ((2, SIZE + 1), (1, SIZE + 1)),
                 ((0, 3), (0, 3))]


@op_tests_only_on_auto
@pytest.mark.parametrize("op", sorted(BINARY_REF))
def test_binary_backward_every_rule(op: str, mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    sig = dt.signature(op)
    for sa, sb in BINARY_SHAPES:
        out_shape = np.broadcast_shapes(sa, sb)
        A, B = values(sa, 1), values(sb, 2, 2.5, 4.0)
        for rule in sig.rules:
            for d in range(len(out_shape)):
                pa = placement_for(rule.inputs[0], len(sa), d - (len(out_shape) - len(sa)))
                pb = placement_for(rule.inputs[1], len(sb), d - (len(out_shape) - len(sb)))
                if pa is None or pb is None or any(
                        isinstance(p[0], dt.Shard) and s[p[0].dim] == 1 and out_shape[d] != 1
                        for p, s in ((pa, sa), (pb, sb))):
                    continue
                grad_check(lambda a, b: F.binary(op, a, b), BINARY_REF[op], [A, B], [pa, pb], mesh1d,
                           check, f"{op} {sa}{pa} {sb}{pb}")
    # a scalar operand gets no gradient, the tensor does
    A = values((SIZE + 1, 2), 3)
    for plc in ([dt.Shard(0)], [R]):
        grad_check(lambda a: F.binary(op, a, 1.5), lambda a: BINARY_REF[op](a, 1.5), [A], [plc], mesh1d,
                   check, f"{op} scalar {plc}")
    check.done()
    if sig.rules:
        assert_all_rules_ran(rule_hits, [op])


@op_tests_only_on_auto
def test_where_and_clip_and_astype_backward(mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    cond_full = values((SIZE + 2, 3), 5) > 1.2
    for rule in dt.signature("where").rules:
        for d in (0, 1):
            pl = [placement_for(p, 2, d) for p in rule.inputs]
            if any(p is None for p in pl):
                continue
            A, B = values((SIZE + 2, 3), 6), values((SIZE + 2, 3), 7)
            cond = dist(cond_full, mesh1d, pl[0])
            grad_check(lambda a, b: dt.where(cond, a, b), lambda a, b: np.where(cond_full, a, b), [A, B],
                       [pl[1], pl[2]], mesh1d, check, f"where {pl}", allow_placement_error=True)
    A = values((SIZE + 1, 3), 8, 0, 3)
    for plc in ([dt.Shard(0)], [R], [dt.Partial("sum")]):
        if not isinstance(plc[0], dt.Partial):
            grad_check(lambda a: a.clip(1.0, 2.0), lambda a: np.clip(a, 1.0, 2.0), [A], [plc], mesh1d, check, "clip")
        grad_check(lambda a: a.astype(np.float32).astype(np.float64), lambda a: a, [A], [plc], mesh1d, check,
                   "astype")
    check.done()


@op_tests_only_on_auto
def test_matmul_backward_every_rule(mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    sig = dt.signature("matmul")
    for sa, sb in MATMUL_SHAPES:
        A, B = values(sa, 3), values(sb, 4)
        for rule in sig.rules:
            for d in range(3):
                nd = max(len(sa), len(sb))
                pa = placement_for(rule.inputs[0], len(sa), d - (nd - len(sa)))
                pb = placement_for(rule.inputs[1], len(sb), d - (nd - len(sb)))
                if pa is None or pb is None:
                    continue
                grad_check(lambda a, b: a @ b, np.matmul, [A, B], [pa, pb], mesh1d, check,
                           f"matmul {sa}{pa} @ {sb}{pb}", allow_placement_error=True)
    check.done()
    assert_all_rules_ran(rule_hits, ["matmul"])


@op_tests_only_on_auto
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
def test_reduction_backward_every_rule(op: str, mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    ref = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op]
    plcs = [[dt.Shard(0)], [dt.Shard(1)], [dt.Shard(2)], [R]] + [[dt.Partial(p)] for p in ("sum", "avg", "max", "min")]
    for n in (1, SIZE + 1):
        full = values((n, 3, 2), n)
        for plc in plcs:
            for dim in (None, 0, (0, 2), -1):
                for keepdim in (False, True):
                    grad_check(lambda x: getattr(dt, op)(x, dim=dim, keepdim=keepdim),
                               lambda x: ref(x, axis=dim, keepdims=keepdim), [full], [plc], mesh1d, check,
                               f"{op} {plc} dim={dim} keep={keepdim} n={n}", allow_placement_error=True)
    check.done()
    assert_all_rules_ran(rule_hits, [op])


def _softmax_ref(x: np.ndarray, axis: int, log: bool) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    s = e.sum(axis=axis, keepdims=True)
    return np.log(e / s) if log else e / s


@op_tests_only_on_auto
def test_layout_and_softmax_backward_every_rule(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, rule_hits: set,
                                                check: Checker) -> None:
    plcs = [[dt.Shard(0)], [dt.Shard(1)], [dt.Shard(2)], [R]] + [[dt.Partial(p)] for p in ("sum", "avg", "max", "min")]
    cases: list[tuple[str, Callable[..., Any], Callable[..., Any]]] = [
        ("transpose", lambda x: x.transpose(0, 2), lambda a: a.transpose(2, 1, 0)),
        ("permute", lambda x: x.permute(1, 2, 0), lambda a: a.transpose(1, 2, 0)),
        ("reshape", lambda x: x.reshape(x.shape[0], 6), lambda a: a.reshape(a.shape[0], 6)),
        ("flatten", lambda x: x.flatten(1), lambda a: a.reshape(a.shape[0], 6)),
        ("unsqueeze", lambda x: x.unsqueeze(1), lambda a: a[:, None]),
        ("getitem", lambda x: x[:, 1], lambda a: a[:, 1]),
        ("getitem", lambda x: x[..., 1:], lambda a: a[..., 1:]),
        ("getitem", lambda x: x[:, None, 2, ::-1], lambda a: a[:, None, 2, ::-1]),
        ("cat", lambda x: dt.cat([x, x], dim=1), lambda a: np.concatenate([a, a], 1)),
        ("stack", lambda x: dt.stack([x, x], dim=1), lambda a: np.stack([a, a], 1)),
        ("softmax", lambda x: x.softmax(1), lambda a: _softmax_ref(a, 1, False)),
        ("log_softmax", lambda x: dt.log_softmax(x, 2), lambda a: _softmax_ref(a, 2, True)),
    ]
    for n in (0, SIZE + 1):
        full = values((n, 3, 2), 11)
        for plc in plcs:
            for name, fn, ref in cases:
                grad_check(fn, ref, [full], [plc], mesh1d, check, f"{name} {plc} n={n}",
                           allow_placement_error=True)
    t = values((SIZE + 1, 3), 12)
    grad_check(lambda x: x.T, lambda a: a.T, [t], [[dt.Shard(0), dt.Shard(1)]], mesh2d, check, "T 2-D mesh")
    check.done()
    assert_all_rules_ran(rule_hits, ["transpose", "reshape", "getitem", "cat", "stack", "softmax"])
