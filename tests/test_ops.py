"""Operators against NumPy on the complete arrays, with cases generated from the rule tables.

Every rule of every tested signature is instantiated (Shard(d) on each dim, real Partial
terms that differ per rank) and the test asserts that every rule ran. Illegal combinations
must raise PlacementError on every rank, and the suggested `.redistribute(...)` must make the
call legal and correct. The generated tests run once per array backend (``xp_mesh1d``:
NumPy, and CuPy where every rank has a GPU).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import SIZE, Checker
from helpers import MATMUL_SHAPES, assert_all_rules_ran, dist, placement_for
from hypothesis import given
from hypothesis import strategies as st

import dtorch_mpi as dt
from dtorch_mpi.ops import OPS, Op, apply, planners

PARTIAL_OPS = ("sum", "avg", "max", "min")
ALL_1D = [dt.Shard(0), dt.Shard(1), dt.Replicate()] + [dt.Partial(op) for op in PARTIAL_OPS]


def positive(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Integer-valued floats in [1, 9]: exact sums, in every op's domain."""
    return np.random.default_rng(seed).integers(1, 10, size=shape).astype(np.float64)


# --- generated from the declarations: every operator, every rule ------------------------------
def sample(domain: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Test values in an operand's declared domain."""
    rng = np.random.default_rng(seed)
    if domain == "unit":
        return rng.integers(-4, 5, size=shape) / 4.0
    if domain == "int":
        return rng.integers(1, 10, size=shape)
    if domain == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    return positive(shape, seed)


def _elementwise_cases(op: Op, mesh: dt.DeviceMesh) -> Any:
    """Cases are (inputs as (full value, placements or None for a scalar), call on the
    distributed inputs, NumPy reference, label). Every rule on broadcasting shapes (even, uneven, empty, length 1), Shard on every dim,
    with each declared parameter example; scalars act as Replicate."""
    arity = len(op.signature.rules[0].inputs)
    fn = op.functions.get(op.name) or (lambda *xs, **kw: apply.apply_elementwise(op, xs, kw))
    shape_sets = {1: [((n, 5),) for n in (0, 1, SIZE + 1, 7)],
                  2: [((SIZE + 2, 4), (SIZE + 2, 4)), ((SIZE + 2, 4), (4,)), ((3, SIZE + 1), (1, SIZE + 1)),
                      ((0, 3), (0, 3)), ((1, 2), (1, 2))],
                  3: [((SIZE + 2, 3),) * 3, ((SIZE + 1, 3), (3,), (SIZE + 1, 3)), ((0, 2),) * 3]}[arity]
    domains = op.domain if len(op.domain) == arity else op.domain[:1] * arity
    for shapes in shape_sets:
        fulls = [sample(dom, sh, i + sum(sh)) for i, (dom, sh) in enumerate(zip(domains, shapes))]
        out_shape = np.broadcast_shapes(*shapes)
        for rule in op.signature.rules:
            for d in range(len(out_shape)):
                plcs = [placement_for(pat, len(sh), d - (len(out_shape) - len(sh)))
                        for pat, sh in zip(rule.inputs, shapes)]
                if any(p is None for p in plcs):
                    continue
                if any(isinstance(p[0], dt.Shard) and sh[p[0].dim] == 1 and out_shape[d] != 1
                       for p, sh in zip(plcs, shapes)):  # type: ignore[index]
                    continue  # a stretched shard: covered by the error tests
                for params in op.examples:
                    yield (list(zip(fulls, plcs)), lambda args, params=params: fn(*args, **params),
                           lambda fulls=fulls, params=params: op.reference(*fulls, **params),
                           f"{op.name}{params} {shapes} {plcs}")
    if arity == 2:  # a scalar operand on either side
        A = sample(op.domain[0], (SIZE + 1, 3), 7)
        for plc in ([dt.Shard(0)], [dt.Replicate()]):
            yield [(A, plc), (2, None)], lambda args: fn(*args), lambda: op.reference(A, 2), f"{op.name} scalar"
            yield [(3, None), (A, plc)], lambda args: fn(*args), lambda: op.reference(3, A), f"{op.name} rscalar"


def _reduce_cases(op: Op, mesh: dt.DeviceMesh) -> Any:
    fn = op.functions[op.name]
    arg = op.name.startswith("arg")
    boolean = op.domain[0] == "bool"  # all/any: no Partial terms of booleans to build
    for n in (1, SIZE - 1 or 1, SIZE + 1, 2 * SIZE + 1):
        full = sample(op.domain[0], (n, 3, 2), n)
        for plc in (ALL_1D[:3] if boolean else ALL_1D) + [dt.Shard(2)]:
            for dim in ((None, 0, 1, -1) if arg else (None, 0, 1, (0, 2), -1)):
                for keepdim in (False, True):
                    keep = keepdim and not (arg and dim is None)  # argmax of the flattened tensor: a scalar
                    want = (lambda dim=dim, keep=keep: op.reference(full, axis=dim, keepdims=keep))
                    yield ([(full, [plc])], lambda args, dim=dim, keepdim=keepdim: fn(*args, dim, keepdim),
                           want, f"{op.name} {plc} dim={dim} keepdim={keepdim} n={n}")


def _along_dim_cases(op: Op, mesh: dt.DeviceMesh) -> Any:
    fn = op.functions[op.name]
    for n in (0, 1, SIZE + 1, 2 * SIZE + 1):
        full = positive((n, 3, 2), seed=n)
        for plc in ALL_1D + [dt.Shard(2)]:
            for dim in (0, 1, 2, -1):
                yield ([(full, [plc])], lambda args, dim=dim: fn(*args, dim),
                       lambda dim=dim: op.reference(full, dim), f"{op.name} {plc} dim={dim} n={n}")



def _matmul_cases(op: Op, mesh: dt.DeviceMesh) -> Any:
    fn = op.functions[op.name]
    for sa, sb in MATMUL_SHAPES:
        A, B = positive(sa, 3), positive(sb, 4)
        nd = max(len(sa), len(sb))
        for rule in op.signature.rules:
            for d in range(3):
                if d >= nd - 2 and any(p.kind == "S" and not isinstance(p.arg, int) for p in rule.inputs):
                    continue  # Shard(d) rules are for batch dims only: every case here is a rule's
                if len(sb) == 1 and rule.inputs[1].kind == "S" and rule.inputs[1].arg == -1:
                    continue  # a 1-D b has no columns: its one dim is contracted (NumPy semantics)
                pa = placement_for(rule.inputs[0], len(sa), d - (nd - len(sa)))
                pb = placement_for(rule.inputs[1], len(sb), d - (nd - len(sb)))
                if pa is not None and pb is not None:
                    yield ([(A, pa), (B, pb)], lambda args: fn(*args),
                           lambda: op.reference(A, B), f"{op.name} {sa}{pa} @ {sb}{pb}")


def _layout_cases(op: Op, mesh: dt.DeviceMesh) -> Any:
    full = positive((SIZE + 1, 3, 4), 5)
    calls: dict[Any, list[tuple[Callable[..., dt.DTensor], Callable[[], Any]]]] = {
        planners.plan_permute: [
            (lambda x, p=p: apply.apply_permute(op, x, p), lambda p=p: op.reference(full, p))
            for p in itertools.permutations(range(3))],
        planners.plan_reshape: [
            (lambda x, s=s: apply.apply_reshape(op, x, s), lambda s=s: op.reference(full, s))
            for s in [(SIZE + 1, 12), (-1, 4), (SIZE + 1, 3, 2, 2), (1, SIZE + 1, 12), (SIZE + 1, 1, 3, 4)]],
        planners.plan_getitem: [
            (lambda x, k=k: apply.apply_getitem(op, x, k), lambda k=k: op.reference(full, k))
            for k in [(slice(None), 1), (Ellipsis, slice(1, 3)), (slice(None), None, 2, slice(None, None, -1)), 0]],
        planners.plan_cat: [
            (lambda x, y, d=d: apply.apply_join(op, [x, y], d, False), lambda d=d: op.reference([full, full], d))
            for d in (0, 1, 2)],
        planners.plan_stack: [
            (lambda x, y, d=d: apply.apply_join(op, [x, y], d, True), lambda d=d: op.reference([full, full], d))
            for d in (0, 1, 3)],
    }
    arity = 2 if op.planner in (planners.plan_cat, planners.plan_stack) else 1
    for plc in ALL_1D + [dt.Shard(2)]:
        for make, want in calls[op.planner]:
            yield [(full, [plc])] * arity, lambda args, make=make: make(*args), want, f"{op.name} {plc}"


RULE_CASES = {planners.plan_elementwise, planners.plan_matmul}
"""Planners whose cases are instances of the declared rules, so none may be refused; the others'
cases sweep every placement, and a refused one must name a fix that works."""

CASES: dict[Any, Callable[[Op, dt.DeviceMesh], Any]] = {
    planners.plan_elementwise: _elementwise_cases, planners.plan_reduce: _reduce_cases,
    planners.plan_along_dim: _along_dim_cases, planners.plan_matmul: _matmul_cases,
    planners.plan_permute: _layout_cases, planners.plan_reshape: _layout_cases,
    planners.plan_getitem: _layout_cases, planners.plan_cat: _layout_cases, planners.plan_stack: _layout_cases,
}


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.path_independent  # operators never communicate (one path is enough)
def test_every_declared_op_every_rule(name: str, xp_mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    """Generated from the declaration: every rule instantiated on uneven and empty shapes, the
    result equal to the op's NumPy reference, no communication, and every rule exercised."""
    op = OPS[name]
    assert op.planner in CASES, f"{name}: no generated cases for planner {op.planner.__name__}"
    ran = refused = 0
    for inputs, call, want, what in CASES[op.planner](op, xp_mesh1d):
        args = [value if plc is None else dist(value, xp_mesh1d, plc) for value, plc in inputs]
        try:
            with dt.CommCounter() as moved:
                got = call(args)
        except dt.PlacementError as err:  # e.g. Shard(d) on a dim the op removes: the fix must work
            refused += 1
            check.true(op.planner not in RULE_CASES, f"{what}: a declared rule's case was refused: {err}")
            for who, fix in _suggested_fixes(str(err)):
                i = int(who[8:-1]) if who.startswith("tensors[") else {"x": 0, "a": 0, "b": 1, "c": 2}[who]
                args[i] = args[i].redistribute(placements=fix)
            try:
                got = call(args)
            except dt.PlacementError as again:
                check.true(False, f"{what}: the suggested fix did not work: {again}")
                continue
            check.equal(got.to_torch(), want(), f"{what} after the suggested fix", exact=False, rtol=1e-9, atol=1e-12)
            continue
        except ValueError as err:  # max/min of an empty dim: NumPy raises too
            with pytest.raises(ValueError):
                want()
            check.true("zero-size" in str(err), f"{what}: {err}")
            continue
        ran += 1
        check.true(moved.count == 0, f"{what}: an operator communicated")
        check.equal(got.to_torch(), want(), what, exact=False, rtol=1e-9, atol=1e-12)
    check.true(ran > 0, f"{name}: no case ran")
    check.done()
    assert_all_rules_ran(rule_hits, [name])


@pytest.mark.path_independent  # operators never communicate (one path is enough)
def test_python_operators_and_inplace(xp_mesh1d: dt.DeviceMesh, check: Checker) -> None:
    A, B = positive((SIZE + 2, 3), 1), positive((SIZE + 2, 3), 2)
    a, b = dist(A, xp_mesh1d, [dt.Shard(0)]), dist(B, xp_mesh1d, [dt.Shard(0)])
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
        r = dist(A, xp_mesh1d, [dt.Replicate()])
        r += a


def test_mean_of_uneven_shards_is_the_true_mean(mesh1d: dt.DeviceMesh) -> None:
    full = np.arange(2 * SIZE + 1, dtype=np.float64) ** 2
    m = dt.distribute_tensor(full, mesh1d, [dt.Shard(0)]).mean()
    assert m.placements == (dt.Partial("sum"),)
    assert np.isclose(m.to_torch(), full.mean())


@pytest.mark.path_independent  # operators never communicate (one path is enough)
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


def test_one_bounded_plan_cache_serves_every_operator(mesh1d: dt.DeviceMesh) -> None:
    from dtorch_mpi.ops.dispatch import INFERENCE_CACHE_SIZE

    apply.clear_plan_cache()
    x = dt.ones(SIZE + 1, 3, device_mesh=mesh1d, placements=[dt.Shard(0)])
    for _ in range(2):
        (x + x).sum(1).exp()
        x.T.unsqueeze(0)
        x[:, 1:]
    info = dt.ops.cache_info()
    assert info.maxsize == INFERENCE_CACHE_SIZE
    assert (info.misses, info.hits) == (6, 6), info
    apply.clear_plan_cache()
    assert dt.ops.cache_info().currsize == 0


@pytest.mark.path_independent  # operators never communicate (one path is enough)
def test_2d_mesh_each_dim_matched_on_its_own(xp_mesh2d: dt.DeviceMesh, check: Checker) -> None:
    A, W = positive((5, 4), 1), positive((4, 3), 2)
    combos = [([dt.Shard(0), dt.Shard(1)], [dt.Replicate(), dt.Shard(0)]),
              ([dt.Shard(0), dt.Replicate()], [dt.Replicate(), dt.Shard(1)]),
              ([dt.Partial(), dt.Shard(1)], [dt.Replicate(), dt.Shard(0)])]
    for pa, pb in combos:
        y = dist(A, xp_mesh2d, pa) @ dist(W, xp_mesh2d, pb)
        check.equal(y.to_torch(), A @ W, f"{pa} @ {pb}", exact=False)
    s = dist(A, xp_mesh2d, [dt.Shard(0), dt.Shard(0)])
    check.equal((s + dist(A, xp_mesh2d, [dt.Replicate(), dt.Replicate()])).to_torch(), 2 * A, "nested + R")
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
        y = getattr(dt, op)(dist(A, mesh1d, [pa]), dist(B, mesh1d, [pb]))
    except dt.PlacementError as err:
        assert ".redistribute(placements=" in str(err)
        return
    assert np.allclose(y.to_torch(), OPS[op].reference(A, B))


def test_cached_plans_never_outlive_their_mesh() -> None:
    """Regression: a plan cached for a freed mesh over the same ranks must not be reused."""
    with dt.init_device_mesh("cpu", (SIZE,)) as first:
        (dt.ones(4, device_mesh=first) * 2).to_torch()
    with dt.init_device_mesh("cpu", (SIZE,)) as second:
        y = dt.ones(4, device_mesh=second) * 2
        assert y.device_mesh is second
        assert np.array_equal(y.redistribute(placements=[dt.Shard(0)]).to_torch(), np.full(4, 2.0, np.float32))


# --- everything public is derived from the declarations ----------------------------------------
def test_exports_are_derived_from_the_declarations() -> None:
    from dtorch_mpi.ops import catalog, exported

    declared = exported()
    assert sorted(catalog.__all__) == sorted(declared), "catalog.__all__ differs from the declarations"
    for name, fn in declared.items():
        assert getattr(catalog, name) is fn and getattr(dt, name) is fn, name
        assert name in dt.__all__, name
    core = set(dt.__all__) - set(declared)
    assert not core & set(declared)
    for name in core:
        assert getattr(dt, name) is not None
    assert len(dt.__all__) == len(set(dt.__all__))


def test_dtensor_methods_are_derived_from_the_declarations() -> None:
    from dtorch_mpi.dtensor import DTensor

    bound = {name: value for op in OPS.values() for name, value in op.methods.items()}
    for name, value in bound.items():
        assert vars(DTensor)[name] is value, name
        assert dt.signature(name) is OPS[next(n for n, op in OPS.items() if name in op.methods)].signature
    assert {"__add__", "__radd__", "__iadd__", "add_", "T", "__getitem__", "view", "exp"} <= set(bound)


def test_backward_rules_are_shown_by_signature_and_docs() -> None:
    import os
    import sys

    differentiable = {name for name, op in OPS.items() if op.backward is not None}
    assert {"exp", "add", "matmul", "sum", "softmax", "reshape", "getitem", "cat", "cumsum"} <= differentiable
    assert {"argmax", "lt", "bitwise_and"}.isdisjoint(differentiable)
    text = repr(dt.signature("matmul"))
    assert "backward:\n    gradient: (g @ b^T, a^T @ g)" in text
    assert '(Replicate(), Shard(-1)) -> Shard(-1)   grads: (Partial("sum"), Shard(-1))' in text
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    try:
        from gen_signatures import render
    finally:
        sys.path.pop(0)
    assert "## exp\n" in render() and "Backward:\n\n```\ngradient: g * y" in render()


def test_plans_record_the_matched_rule_per_mesh_dim(mesh2d: dt.DeviceMesh) -> None:
    x = dt.ones(5, 4, device_mesh=mesh2d, placements=[dt.Shard(0), dt.Replicate()])
    b = dt.ones(4, device_mesh=mesh2d, placements=[dt.Replicate(), dt.Replicate()])
    plan = apply.plan_for(OPS["add"], (x.spec, b.spec), ())
    rules = OPS["add"].signature.rules
    assert plan.rules == (rules[1], rules[3])  # (Shard(d), Replicate()) and (Replicate(), Replicate())


@pytest.mark.parametrize("call", [lambda: dt.sum(3.0), lambda: dt.squeeze(3), lambda: dt.mean([1, 2]),
                                  lambda: dt.softmax(2.0), lambda: dt.permute(1, 0), lambda: dt.reshape(3, 1),
                                  lambda: dt.argmax("x"), lambda: dt.cat(5), lambda: dt.transpose(None),
                                  lambda: dt.astype(1.0, np.float32), lambda: dt.clone(2)])
def test_non_tensor_inputs_raise_type_error(call: Callable[[], Any]) -> None:
    with pytest.raises(TypeError, match=r"must be a DTensor|sequence of DTensors"):
        call()


@pytest.mark.rank_independent
@pytest.mark.parametrize("way", ["scipy", "libm"])
def test_the_erf_kernel_matches_libm(way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NumPy's erf: SciPy's ufunc where installed (within 3 ulp of libm), else libm per element
    (exact); the dtype kept (float16 included), an empty array returned as a new empty one."""
    import math

    from dtorch_mpi.ops import activations

    if way == "scipy":
        pytest.importorskip("scipy.special")
        monkeypatch.setattr(activations, "_numpy_erf", activations._choose_numpy_erf())
    else:
        monkeypatch.setattr(activations, "_numpy_erf", lambda x: activations._erf_object(x).astype(x.dtype))
    x = np.concatenate([np.linspace(-7, 7, 2001), [0.0, -0.0, 1e-300, np.inf, -np.inf]])
    want = np.array([math.erf(v) for v in x])
    got = activations.erf_kernel(np, x)
    if way == "libm":
        assert np.array_equal(got, want)
    assert np.all(np.abs(got - want) <= 3 * np.spacing(np.abs(want)))
    assert np.isnan(activations.erf_kernel(np, np.array([np.nan])))[0]
    for dtype in (np.float16, np.float32):
        assert activations.erf_kernel(np, x.astype(dtype)).dtype == dtype
    empty = np.empty((0, 3))
    assert activations.erf_kernel(np, empty).shape == (0, 3) and activations.erf_kernel(np, empty) is not empty


def test_gelu_exact_and_tanh_and_rejects_unknown_keywords(mesh1d: dt.DeviceMesh) -> None:
    import math

    full = np.linspace(-6, 6, 4 * SIZE + 3)
    x = dt.distribute_tensor(full, mesh1d, [dt.Shard(0)])
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in full])
    assert np.allclose(dt.gelu(x).to_torch(), exact, rtol=1e-15, atol=1e-15)
    assert np.allclose(x.gelu(approximate="none").to_torch(), exact, rtol=1e-15, atol=1e-15)
    tanh = 0.5 * full * (1 + np.tanh(math.sqrt(2 / math.pi) * (full + 0.044715 * full**3)))
    assert np.allclose(dt.gelu(x, approximate="tanh").to_torch(), tanh, rtol=1e-15, atol=1e-15)
    assert np.abs(tanh - exact).max() > 5e-5  # the two forms differ: the default is the exact one
    x32 = dt.distribute_tensor(full.astype(np.float32), mesh1d, [dt.Shard(0)])
    assert dt.gelu(x32).dtype == np.float32
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        dt.gelu(x, approximate="erf")
    with pytest.raises(TypeError, match="unexpected keyword"):
        dt.gelu(x, approx="tanh")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword"):
        dt.relu(x, alpha=0.1)


def test_dtensor_typing_stubs_name_only_declared_methods() -> None:
    """The TYPE_CHECKING block in dtensor.py must not promise a method no declaration binds."""
    import inspect

    from dtorch_mpi.dtensor import DTensor

    block = inspect.getsource(DTensor).split("if TYPE_CHECKING:")[1].split("# --- local piece")[0]
    stubbed = set(re.findall(r"def (\w+)\(", block)) | set(re.findall(r"^\s+(\w+): DTensor$", block, re.M))
    bound = {name for op in OPS.values() for name in op.methods}
    assert stubbed - {"__getattr__"} <= bound, stubbed - bound


# --- the suggested fix is the cheapest (issue 13 items 8, 9) -----------------------------------
LOPSIDED = [
    # (what, big operand, small operand, call, NumPy, the fix that must be suggested)
    ("x - x.mean(0)", ((4099, 7), [dt.Shard(0)]), ((7,), [dt.Partial("sum")]), lambda a, b: a - b,
     np.subtract, ("b", [dt.Replicate()])),
    ("X @ w", ((1003, 17), [dt.Shard(0)]), ((17,), [dt.Partial("sum")]), lambda a, b: a @ b,
     np.matmul, ("b", [dt.Replicate()])),
    ("w @ X.T", ((17,), [dt.Partial("sum")]), ((17, 1003), [dt.Shard(1)]), lambda a, b: a @ b,
     np.matmul, ("a", [dt.Replicate()])),
    ("X * row", ((2049, 9), [dt.Shard(0)]), ((1, 9), [dt.Shard(1)]), lambda a, b: a * b,
     np.multiply, ("b", [dt.Replicate()])),
]


@pytest.mark.parametrize("case", LOPSIDED, ids=[c[0] for c in LOPSIDED])
def test_suggested_fix_reduces_the_small_operand(case: Any, mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """With lopsided operand sizes the suggestion moves the small operand, its cost (from the
    compiled plan's global sizes) is below every other legal single-operand fix, the fix works,
    and CommCounter confirms it moves fewer bytes than gathering the big operand."""
    from dtorch_mpi.ops.cost import redistribute_cost

    what, (sa, pa), (sb, pb), call, ref, (who, fix) = case
    A, B = positive(sa, 1), positive(sb, 2)
    a, b = dist(A, mesh1d, pa), dist(B, mesh1d, pb)
    with pytest.raises(dt.PlacementError) as err:
        call(a, b)
    msg = str(err.value)
    fixes = _suggested_fixes(msg)
    assert fixes == [(who, fix)], f"{what}: suggested {fixes}\n{msg}"
    chosen = redistribute_cost((a if who == "a" else b).spec, tuple(fix))
    assert f"moves {chosen.moved} bytes per rank, leaves a {chosen.resident}-byte piece" in msg
    other = a if who == "b" else b  # the big operand: its cheapest legal change costs more
    alternatives = [redistribute_cost(other.spec, (p,)) for p in (dt.Replicate(), dt.Partial("sum"))]
    assert all(alt.total > chosen.total for alt in alternatives), (chosen, alternatives)
    with dt.CommCounter() as fixed:
        moved = (a if who == "a" else b).redistribute(placements=fix)
    got = call(a, moved) if who == "b" else call(moved, b)
    check.equal(got.to_torch(), ref(A, B), f"{what} after the fix", exact=False)
    with dt.CommCounter() as gathered:
        other.redistribute(placements=[dt.Replicate()])
    check.true(fixed.bytes_recv < gathered.bytes_recv or SIZE == 1,
               f"{what}: the fix received {fixed.bytes_recv} bytes, gathering {gathered.bytes_recv}")
    check.done()


def test_placement_error_shows_the_inputs_aligned_to_the_output_dims(mesh1d: dt.DeviceMesh) -> None:
    a = dt.ones(11, 7, device_mesh=mesh1d, placements=[dt.Shard(0)])
    b = dt.ones(7, device_mesh=mesh1d, placements=[dt.Shard(0)])
    with pytest.raises(dt.PlacementError) as err:
        a + b
    msg = str(err.value)
    assert "no rule accepts the input placements (Shard(dim=0), Shard(dim=0))" in msg
    assert "Aligned to the output's dims, as the rules name them" in msg
    assert "the inputs are (Shard(0), Shard(1))" in msg
    with pytest.raises(dt.PlacementError, match=r"the inputs are \(Shard\(r\): dim 0 is not in the output"):
        dt.ones(5, 3, device_mesh=mesh1d, placements=[dt.Shard(0)]).prod(0)
    with pytest.raises(dt.PlacementError, match=r"the inputs are \(Shard\(-1\), Shard\(-1\)\)"):
        dt.ones(5, 3, device_mesh=mesh1d, placements=[dt.Shard(1)]) @ dt.ones(
            3, 4, device_mesh=mesh1d, placements=[dt.Shard(1)])


# --- NumPy and torch spellings (issue 13 item 10) ---------------------------------------------
def test_numpy_and_torch_spellings(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    A = positive((2 * SIZE + 1, 4), 3)
    x = dist(A, mesh1d, [dt.Shard(0)])
    for got, want, what in [
        (x.sum(axis=0), A.sum(axis=0), "sum(axis=)"), (dt.sum(x, axis=(0, 1)), A.sum(), "dt.sum(axis=tuple)"),
        (x.mean(1, keepdims=True), A.mean(1, keepdims=True), "mean(keepdims=)"),
        (x.max(axis=1), A.max(axis=1), "max(axis=): values only (NumPy)"),
        (x.argmax(axis=1, keepdims=True), A.argmax(axis=1, keepdims=True), "argmax(axis=, keepdims=)"),
        (x.clip(min=3), A.clip(3, None), "clip(min=)"), (x.clamp(max=4), A.clip(None, 4), "clamp(max=)"),
        (dt.clamp(x, 2, 6), A.clip(2, 6), "dt.clamp"), (x.std(1), A.std(1), "std"),
        (x.var(axis=1, ddof=1), A.var(1, ddof=1), "var(ddof=)"), (x.std(1, correction=1), A.std(1, ddof=1), "correction="),
        ((x > 4).all(0), (A > 4).all(0), "all over the sharded dim"), ((x > 4).any(), (A > 4).any(), "any"),
        (x.copy(), A, "copy"), (x.double(), A, "double"), (x.float(), A.astype(np.float32), "float()"),
        (x.to(np.float32), A.astype(np.float32), "to(dtype)"),
        (dt.zeros_like(x), np.zeros_like(A), "zeros_like"), (dt.ones_like(x, dtype=np.int32), np.ones_like(A, np.int32), "ones_like"),
        (dt.full_like(x, 7), np.full_like(A, 7), "full_like"),
        (dt.distribute_tensor(A, mesh1d), A, "distribute_tensor without placements"),
    ]:
        check.equal(got.to_torch(), want, what, exact=False)
    check.true(dt.empty_like(x).shape == x.shape and dt.empty_like(x).placements == x.placements, "empty_like")
    check.true(dt.zeros_like(x).placements == (dt.Shard(0),), "zeros_like keeps placements")
    check.true(dt.distribute_tensor(A, mesh1d).placements == (dt.Replicate(),), "default Replicate")
    check.true((x > 4).all(0).placements == (dt.Partial("min"),), "all over a sharded dim is Partial(min)")
    check.true((x > 4).any(0).placements == (dt.Partial("max"),), "any over a sharded dim is Partial(max)")
    check.true(x.numel() == x.size == A.size and x.dim() == x.ndim == 2, "numel/size/dim/ndim")
    check.true(x.float().dtype == np.float32 and x.double().dtype == np.float64, "float()/double() dtypes")
    check.done()
    for call, match in [(lambda: x.sum(dim=0, axis=0), "both dim= and axis="),
                        (lambda: x.mean(0, keepdim=True, keepdims=True), "both keepdim= and keepdims="),
                        (lambda: x.clip(1, min=2), "both lo= and min="),
                        (lambda: x.std(1, ddof=1, correction=1), "both correction= and ddof="),
                        (lambda: dt.zeros_like(A), "must be a DTensor")]:
        with pytest.raises(TypeError, match=match):
            call()
    with pytest.raises(dt.PlacementError, match=r"x\.mean\(d, keepdim=True\)"):
        x.std(0)  # over the sharded dim: refused, the doc names the two-step recipe
    m = x.mean(0, keepdim=True).redistribute(placements=[dt.Replicate()])
    assert np.allclose(((x - m) ** 2).mean(0).to_torch(), A.var(0))  # the recipe works


# --- reshape that splits or merges a sharded dim (issue 13 item 11) ----------------------------
def _heads_map(h: int, d: int, m: int) -> bool:
    """Independent statement of the rule for one mesh dim: the column pieces of h*d over m
    ranks are whole heads, as Shard of the head dim would place them."""
    from dtorch_mpi.split import split_sizes

    return split_sizes(h * d, m) == tuple(s * d for s in split_sizes(h, m))


@pytest.mark.parametrize("heads,dim", [(SIZE, 3), (4, 3), (2 * SIZE, 2), (SIZE + 1, 2), (3, SIZE)])
def test_reshape_splits_and_merges_a_sharded_dim_where_pieces_map(heads: int, dim: int, mesh1d: dt.DeviceMesh,
                                                                 check: Checker) -> None:
    B, T = 2, SIZE + 1
    A = positive((B, T, heads * dim), 4)
    x = dist(A, mesh1d, [dt.Shard(2)])
    maps = _heads_map(heads, dim, SIZE)
    for src, new, full in [(x, (B, T, heads, dim), A.reshape(B, T, heads, dim)),
                           (dist(A.reshape(B, T, heads, dim), mesh1d, [dt.Shard(2)]), (B, T, heads * dim), A)]:
        try:
            with dt.CommCounter() as moved:
                y = src.reshape(*new)
        except dt.PlacementError as err:
            msg = str(err)
            check.true(not maps, f"{heads}x{dim} at {SIZE} ranks: refused though the pieces map: {msg}")
            check.true("would have to move" in msg and "Shard the dim that stays whole" in msg, msg)
            (_, fix), = _suggested_fixes(msg)
            check.equal(src.redistribute(placements=fix).reshape(*new).to_torch(), full, "after the fix")
            continue
        check.true(maps, f"{heads}x{dim} at {SIZE} ranks: accepted though pieces do not map")
        check.true(moved.count == 0, "reshape communicated")
        want = dt.Shard(3 if heads == 1 and len(new) == 4 else 2)  # one head: the length-1 dim is skipped
        check.true(y.placements == (want,), f"{y.placements}")
        check.equal(y.to_torch(), full, f"reshape {src.shape} -> {new}")
        check.true(y.to_local().shape == dt.compute_local_shape_and_offset(new, mesh1d, [want])[0],
                   "the local piece is the split rule's piece of the new shape")
    check.done()


def test_reshape_heads_at_four_and_three_ranks(mesh1d: dt.DeviceMesh) -> None:
    """The issue's case: (B, T, 12) Shard(2) -> (B, T, 4, 3) is one head per rank at 4 ranks;
    at 3 ranks the columns 4/4/4 are not whole heads (2/1/1 heads = 6/3/3 columns)."""
    x = dt.ones(2, 5, 12, device_mesh=mesh1d, placements=[dt.Shard(2)])
    if SIZE in (1, 2, 4):
        assert x.reshape(2, 5, 4, 3).placements == (dt.Shard(2),)
    elif SIZE == 3:
        with pytest.raises(dt.PlacementError, match=r"holds 4/4/4 of the block's 12 elements, but Shard\(2\) of the "
                                                    r"new shape gives 6/3/3 \(whole entries of dim 2, 3 elements"):
            x.reshape(2, 5, 4, 3)


def test_reshape_with_nested_shards_on_a_2d_mesh(mesh2d: dt.DeviceMesh, check: Checker) -> None:
    A = positive((3, 2 * SIZE * 2), 6)
    for plc in ([dt.Shard(1), dt.Shard(1)], [dt.Shard(0), dt.Shard(1)], [dt.Replicate(), dt.Shard(1)]):
        x = dist(A, mesh2d, plc)
        for new in [(3, 2 * SIZE, 2), (3, SIZE, 4), (3, 4 * SIZE, 1)]:
            try:  # every one is whole blocks of whole rows per rank: a refusal is a failure
                y = x.reshape(*new)
            except dt.PlacementError as err:
                check.true(False, f"{plc} -> {new} refused: {err}")
                continue
            check.equal(y.to_torch(), A.reshape(new), f"{plc} -> {new}")
            check.equal(y.reshape(*A.shape).to_torch(), A, f"{plc} -> {new} and back")
    check.done()


# --- argmax over a sharded dim and slices of a sharded dim (issue 13 item 12) ------------------
def test_argmax_and_slice_of_a_sharded_dim_name_the_fix(mesh1d: dt.DeviceMesh) -> None:
    """Both need data movement, which operators never do: refused on every rank with the reason
    and a redistribute that works."""
    A = positive((2 * SIZE + 3, 4), 8)
    x = dist(A, mesh1d, [dt.Shard(0)])
    for call, want, reason in [(lambda t: t.argmax(0), A.argmax(0), "MPI_MAXLOC"),
                               (lambda t: dt.argmin(t, dim=0, keepdim=True), A.argmin(0, keepdims=True), "MPI_MAXLOC"),
                               (lambda t: t[1:3], A[1:3], "balanced layout"),
                               (lambda t: t[::2, 1:], A[::2, 1:], "balanced layout")]:
        with pytest.raises(dt.PlacementError) as err:
            call(x)
        msg = str(err.value)
        assert reason in msg and "No data is moved implicitly" in msg, msg
        (_, fix), = _suggested_fixes(msg)
        assert np.array_equal(call(x.redistribute(placements=fix)).to_torch(), want), msg
    assert np.array_equal(x.max(0).redistribute(placements=[dt.Replicate()]).to_torch(), A.max(0))
