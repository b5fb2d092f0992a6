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

import itertools
import math
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from backend_meshes import mesh1d_per_backend, mesh2d_per_backend  # noqa: F401 (fixtures: this module's meshes, per array backend)
from conftest import SIZE, Checker, on_mesh, to_numpy
from helpers import (
    MATMUL_SHAPES,
    P1,
    P2,
    assert_all_rules_ran,
    dist,
    numeric_grad,
    placement_for,
)

import dtorch_mpi as dt
from dtorch_mpi.arrays import array_namespace

R = dt.Replicate()
op_tests_only_on_auto = pytest.mark.path_independent  # operator backward never communicates


def values(shape: tuple[int, ...], seed: int, low: float = 0.5, high: float = 2.0) -> np.ndarray:
    """Distinct non-integer values in an interval (no ties, no kinks of floor/abs/relu)."""
    return np.random.default_rng(seed).uniform(low, high, size=shape)


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
    _check_gradients_own_their_memory(xs, [*xs, y, c], check, label)
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


def _check_gradients_own_their_memory(leaves: Sequence[dt.DTensor], forward: Sequence[dt.DTensor], check: Checker,
                                      label: str) -> None:
    """No leaf's .grad shares memory with a forward array or another leaf's .grad: the engine
    keeps a kernel's fresh result as .grad without copying (autograd/graph.py ``_owned``), so
    a backward kernel that returned an array it saved from forward would alias it here."""
    grads = [x.grad.to_local() for x in leaves if x.grad is not None]
    xp = array_namespace(forward[0].device_mesh.device_type)
    for i, g in enumerate(grads):
        if not g.size:
            continue
        others = [t.to_local() for t in forward] + grads[:i] + grads[i + 1:]
        check.true(not any(o.size and xp.shares_memory(g, o) for o in others),
                   f"{label}: a leaf gradient shares memory with a forward array or another gradient")


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
UNARY_REF["erf"] = (np.vectorize(math.erf, otypes=[float]), -2, 2)
UNARY_REF["gelu"] = (lambda x: 0.5 * x * (1 + np.vectorize(math.erf, otypes=[float])(x / np.sqrt(2))), -2, 2)


@op_tests_only_on_auto
@pytest.mark.parametrize("op", sorted(UNARY_REF))
def test_unary_backward_every_rule(op: str, mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    ref, low, high = UNARY_REF[op]
    sig = dt.signature(op)
    fn = getattr(dt, op)
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
              "hypot": np.hypot, "mod": np.mod, "floordiv": np.floor_divide}
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
                grad_check(getattr(dt, op), BINARY_REF[op], [A, B], [pa, pb], mesh1d,
                           check, f"{op} {sa}{pa} {sb}{pb}")
    # a scalar operand gets no gradient, the tensor does
    A = values((SIZE + 1, 2), 3)
    for plc in ([dt.Shard(0)], [R]):
        grad_check(lambda a: getattr(dt, op)(a, 1.5), lambda a: BINARY_REF[op](a, 1.5), [A], [plc], mesh1d,
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
    for plc in [[dt.Shard(0)], [dt.Shard(1)], [R]] + [[dt.Partial(p)] for p in ("sum", "avg", "max", "min")]:
        if not isinstance(plc[0], dt.Partial):
            grad_check(lambda a: a.clip(1.0, 2.0), lambda a: np.clip(a, 1.0, 2.0), [A], [plc], mesh1d, check, "clip")
        grad_check(lambda a: a.astype(np.float32).astype(np.float64), lambda a: a, [A], [plc], mesh1d, check,
                   "astype")
    check.done()
    assert_all_rules_ran(rule_hits, ["where", "clip", "astype"])


@op_tests_only_on_auto
def test_matmul_backward_every_rule(mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    sig = dt.signature("matmul")
    shared_weight = [((SIZE + 1, 4), (2, 4, 3)), ((3, 1, SIZE + 1, 4), (4, 2))]  # one product over the batch
    for sa, sb in MATMUL_SHAPES + shared_weight:
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
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod", "std", "var"])
def test_reduction_backward_every_rule(op: str, mesh1d: dt.DeviceMesh, rule_hits: set, check: Checker) -> None:
    ref = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod, "std": np.std,
           "var": np.var}[op]
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
        ("cumsum", lambda x: dt.cumsum(x, 1), lambda a: np.cumsum(a, 1)),
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
    assert_all_rules_ran(rule_hits, ["transpose", "reshape", "getitem", "cat", "stack", "softmax", "log_softmax",
                                     "cumsum"])


# --- redistribute: its backward is its adjoint ----------------------------------------------
def _redistribute_grad_case(mesh: dt.DeviceMesh, src: list[dt.Placement], dst: list[dt.Placement],
                            shape: tuple[int, ...], check: Checker) -> None:
    full = values(shape, sum(shape))
    cot = values(shape, 7, -1.0, 1.0)
    x = dist(full, mesh, src).requires_grad_()
    y = x.redistribute(placements=dst)
    what = f"{shape} {src} -> {dst}"
    undefined = [p for p in src + dst if isinstance(p, dt.Partial) and p.reduce_op in ("max", "min")]
    if undefined:
        z = y.redistribute(placements=[R] * mesh.ndim) if any(isinstance(p, dt.Partial) for p in dst) else y
        loss = (z * dt.distribute_tensor(cot, mesh, [R] * mesh.ndim, src_data_rank=None)).sum()
        try:
            loss.backward()
            check.true(False, f"{what}: backward through {undefined} did not raise")
        except dt.PlacementError as exc:
            check.true("no gradient through" in str(exc), f"{what}: {exc}")
        return
    loss = (y * dt.distribute_tensor(cot, mesh, [R] * mesh.ndim, src_data_rank=None)).sum()
    loss.backward()
    assert x.grad is not None
    check.equal(x.grad.to_torch(), cot, what, exact=False, rtol=1e-12, atol=1e-12)
    want: list[dt.Placement] = []
    # nested: another mesh dim shards the same tensor dim in the gradient's layout
    grad_layout = [sj if isinstance(sj, dt.Shard) else dj if isinstance(sj, dt.Replicate) else None
                   for sj, dj in zip(src, dst)]
    for k, (s, d) in enumerate(zip(src, dst)):
        nested = isinstance(d, dt.Shard) and any(j > k and grad_layout[j] == d for j in range(len(src)))
        if nested and isinstance(s, dt.Replicate):
            grad_layout[k] = None  # gathered: no longer splits d for the mesh dims after it
        if isinstance(s, dt.Shard):
            want.append(s)
        elif isinstance(s, dt.Partial):
            want.append(R)
        else:  # a Replicate source cut to a Shard: zero-padded Partial("sum") unless nested
            want.append(dt.Partial("sum") if isinstance(d, dt.Shard) and not nested else R)
    check.true(x.grad.placements == tuple(want), f"{what}: grad placements {x.grad.placements}, want {want}")


def test_redistribute_backward_every_pair_1d(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    for src, dst in itertools.product(P1, P1):
        for shape in [(n, 3) for n in (0, 1, SIZE + 1, 7)]:
            _redistribute_grad_case(mesh1d, [src], [dst], shape, check)
    check.done()


def test_redistribute_backward_every_pair_2d(mesh2d: dt.DeviceMesh, check: Checker) -> None:
    layouts = [list(p) for p in itertools.product(P2, repeat=2)]
    for src, dst in itertools.product(layouts, layouts):
        _redistribute_grad_case(mesh2d, src, dst, (5, 3), check)
    check.done()


def test_backward_of_incoming_partial_gradient_is_an_all_reduce(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """P -> R forward; the Replicate result used by sharded work gets a Partial gradient, which
    the redistribute's backward all-reduces (the adjoint of an all-reduce is an all-reduce)."""
    full = values((SIZE + 1, 3), 1)
    w = values((3,), 2)
    x = dist(full, mesh1d, [dt.Partial("sum")]).requires_grad_()
    r = x.redistribute(placements=[R])
    s = dist(w, mesh1d, [R]).requires_grad_()
    loss = (r * s).sum()
    loss.backward()
    assert x.grad is not None and s.grad is not None
    check.equal(x.grad.to_torch(), np.broadcast_to(w, full.shape), "d/dx", exact=False)
    check.true(x.grad.placements == (R,), f"{x.grad.placements}")
    check.equal(s.grad.to_torch(), full.sum(0), "d/ds", exact=False)
    check.done()


# --- communication: backward moves only the adjoint of the forward's explicit moves ---------
def test_tp_mlp_backward_moves_only_the_adjoint(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """Colwise -> ReLU -> Rowwise: forward all-reduces the output once (explicitly, in the
    Rowwise boundary); its adjoint on a Replicate gradient is the identity, so backward moves
    nothing. Gradients equal the NumPy ones."""
    rng = np.random.default_rng(3)
    X, W1, W2 = rng.standard_normal((4, 6)), rng.standard_normal((SIZE + 2, 6)), rng.standard_normal((5, SIZE + 2))
    model = dt.nn.Sequential(dt.nn.Linear(6, SIZE + 2, bias=False, device_mesh=mesh1d), dt.nn.ReLU(),
                             dt.nn.Linear(SIZE + 2, 5, bias=False, device_mesh=mesh1d))
    model.load_state_dict({"0.weight": W1, "2.weight": W2})
    dt.parallelize_module(model, mesh1d, {"0": dt.ColwiseParallel(use_local_output=False),
                                         "2": dt.RowwiseParallel(use_local_output=False)})
    x = dt.distribute_tensor(X, mesh1d, [R])
    with dt.CommCounter() as fwd:
        loss = model(x).square().sum()
    with dt.CommCounter() as bwd:
        loss.backward()
    check.true(fwd.kinds() == (["all_reduce"] if SIZE > 1 else []), f"forward moved {fwd.kinds()}")
    check.true(bwd.count == 0, f"backward moved {bwd.kinds()}")
    H = np.maximum(X @ W1.T, 0)
    gy = 2 * (H @ W2.T)
    gW2 = gy.T @ H
    gW1 = ((gy @ W2) * (H > 0)).T @ X
    params = dict(model.named_parameters())
    check.equal(params["2.weight"].grad.to_torch().astype(np.float64), gW2, "dW2", exact=False, rtol=1e-4)
    check.equal(params["0.weight"].grad.to_torch().astype(np.float64), gW1, "dW1", exact=False, rtol=1e-4)
    check.true(params["0.weight"].grad.placements == params["0.weight"].placements, "dW1 placed as W1")
    check.true(params["2.weight"].grad.placements == params["2.weight"].placements, "dW2 placed as W2")
    check.done()


def test_reduce_scatter_is_the_adjoint_of_all_gather(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    full = values((2 * SIZE + 1, 3), 4)
    x = dist(full, mesh1d, [dt.Shard(0)]).requires_grad_()
    y = x.redistribute(placements=[R])
    c = values(full.shape, 6)
    loss = (y * dist(c, mesh1d, [dt.Shard(0)])).sum()  # y is cut locally: its gradient is Partial
    with dt.CommCounter() as moved:
        loss.backward()
    check.true(moved.kinds() == (["reduce_scatter"] if SIZE > 1 else []), f"backward moved {moved.kinds()}")
    assert x.grad is not None
    check.equal(x.grad.to_torch(), c, "dx", exact=False)
    check.done()


# --- the graph's memory, grad mode, errors ----------------------------------------------------
def test_a_chain_of_elementwise_ops_keeps_only_what_backward_needs(mesh1d: dt.DeviceMesh) -> None:
    import weakref

    x = dt.distribute_tensor(values((SIZE + 3, 4), 1), mesh1d, [dt.Shard(0)]).requires_grad_()
    y = x
    refs = []
    for _ in range(10):
        y = y + 1.0  # add saves nothing
        refs.append(weakref.ref(y.to_local()))
    loss = y.sum()
    del y
    assert sum(r() is not None for r in refs) == 0, "intermediate pieces of a chain of adds are kept"
    loss.backward()
    assert x.grad is not None and np.all(to_numpy(x.grad.to_local()) == 1)


def test_no_grad_detach_and_second_backward(mesh1d: dt.DeviceMesh) -> None:
    x = dt.distribute_tensor(values((SIZE + 1, 2), 1), mesh1d, [dt.Shard(0)]).requires_grad_()
    with dt.no_grad():
        y = (x * 2).sum()
    assert not y.requires_grad and y.grad_fn is None
    z = (x.detach() * 2).sum()
    assert not z.requires_grad
    loss = (x * x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert x.grad is not None
    np.testing.assert_allclose(to_numpy(x.grad.to_torch()), 4 * to_numpy(x.to_torch()))
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()
    with pytest.raises(RuntimeError, match="one-element"):
        (x * 2).backward()
    with pytest.raises(RuntimeError, match="in-place"):
        x += 1
    w = dt.distribute_tensor(values((SIZE + 1, 2), 2), mesh1d, [dt.Shard(0)])
    loss = (x * w).sum()
    w += 1  # w does not require grad, but mul saved it
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_requires_grad_keyword_on_every_constructor(mesh1d: dt.DeviceMesh) -> None:
    kw = {"device_mesh": mesh1d, "placements": [dt.Shard(0)], "requires_grad": True}
    made = [dt.zeros(SIZE + 1, 2, **kw), dt.ones(SIZE + 1, 2, **kw), dt.empty(SIZE + 1, 2, **kw),
            dt.full((SIZE + 1, 2), 1.5, **kw), dt.rand(SIZE + 1, 2, **kw), dt.randn(SIZE + 1, 2, **kw),
            dt.arange(0.0, SIZE + 1.0, **kw),
            dt.distribute_tensor(np.ones((SIZE + 1, 2)), mesh1d, [dt.Shard(0)], requires_grad=True),
            dt.DTensor.from_local(on_mesh(mesh1d, np.ones((1, 2))), mesh1d, [R], requires_grad=True)]
    assert all(t.requires_grad and t.is_leaf and t.grad is None for t in made)
    assert not dt.zeros(3, device_mesh=mesh1d, placements=[R]).requires_grad
    with pytest.raises(TypeError, match="only floating or complex tensors"):
        dt.arange(3, device_mesh=mesh1d, placements=[R], requires_grad=True)
    loss = (made[0] * made[0]).sum() + (made[1] * made[1]).sum()
    loss.backward()
    np.testing.assert_allclose(to_numpy(made[1].grad.to_torch()), 2 * np.ones((SIZE + 1, 2)))


@pytest.mark.skipif(SIZE < 2, reason="needs a rank outside the mesh")
def test_backward_with_a_rank_outside_the_mesh(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """Every world rank runs the program; the last one is outside the mesh (empty pieces) and
    must neither hang nor disturb the others' gradients (a mesh of ``mesh1d``'s device type)."""
    with dt.DeviceMesh(mesh1d.device_type, list(range(SIZE - 1))) as mesh:
        X, W = values((SIZE + 2, 3), 1), values((3, 2), 2)
        x = dt.distribute_tensor(X, mesh, [dt.Shard(0)], requires_grad=True)
        w = dt.distribute_tensor(W, mesh, [R], requires_grad=True)
        y = (x @ w).tanh().redistribute(placements=[R])
        loss = (y * y).sum()
        loss.backward()
        assert x.grad is not None and w.grad is not None
        gy = 2 * np.tanh(X @ W) * (1 - np.tanh(X @ W) ** 2)
        gx, gw = x.grad.to_torch(), w.grad.to_torch()
        if mesh.get_coordinate() is None:
            check.true(gx is None and gw is None, "outside rank gets no complete value")
        else:
            check.equal(gx, gy @ W.T, "dx", exact=False)
            check.equal(gw, X.T @ gy, "dw", exact=False)
    check.done()


@op_tests_only_on_auto
def test_std_var_with_ddof_backward(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    full = values((SIZE + 2, 4), 21)
    for plc in ([dt.Shard(0)], [R]):
        for op in ("std", "var"):
            grad_check(lambda x, op=op: getattr(x, op)(1, correction=1), lambda a, op=op: getattr(np, op)(a, 1, ddof=1),
                       [full], [plc], mesh1d, check, f"{op} ddof=1 {plc}")
    check.done()


@op_tests_only_on_auto
def test_reshape_split_and_merge_of_a_sharded_dim_backward(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """reshape's backward (g reshaped to the input's local shape) stays right when a sharded dim
    is split into heads or merged back: the pieces map, so the gradient's pieces do too."""
    ran = 0
    for heads, hd in [(SIZE, 3), (2 * SIZE, 2), (4, 3), (SIZE + 1, 2)]:
        full = values((2, SIZE + 1, heads * hd), heads)
        split = (2, SIZE + 1, heads, hd)
        for shape, new, plc in [(full.shape, split, [dt.Shard(2)]), (split, full.shape, [dt.Shard(2)]),
                                (full.shape, split, [dt.Shard(0)])]:
            a = full.reshape(shape)
            try:
                dist(a, mesh1d, plc).reshape(*new)
            except dt.PlacementError:
                continue  # pieces that do not map: refused (tested in test_ops.py)
            ran += 1
            grad_check(lambda x, new=new: x.reshape(*new), lambda v, new=new: v.reshape(new), [a], [plc], mesh1d,
                       check, f"reshape {shape}{plc} -> {new}")
    check.true(ran >= 6, f"only {ran} reshapes ran")
    check.done()


def test_leaf_gradients_are_c_contiguous_and_unneeded_gradients_are_skipped(mesh1d: dt.DeviceMesh) -> None:
    """A weight used as W.T gets its gradient in its own (C) layout, so optimizer updates run
    on contiguous memory; an input that needs no gradient gets none computed."""
    x = dt.distribute_tensor(values((5, 4), 1), mesh1d, [R])
    w = dt.distribute_tensor(values((SIZE + 2, 4), 2), mesh1d, [dt.Shard(0)], requires_grad=True)
    (x @ w.T).sum().backward()
    assert w.grad is not None and w.grad.to_local().flags.c_contiguous
    np.testing.assert_allclose(to_numpy(w.grad.to_torch()), np.broadcast_to(values((5, 4), 1).sum(0), (SIZE + 2, 4)))
    assert x.grad is None


def test_prod_backward_with_zeros_and_leaf_gradients_own_their_buffers(mesh1d: dt.DeviceMesh) -> None:
    x = dt.distribute_tensor(np.array([[0.0, 2.0, 3.0], [1.0, 0.0, 0.0]]), mesh1d, [R], requires_grad=True)
    x.prod(dim=1).sum().backward()
    assert x.grad is not None
    np.testing.assert_allclose(to_numpy(x.grad.to_torch()), [[6.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    a = dt.distribute_tensor(values((SIZE + 1, 2), 1), mesh1d, [dt.Shard(0)], requires_grad=True)
    b = dt.distribute_tensor(values((SIZE + 1, 2), 2), mesh1d, [dt.Shard(0)], requires_grad=True)
    (a + b).sum().backward()  # add hands one buffer to both inputs; sum's is a read-only view
    assert a.grad is not None and b.grad is not None
    xp = array_namespace(mesh1d.device_type)
    assert not xp.shares_memory(a.grad.to_local(), b.grad.to_local())
    assert mesh1d.device_type != "cpu" or a.grad.to_local().flags.writeable  # CuPy has no read-only arrays
    with dt.no_grad():
        y = dt.nn.functional.cross_entropy(a, np.zeros(SIZE + 1, dtype=np.int64))
    assert not y.requires_grad and y.grad_fn is None


def test_a_fresh_leaf_gradient_is_kept_without_a_copy(mesh1d: dt.DeviceMesh) -> None:
    """The engine keeps a backward kernel's fresh result as the leaf's .grad (one gradient of
    memory at the peak, not two: the copy was up to 1 ms per 2 MB of page faults); a gradient a
    hook was shown is copied, so what the hook kept never changes with .grad."""
    if mesh1d.device_type != "cpu":
        pytest.skip("tracemalloc sees host memory only")
    n = 128
    x = dt.distribute_tensor(values((4, n), 1), mesh1d, [R])
    w = dt.distribute_tensor(values((n, n), 2), mesh1d, [R], requires_grad=True)
    loss = (x @ w).sum()
    tracemalloc.start()
    try:
        loss.backward()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert w.grad is not None and w.grad.to_local().flags.writeable and w.grad.to_local().flags.c_contiguous
    np.testing.assert_allclose(w.grad.to_local(), np.broadcast_to(values((4, n), 1).sum(0)[:, None], (n, n)))
    assert peak < 1.5 * w.to_local().nbytes, f"backward peaked at {peak} B for a {w.to_local().nbytes} B gradient"

    kept: list[dt.DTensor] = []
    v = dt.distribute_tensor(values((n, n), 2), mesh1d, [R], requires_grad=True)
    v.register_hook(kept.append)
    (x @ v).sum().backward()
    assert v.grad is not None and len(kept) == 1
    assert not np.shares_memory(v.grad.to_local(), kept[0].to_local())
    v.grad.to_local()[...] = 0.0  # an optimizer's in-place update leaves what the hook kept alone
    assert kept[0].to_local().any()


def test_a_gradient_a_hook_kept_inside_a_checkpoint_is_not_the_leaf_gradient(mesh1d: dt.DeviceMesh) -> None:
    """A hook inside a checkpointed function keeps the gradient it is shown during the
    recompute; the leaf's .grad must not be that array (the engine does not see those hooks, so
    a checkpoint's outputs are always copied into .grad)."""
    from dtorch_mpi.nn.utils import checkpoint

    kept: list[dt.DTensor] = []

    def fn(w: dt.DTensor) -> dt.DTensor:
        t = w.reshape(3, 2)
        t.register_hook(kept.append)
        return t * 2.0

    w = dt.distribute_tensor(np.arange(6.0).reshape(2, 3), mesh1d, [R], requires_grad=True)
    checkpoint(fn, w).sum().backward()
    assert w.grad is not None and len(kept) == 1
    xp = array_namespace(mesh1d.device_type)
    assert not xp.shares_memory(w.grad.to_local(), kept[0].to_local())
    w.grad.to_local()[...] = 0.0  # an optimizer's in-place update leaves what the hook kept alone
    assert float(kept[0].to_local().sum()) == 12.0
