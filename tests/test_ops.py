"""Operators against NumPy on the complete arrays, with cases generated from the rule tables.

Every rule of every tested signature is instantiated (Shard(d) on each dim, real Partial
terms that differ per rank) and the test asserts that every rule ran. Illegal combinations
must raise PlacementError on every rank, and the suggested `.redistribute(...)` must make the
call legal and correct.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import SIZE, Checker
from hypothesis import given
from hypothesis import strategies as st
from test_redistribute import make_pieces

import dtorch_mpi as dt
from dtorch_mpi.ops import dispatch
from dtorch_mpi.ops import functions as F
from dtorch_mpi.ops.signature import Pat

PARTIAL_OPS = ("sum", "avg", "max", "min")
ALL_1D = [dt.Shard(0), dt.Shard(1), dt.Replicate()] + [dt.Partial(op) for op in PARTIAL_OPS]


def positive(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Integer-valued floats in [1, 9]: exact sums, in every op's domain."""
    return np.random.default_rng(seed).integers(1, 10, size=shape).astype(np.float64)


def dist(full: np.ndarray, mesh: dt.DeviceMesh, placements: list[dt.Placement]) -> dt.DTensor:
    pieces = make_pieces(full, mesh, placements)
    if any(isinstance(p, dt.Partial) and p.reduce_op == "avg" for p in placements):
        pieces = dt.distribute_tensor(full, mesh, placements).to_local()
    return dt.DTensor.from_local(pieces, mesh, placements, shape=full.shape)


def placement_for(pat: Pat, ndim: int, d: int) -> list[dt.Placement] | None:
    """The concrete placement(s) a pattern stands for, given the chosen dim ``d``."""
    if pat.kind == "R":
        return [dt.Replicate()]
    if pat.kind == "P":
        return [dt.Partial(str(pat.arg))]
    if isinstance(pat.arg, int):
        return [dt.Shard(ndim + pat.arg)] if ndim + pat.arg >= 0 else None
    return [dt.Shard(d)] if 0 <= d < ndim else None


@pytest.fixture
def rule_hits() -> Any:
    dispatch.RULE_HITS = set()
    for info_fn in (F._plan_elementwise, F._plan_matmul, F._plan_reduce, F._plan_softmax,
                    F._plan_permute, F._plan_reshape, F._plan_getitem, F._plan_join):
        info_fn.cache_clear()
    yield dispatch.RULE_HITS
    dispatch.RULE_HITS = None


def assert_all_rules_ran(hits: set, ops: list[str]) -> None:
    missing = [(op, i, r) for op in ops for i, r in enumerate(dt.signature(op).rules)
               if (op, i) not in hits]
    assert not missing, "rules never exercised: " + "; ".join(f"{op}[{i}] {r!r}" for op, i, r in missing)


UNARY_REF: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "relu": lambda x: np.maximum(x, 0),
    "abs": np.abs, "sin": np.sin, "square": np.square, "floor": np.floor, "sign": np.sign,
    "arcsinh": np.arcsinh, "rint": np.rint,
}


@pytest.mark.parametrize("op", sorted(UNARY_REF))
def test_unary_every_rule(op: str, mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    sig = dt.signature(op)
    for n in (0, 1, SIZE + 1, 7):
        full = positive((n, 5), seed=n)
        for rule in sig.rules:
            for d in (0, 1):
                plc = placement_for(rule.inputs[0], 2, d)
                if plc is None:
                    continue
                y = getattr(dt, op)(dist(full, mesh1d, plc))
                check.equal(y.to_torch(), UNARY_REF[op](full), f"{op} {plc} n={n}", exact=False)
    check.done()
    assert_all_rules_ran(rule_hits, [op])


BINARY_REF = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.divide,
              "maximum": np.maximum, "minimum": np.minimum, "pow": np.power, "lt": np.less,
              "eq": np.equal, "mod": np.mod}


@pytest.mark.parametrize("op", sorted(BINARY_REF))
def test_binary_every_rule_with_broadcasting(op: str, mesh1d: dt.DeviceMesh, rule_hits: set,
                                             check: Checker) -> None:
    sig = dt.signature(op)
    shapes = [((SIZE + 2, 4), (SIZE + 2, 4)), ((SIZE + 2, 4), (4,)), ((3, SIZE + 1), (1, SIZE + 1)),
              ((0, 3), (0, 3)), ((1, 2), (1, 2))]
    for sa, sb in shapes:
        A, B = positive(sa, 1), positive(sb, 2)
        for rule in sig.rules:
            for d in range(len(np.broadcast_shapes(sa, sb))):
                out_nd = len(np.broadcast_shapes(sa, sb))
                pa = placement_for(rule.inputs[0], len(sa), d - (out_nd - len(sa)))
                pb = placement_for(rule.inputs[1], len(sb), d - (out_nd - len(sb)))
                if pa is None or pb is None:
                    continue
                if any(isinstance(p, dt.Shard) and s[p.dim] == 1 and out_s != 1 for p, s, out_s in
                       ((pa[0], sa, np.broadcast_shapes(sa, sb)[d]), (pb[0], sb, np.broadcast_shapes(sa, sb)[d]))):
                    continue  # a stretched shard: covered by the error test
                a, b = dist(A, mesh1d, pa), dist(B, mesh1d, pb)
                with dt.CommCounter() as moved:
                    y = F.binary(op, a, b)
                check.true(moved.count == 0, f"{op}: an operator communicated")
                check.equal(y.to_torch(), BINARY_REF[op](A, B), f"{op} {sa}{pa} {sb}{pb}", exact=False)
    # scalars act as Replicate
    A = positive((SIZE + 1, 3))
    for plc in ([dt.Shard(0)], [dt.Replicate()]):
        check.equal(F.binary(op, dist(A, mesh1d, plc), 2).to_torch(), BINARY_REF[op](A, 2), f"{op} scalar", exact=False)
        check.equal(F.binary(op, 3, dist(A, mesh1d, plc)).to_torch(), BINARY_REF[op](3, A), f"{op} rscalar", exact=False)
    check.done()
    assert_all_rules_ran(rule_hits, [op] if op in ("add", "sub", "mul", "truediv", "maximum",
                                                    "minimum") else [])


def test_python_operators_and_inplace(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    A, B = positive((SIZE + 2, 3), 1), positive((SIZE + 2, 3), 2)
    a, b = dist(A, mesh1d, [dt.Shard(0)]), dist(B, mesh1d, [dt.Shard(0)])
    for got, want, what in [
        (a + b, A + B, "+"), (a - b, A - B, "-"), (a * b, A * B, "*"), (a / b, A / B, "/"),
        (a // b, A // B, "//"), (a % b, A % B, "%"), (a ** 2, A ** 2, "**"), (-a, -A, "neg"),
        (2 - a, 2 - A, "rsub"), (1 / a, 1 / A, "rdiv"), (abs(a - 5), abs(A - 5), "abs"),
        (a < b, A < B, "<"), (a >= b, A >= B, ">="), (a == b, A == B, "=="), (a != b, A != B, "!="),
        ((a > 3) & (b > 3), (A > 3) & (B > 3), "&"), (~(a > 3), ~(A > 3), "~"),
        (dt.where(a > b, a, b), np.where(A > B, A, B), "where"), (a.clip(2, 5), A.clip(2, 5), "clip"),
        (a.astype(np.float32), A.astype(np.float32), "astype"), (a.clone(), A, "clone"),
    ]:
        check.equal(got.to_torch(), want, what, exact=False)
    c = a.clone()
    local = c.to_local()
    c += b
    c *= 2
    check.true(c.to_local() is local, "in-place op replaced the piece")
    check.equal(c.to_torch(), (A + B) * 2, "in-place")
    c.sub_(b).div_(2)
    check.equal(c.to_torch(), ((A + B) * 2 - B) / 2, "add_/div_")
    check.done()
    with pytest.raises(dt.PlacementError, match="in-place add would change"):
        r = dist(A, mesh1d, [dt.Replicate()])
        r += a


MATMUL_SHAPES = [((SIZE + 2, 4), (4, 3)), ((4, SIZE + 1), (SIZE + 1, 2)), ((2, SIZE + 1, 4), (4, 3)),
                 ((2, 3, 4), (2, 4, SIZE)), ((SIZE + 2, 4), (4,)), ((4,), (4, SIZE + 1)), ((0, 3), (3, 2))]


def test_matmul_every_rule(mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    sig = dt.signature("matmul")
    for sa, sb in MATMUL_SHAPES:
        A, B = positive(sa, 3), positive(sb, 4)
        want = A @ B
        for rule in sig.rules:
            for d in range(3):
                pa = placement_for(rule.inputs[0], len(sa), d - (max(len(sa), len(sb)) - len(sa)))
                pb = placement_for(rule.inputs[1], len(sb), d - (max(len(sa), len(sb)) - len(sb)))
                if pa is None or pb is None:
                    continue
                try:
                    y = dist(A, mesh1d, pa) @ dist(B, mesh1d, pb)
                except dt.PlacementError:
                    continue  # e.g. Shard(d) landing on a matrix dim: not this rule
                check.equal(y.to_torch(), want, f"matmul {sa}{pa} @ {sb}{pb}", exact=False)
    check.done()
    assert_all_rules_ran(rule_hits, ["matmul"])


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
def test_reductions_every_rule(op: str, mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    ref = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op]
    for n in (1, SIZE - 1 or 1, SIZE + 1, 2 * SIZE + 1):
        full = positive((n, 3, 2), seed=n)
        for plc in ALL_1D + [dt.Shard(2)]:
            for dim in (None, 0, 1, (0, 2), -1):
                for keepdim in (False, True):
                    try:
                        y = getattr(dt, op)(dist(full, mesh1d, [plc]), dim=dim, keepdim=keepdim)
                    except dt.PlacementError:
                        continue
                    want = ref(full, axis=dim, keepdims=keepdim)
                    check.equal(y.to_torch(), want, f"{op} {plc} dim={dim} keep={keepdim} n={n}",
                                exact=False, rtol=1e-9)
    check.done()
    assert_all_rules_ran(rule_hits, [op])


def test_mean_of_uneven_shards_is_the_true_mean(mesh1d: dt.DeviceMesh) -> None:
    full = np.arange(2 * SIZE + 1, dtype=np.float64) ** 2
    m = dt.distribute_tensor(full, mesh1d, [dt.Shard(0)]).mean()
    assert m.placements == (dt.Partial("sum"),)
    assert np.isclose(m.to_torch(), full.mean())


def test_layout_ops(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    full = positive((SIZE + 1, 3, 4), 5)
    for plc in ALL_1D + [dt.Shard(2)]:
        x = dist(full, mesh1d, [plc])
        cases = [
            (lambda: x.transpose(0, 2), full.transpose(2, 1, 0)), (lambda: x.permute(1, 2, 0), full.transpose(1, 2, 0)),
            (lambda: x.swapaxes(1, 2), full.swapaxes(1, 2)),
            (lambda: x.reshape(SIZE + 1, 12), full.reshape(SIZE + 1, 12)),
            (lambda: x.reshape(-1, 4), full.reshape(-1, 4)),
            (lambda: x.flatten(1), full.reshape(SIZE + 1, 12)), (lambda: x.unsqueeze(1), full[:, None]),
            (lambda: x.unsqueeze(0).squeeze(0), full),
            (lambda: x[:, 1], full[:, 1]), (lambda: x[..., 1:3], full[..., 1:3]), (lambda: x[:, None, 2, ::-1], full[:, None, 2, ::-1]),
            (lambda: dt.cat([x, x], dim=1), np.concatenate([full, full], 1)),
            (lambda: dt.stack([x, x], dim=1), np.stack([full, full], 1)),
            (lambda: x.softmax(1), np.exp(full) / np.exp(full).sum(1, keepdims=True)),
            (lambda: dt.log_softmax(x, 2), full - np.log(np.exp(full).sum(2, keepdims=True))),
            (lambda: x.argmax(1), full.argmax(1)), (lambda: x.argmin(2), full.argmin(2)),
        ]
        for make, want in cases:
            try:
                got = make()
            except dt.PlacementError:
                continue
            check.equal(got.to_torch(), want, f"layout {plc}", exact=False)
    t = dist(full[0], mesh2d, [dt.Shard(0), dt.Shard(1)])
    check.equal(t.T.to_torch(), full[0].T, "T on 2-D mesh")
    check.true(t.T.placements == (dt.Shard(1), dt.Shard(0)), "T swaps shard dims")
    check.done()
    assert_all_rules_ran(rule_hits, ["transpose", "reshape", "getitem", "cat", "stack", "softmax"])


def _suggested_fixes(message: str) -> list[tuple[str, list[dt.Placement]]]:
    found = re.findall(r"(\w+(?:\[\d+\])?) = \S+\.redistribute\(placements=(\[.*\])\)", message)
    assert found, message
    names = {n: getattr(dt, n) for n in ("Shard", "Replicate", "Partial")}
    return [(who, eval(text, names)) for who, text in found]


def test_every_illegal_combination_raises_with_a_working_fix(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    A, B = positive((SIZE + 2, 4), 1), positive((SIZE + 2, 4), 2)
    W = positive((4, 3), 3)
    cases: list[tuple[str, Callable[..., Any], Callable[..., np.ndarray], list[np.ndarray]]] = [
        ("add", lambda a, b: a + b, np.add, [A, B]),
        ("mul", lambda a, b: a * b, np.multiply, [A, B]),
        ("maximum", dt.maximum, np.maximum, [A, B]),
        ("matmul", lambda a, b: a @ b, np.matmul, [A, W]),
        ("exp", dt.exp, np.exp, [A]),
        ("sum0", lambda a: a.sum(0), lambda a: a.sum(0), [A]),
        ("softmax", lambda a: a.softmax(1), lambda a: np.exp(a) / np.exp(a).sum(1, keepdims=True), [A]),
    ]
    raised = 0
    for name, fn, ref, fulls in cases:
        for combo in itertools.product(ALL_1D, repeat=len(fulls)):
            args = [dist(f, mesh1d, [p]) for f, p in zip(fulls, combo)]
            try:
                got = fn(*args)
            except dt.PlacementError as err:
                raised += 1
                msg = str(err)
                check.true("No data is moved implicitly" in msg and "Accepted rules" in msg, f"{name}: message")
                for who, fix in _suggested_fixes(msg):
                    idx = {"x": 0, "a": 0, "b": 1}[who]
                    args[idx] = args[idx].redistribute(placements=fix)
                try:
                    got = fn(*args)
                except dt.PlacementError as again:
                    check.true(False, f"{name} {combo}: the suggested fix did not work: {again}")
                    continue
            check.equal(got.to_torch(), ref(*fulls), f"{name} {combo}", exact=False)
    check.true(raised > 20, f"only {raised} illegal combinations")
    check.done()


def test_stretched_shard_and_mismatches_are_errors(mesh1d: dt.DeviceMesh) -> None:
    a = dt.ones(1, 4, device_mesh=mesh1d, placements=[dt.Shard(0)])
    b = dt.ones(SIZE + 1, 4, device_mesh=mesh1d, placements=[dt.Replicate()])
    with pytest.raises(dt.PlacementError, match="add: no rule"):
        a + b
    with pytest.raises(dt.ShapeMismatchError, match="do not broadcast"):
        dt.ones(3, device_mesh=mesh1d) + dt.ones(4, device_mesh=mesh1d)
    with pytest.raises(TypeError, match="make it one explicitly"):
        b + np.ones(4)
    with pytest.raises(dt.PlacementError, match="add: no rule"):
        dt.ones(2, device_mesh=mesh1d, placements=[dt.Partial()]) + 1
    with pytest.raises(dt.PlacementError, match=r"not linear|does not commute"):
        dt.ones(2, device_mesh=mesh1d, placements=[dt.Partial()]).astype(np.int32)
    with dt.init_device_mesh("cpu", (SIZE,)) as other:
        c = dt.ones(SIZE + 1, 4, device_mesh=other)
        assert c.device_mesh == b.device_mesh  # equal by value: the same ranks
    with pytest.raises(TypeError, match="advanced indexing"):
        b[np.array([0])]
    with pytest.raises(dt.ShapeMismatchError, match="inner dims"):
        b @ dt.ones(3, 2, device_mesh=mesh1d)


def test_operators_never_communicate_and_replicate_slices_are_free(mesh1d: dt.DeviceMesh) -> None:
    x = dt.ones(2 * SIZE + 1, 6, device_mesh=mesh1d, placements=[dt.Shard(0)])
    bias = dt.ones(6, device_mesh=mesh1d)
    rows = dt.ones(2 * SIZE + 1, 1, device_mesh=mesh1d)
    with dt.CommCounter() as moved:
        y = x + bias
        z = x * rows
        w = (x @ dt.ones(6, 2, device_mesh=mesh1d)).sum(1)
    assert moved.count == 0 and moved.bytes_sent == 0
    assert y.placements == z.placements == w.placements == (dt.Shard(0),)


def test_signatures_are_readable_data() -> None:
    sig = dt.signature("matmul")
    text = repr(sig)
    assert "(Shard(-2), Replicate()) -> Shard(-2)" in text
    assert '(Shard(-1), Shard(-2)) -> Partial("sum")' in text
    assert dt.signature("permute") is dt.signature("transpose")
    with pytest.raises(KeyError, match="no operator named"):
        dt.signature("frobnicate")


def test_inference_cache_is_bounded() -> None:
    from dtorch_mpi.ops.dispatch import INFERENCE_CACHE_SIZE

    for info in F.cache_info().values():
        assert info.maxsize == INFERENCE_CACHE_SIZE


def test_2d_mesh_each_dim_matched_on_its_own(mesh2d: dt.DeviceMesh, check: Checker) -> None:
    A, W = positive((5, 4), 1), positive((4, 3), 2)
    combos = [([dt.Shard(0), dt.Shard(1)], [dt.Replicate(), dt.Shard(0)]),
              ([dt.Shard(0), dt.Replicate()], [dt.Replicate(), dt.Shard(1)]),
              ([dt.Partial(), dt.Shard(1)], [dt.Replicate(), dt.Shard(0)])]
    for pa, pb in combos:
        y = dist(A, mesh2d, pa) @ dist(W, mesh2d, pb)
        check.equal(y.to_torch(), A @ W, f"{pa} @ {pb}", exact=False)
    s = dist(A, mesh2d, [dt.Shard(0), dt.Shard(0)])
    check.equal((s + dist(A, mesh2d, [dt.Replicate(), dt.Replicate()])).to_torch(), 2 * A, "nested + R")
    check.equal(s.mean(0).to_torch(), A.mean(0), "nested mean", exact=False)
    check.done()


@given(
    rows=st.integers(0, 9), cols=st.integers(1, 5),
    pa=st.sampled_from(ALL_1D[:3] + [dt.Partial("sum")]), pb=st.sampled_from(ALL_1D[:3]),
    op=st.sampled_from(["add", "mul", "sub", "maximum"]),
)
def test_property_binary_ops(mesh1d: dt.DeviceMesh, rows: int, cols: int, pa: Any, pb: Any, op: str) -> None:
    A, B = positive((rows, cols), rows), positive((rows, cols), cols)
    try:
        y = F.binary(op, dist(A, mesh1d, [pa]), dist(B, mesh1d, [pb]))
    except dt.PlacementError as err:
        assert ".redistribute(placements=" in str(err)
        return
    assert np.allclose(y.to_torch(), BINARY_REF[op](A, B))


def test_cached_plans_never_outlive_their_mesh() -> None:
    """Regression: a plan cached for a freed mesh over the same ranks must not be reused."""
    with dt.init_device_mesh("cpu", (SIZE,)) as first:
        (dt.ones(4, device_mesh=first) * 2).to_torch()
    with dt.init_device_mesh("cpu", (SIZE,)) as second:
        y = dt.ones(4, device_mesh=second) * 2
        assert y.device_mesh is second
        assert np.array_equal(y.redistribute(placements=[dt.Shard(0)]).to_torch(), np.full(4, 2.0, np.float32))
