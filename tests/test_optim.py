"""Optimizers: PyTorch's SGD and AdamW formulas on every rank's piece, checked against a
NumPy reference on complete arrays for every placement and uneven shapes (empty pieces too)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from backend_meshes import mesh1d_per_backend, mesh2d_per_backend  # noqa: F401 (fixtures: this module's meshes, per array backend)
from conftest import RANK, SIZE, Checker, lengths_for, on_mesh, reference, to_numpy

import dtorch_mpi as dt
from dtorch_mpi.nn import Parameter
from dtorch_mpi.nn.utils import clip_grad_norm_, reduce_gradients

STEPS = 4
PLACEMENTS_1D = [[dt.Shard(0)], [dt.Shard(1)], [dt.Replicate()]]
PLACEMENTS_2D = [[a, b] for a in (dt.Shard(0), dt.Shard(1), dt.Replicate())
                 for b in (dt.Shard(0), dt.Shard(1), dt.Replicate())]


def sgd_reference(p: np.ndarray, grads: list[np.ndarray], lr: float, momentum: float = 0.0,
                  dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> np.ndarray:
    """torch.optim.SGD's documented algorithm."""
    buf = None
    for g in grads:
        g = g + weight_decay * p if weight_decay else g
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def adamw_reference(p: np.ndarray, grads: list[np.ndarray], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                    eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False) -> np.ndarray:
    """torch.optim.AdamW's documented algorithm."""
    b1, b2 = betas
    m, v, vmax = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        p = p - lr * weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vmax = np.maximum(vmax, v)
        denom = np.sqrt(vmax if amsgrad else v) / math.sqrt(1 - b2 ** t) + eps
        p = p - lr / (1 - b1 ** t) * m / denom
    return p


CONFIGS: list[tuple[str, Callable[..., Any], Callable[..., np.ndarray], dict[str, Any]]] = [
    ("sgd", dt.optim.SGD, sgd_reference, {"lr": 0.1}),
    ("sgd-momentum-wd", dt.optim.SGD, sgd_reference, {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    ("sgd-nesterov", dt.optim.SGD, sgd_reference, {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.1}),
    ("adamw", dt.optim.AdamW, adamw_reference, {"lr": 0.01}),
    ("adamw-amsgrad", dt.optim.AdamW, adamw_reference, {"lr": 0.02, "betas": (0.8, 0.9), "eps": 1e-6,
                                                        "weight_decay": 0.1, "amsgrad": True}),
]


def _shapes() -> list[tuple[int, int]]:
    return [(n, 3) for n in lengths_for(SIZE)] + [(2, n) for n in lengths_for(SIZE)]


def _run(mesh: dt.DeviceMesh, layouts: list[list[dt.Placement]], check: Checker) -> None:
    for name, cls, ref, kwargs in CONFIGS:
        for shape in _shapes():
            params, fulls = [], []
            for i, plc in enumerate(layouts):
                full = reference(shape, seed=i)
                fulls.append(full)
                params.append(Parameter(dt.distribute_tensor(full, mesh, plc)))
            opt = cls(params, **kwargs)
            grads = [[reference(shape, seed=100 * s + i) for s in range(STEPS)] for i in range(len(params))]
            for s in range(STEPS):
                for p, g, plc in zip(params, grads, layouts):
                    p.grad = dt.distribute_tensor(g[s], mesh, plc)
                opt.step()
            for p, full, g, plc in zip(params, fulls, grads, layouts):
                want = ref(full, g, **kwargs)
                check.equal(p.to_torch(), want, f"{name} {shape} {plc}", exact=False, rtol=1e-12, atol=1e-12)
                for key, t in opt.state[p].items():
                    if isinstance(t, dt.DTensor):
                        check.true(t.placements == p.placements and t.to_local().shape == p.to_local().shape,
                                   f"{name} {plc}: state {key} has placements {t.placements}")


@pytest.mark.path_independent  # the step is local: no collective
def test_updates_match_pytorch_formulas_1d(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    _run(mesh1d, PLACEMENTS_1D, check)
    check.done()


@pytest.mark.path_independent  # the step is local: no collective
def test_updates_match_pytorch_formulas_2d(mesh2d: dt.DeviceMesh, check: Checker) -> None:
    _run(mesh2d, PLACEMENTS_2D, check)
    check.done()


@pytest.mark.path_independent  # the step is local: no collective
def test_step_moves_no_data(mesh1d: dt.DeviceMesh) -> None:
    p = Parameter(dt.randn(2 * SIZE + 1, 4, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)]))
    p.grad = dt.ones(2 * SIZE + 1, 4, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)])
    opt = dt.optim.AdamW([p])
    with dt.CommCounter() as counter:
        opt.step()
        opt.step()
    assert counter.count == 0


def test_param_groups_and_none_grads(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    a_full, b_full, c_full = reference((5, 2), seed=1), reference((3,), seed=2), reference((4,), seed=3)
    a = Parameter(dt.distribute_tensor(a_full, mesh1d, [dt.Shard(0)]))
    b = Parameter(dt.distribute_tensor(b_full, mesh1d, [dt.Replicate()]))
    c = Parameter(dt.distribute_tensor(c_full, mesh1d, [dt.Shard(0)]))
    opt = dt.optim.SGD([{"params": [a, c]}, {"params": [b], "lr": 0.5, "momentum": 0.9}], lr=0.1)
    ga, gb = reference((5, 2), seed=4), reference((3,), seed=5)
    for _ in range(2):
        a.grad = dt.distribute_tensor(ga, mesh1d, [dt.Shard(0)])
        b.grad = dt.distribute_tensor(gb, mesh1d, [dt.Replicate()])
        opt.step()
    check.equal(a.to_torch(), sgd_reference(a_full, [ga, ga], lr=0.1), "group 0", exact=False, rtol=1e-12)
    check.equal(b.to_torch(), sgd_reference(b_full, [gb, gb], lr=0.5, momentum=0.9), "group 1", exact=False,
                rtol=1e-12)
    check.equal(c.to_torch(), c_full, "a parameter without a gradient is untouched")
    check.true(c not in opt.state, "no state for a parameter that never had a gradient")
    opt.zero_grad(set_to_none=False)
    check.true(a.grad is not None and not a.grad.to_local().any(), "zero_grad(set_to_none=False) zeroes")
    opt.zero_grad()
    check.true(a.grad is None and b.grad is None, "zero_grad() drops gradients")
    check.done()


@pytest.mark.parametrize("cls,kwargs", [(dt.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                        (dt.optim.AdamW, {"lr": 0.01, "amsgrad": True})])
def test_state_dict_round_trip(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker,
                               cls: Any, kwargs: dict[str, Any]) -> None:
    """Stop after two steps, restore into a fresh optimizer (from DTensors, from complete arrays,
    and from DTensors in other placements), continue: the same as four uninterrupted steps."""
    layouts = [(mesh1d, [dt.Shard(0)]), (mesh1d, [dt.Replicate()]), (mesh2d, [dt.Shard(1), dt.Shard(0)])]
    shape = (2 * SIZE + 1, 3)
    fulls = [reference(shape, seed=i) for i in range(len(layouts))]
    grads = [[reference(shape, seed=10 * s + i + 50) for s in range(4)] for i in range(len(layouts))]

    def make() -> list[Parameter]:
        return [Parameter(dt.distribute_tensor(f, m, plc)) for f, (m, plc) in zip(fulls, layouts)]

    def steps(opt: Any, params: list[Parameter], which: range) -> None:
        for s in which:
            for p, g, (m, plc) in zip(params, grads, layouts):
                p.grad = dt.distribute_tensor(g[s], m, plc)
            opt.step()

    straight = make()
    steps(cls(straight, **kwargs), straight, range(4))
    for form in ("dtensor", "array", "other-placements"):
        first = make()
        opt = cls(first, **kwargs)
        steps(opt, first, range(2))
        sd = opt.state_dict()
        check.true(sorted(sd) == ["param_groups", "state"] and sd["param_groups"][0]["params"] == [0, 1, 2],
                   f"layout {sorted(sd)}")
        if form == "array":
            sd = {"state": {i: {k: v.to_torch() if isinstance(v, dt.DTensor) else v for k, v in s.items()}
                            for i, s in sd["state"].items()}, "param_groups": sd["param_groups"]}
        elif form == "other-placements":
            sd = {"state": {i: {k: v.redistribute(placements=[dt.Replicate()] * v.device_mesh.ndim)
                                if isinstance(v, dt.DTensor) else v for k, v in s.items()}
                            for i, s in sd["state"].items()}, "param_groups": sd["param_groups"]}
        second = [Parameter(dt.DTensor.from_local(p.to_local().copy(), p.device_mesh, p.placements, shape=p.shape))
                  for p in first]
        resumed = cls(second, lr=123.0)  # hyperparameters come back from the state_dict
        resumed.load_state_dict(sd)
        check.true(resumed.param_groups[0]["lr"] == kwargs["lr"], f"{form}: lr restored")
        steps(resumed, second, range(2, 4))
        for got, want in zip(second, straight):
            check.equal(got.to_torch(), want.to_torch(), f"{cls.__name__} {form}: resumed == straight",
                        exact=False, rtol=1e-12, atol=1e-14)
        for p in second:
            for key, t in resumed.state[p].items():
                if isinstance(t, dt.DTensor):
                    check.true(t.placements == p.placements, f"{form}: restored {key} has its parameter's placements")
    check.done()


def test_mismatched_gradient_is_refused_everywhere(mesh1d: dt.DeviceMesh) -> None:
    w = Parameter(dt.zeros(2 * SIZE + 1, 3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)]))
    b = Parameter(dt.zeros(3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Replicate()]))
    opt = dt.optim.AdamW([("fc.weight", w), ("fc.bias", b)])
    w.grad = dt.zeros(2 * SIZE + 1, 3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)])
    b.grad = dt.zeros(3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Partial("sum")])
    with pytest.raises(dt.PlacementError, match=r"fc\.bias.*Partial.*reduce_gradients"):
        opt.step()
    assert not opt.state, "a refused step changes nothing"
    with pytest.raises(dt.ShapeMismatchError, match=r"has shape \(4,\)"):  # refused where assigned, as in PyTorch
        b.grad = dt.zeros(4, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Replicate()])
    b._grad = dt.zeros(4, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Replicate()])  # behind the check
    with pytest.raises(dt.ShapeMismatchError, match=r"fc\.bias"):
        opt.step()
    b.grad = None
    p = Parameter(dt.zeros(3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Partial("sum")]))
    p.grad = dt.zeros(3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Partial("sum")])
    with pytest.raises(dt.PlacementError, match=r"parameter 0.*is Partial"):
        dt.optim.SGD([p], lr=0.1).step()


def test_bad_hyperparameters(mesh1d: dt.DeviceMesh) -> None:
    p = Parameter(dt.zeros(3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Replicate()]))
    for make, match in ((lambda: dt.optim.SGD([p], lr=-1), "lr"),
                        (lambda: dt.optim.SGD([p], lr=0.1, nesterov=True), "Nesterov"),
                        (lambda: dt.optim.AdamW([p], betas=(1.0, 0.9)), "beta"),
                        (lambda: dt.optim.AdamW([]), "empty"),
                        (lambda: dt.optim.AdamW([{"params": [p]}, {"params": [p]}]), "more than one")):
        with pytest.raises(ValueError, match=match):
            make()
    opt = dt.optim.SGD([p], lr=0.1)
    with pytest.raises(dt.StateDictError, match="groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})


# --- reduce_gradients and clip_grad_norm_ -------------------------------------------------

def _partial_grad(mesh: dt.DeviceMesh, shape: tuple[int, ...], seed: int, op: str = "sum") -> tuple[dt.DTensor, np.ndarray]:
    """A gradient whose pieces are different terms on every rank, and its reduced value."""
    terms = [reference(shape, seed=seed * 100 + r) for r in range(SIZE)]
    g = dt.DTensor.from_local(on_mesh(mesh, terms[RANK].copy()), mesh, [dt.Partial(op)] * mesh.ndim, shape=shape)
    return g, (sum(terms) if op == "sum" else sum(terms) / SIZE)


def _reduce_case(mesh: dt.DeviceMesh, grad_layouts: list[list[dt.Placement]], param_layouts: list[list[dt.Placement]],
                 shapes: list[tuple[int, int]], check: Checker) -> None:
    params, wants, before = [], [], []
    seed = 0
    for shape in shapes:
        for gl in grad_layouts:
            for pl in param_layouts:
                seed += 1
                op = "avg" if any(p == dt.Partial("avg") for p in gl) else "sum"
                g, want = _partial_grad(mesh, shape, seed, op)
                plain = [dt.Partial(op) if p == dt.Partial("avg") else p for p in gl]
                p = Parameter(dt.zeros(*shape, dtype=np.float64, device_mesh=mesh, placements=pl))
                p.grad = g.redistribute(placements=plain)
                params.append(p)
                wants.append(want)
                before.append(p.grad)
    reduce_gradients(params)
    for p, want, old in zip(params, wants, before):
        what = f"{list(old.placements)} -> {list(p.placements)} {p.shape}"
        assert p.grad is not None
        check.true(p.grad.placements == p.placements, f"{what}: grad placements {p.grad.placements}")
        check.true(p.grad.to_local().shape == p.to_local().shape, f"{what}: local shape")
        check.equal(p.grad.to_torch(), want, what, exact=False, rtol=1e-12, atol=1e-12)
        if old.placements == p.placements:
            check.true(p.grad is old, f"{what}: an already matching gradient is untouched")


def test_reduce_gradients_1d(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    shapes = [(n, 3) for n in lengths_for(SIZE)] + [(3, n) for n in (0, SIZE + 1)]
    _reduce_case(mesh1d, [[dt.Partial("sum")], [dt.Partial("avg")], [dt.Replicate()], [dt.Shard(0)]],
                 [[dt.Replicate()], [dt.Shard(0)], [dt.Shard(1)]], shapes, check)
    check.done()


def test_reduce_gradients_2d(mesh2d: dt.DeviceMesh, check: Checker) -> None:
    P, R, S0, S1 = dt.Partial("sum"), dt.Replicate(), dt.Shard(0), dt.Shard(1)
    _reduce_case(mesh2d, [[P, P], [P, S0], [S1, P], [P, R], [dt.Partial("avg")] * 2],
                 [[S0, R], [R, S1], [S0, S0], [S0, S1], [R, R], [S1, S0]],
                 [(0, 3), (2, 1), (SIZE + 1, 3), (7, 5)], check)
    check.done()


def test_reduce_gradients_packs_many_tensors(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh) -> None:
    """100 replicated and 100 sharded parameters with Partial gradients: one all-reduce and one
    reduce-scatter, where one collective per tensor would be 200."""
    def model() -> list[Parameter]:
        params = []
        for i in range(200):
            plc = [dt.Replicate()] if i % 2 else [dt.Shard(0)]
            p = Parameter(dt.zeros(2 * SIZE + 1, 3, dtype=np.float64, device_mesh=mesh1d, placements=plc))
            p.grad = _partial_grad(mesh1d, p.shape, i)[0]
            params.append(p)
        return params

    packed, single = model(), model()
    with dt.CommCounter() as c_packed:
        reduce_gradients(packed)
    with dt.CommCounter() as c_single:
        reduce_gradients(single, bucket_bytes=0)
    for a, b in zip(packed, single):
        assert a.grad is not None and b.grad is not None
        np.testing.assert_allclose(to_numpy(a.grad.to_local()), to_numpy(b.grad.to_local()), rtol=1e-13)
    if SIZE == 1:
        assert c_packed.count == c_single.count == 0
    else:
        assert sorted(c_packed.kinds()) == ["all_reduce", "reduce_scatter"], c_packed.kinds()
        assert c_single.count == 200
        assert c_packed.bytes_recv == c_single.bytes_recv
    small = [Parameter(dt.zeros(4, 4, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Replicate()]))
             for _ in range(10)]
    for i, p in enumerate(small):
        p.grad = _partial_grad(mesh1d, p.shape, i)[0]
    with dt.CommCounter() as c_cap:
        reduce_gradients(small, bucket_bytes=3 * 128)  # three 128-byte gradients per bucket
    assert c_cap.count == (4 if SIZE > 1 else 0)
    # a 2-D mesh: one collective per (mesh dim, kind) bucket
    R, S0 = dt.Replicate(), dt.Shard(0)
    grid = [Parameter(dt.zeros(5, 2, dtype=np.float64, device_mesh=mesh2d, placements=[S0, R])) for _ in range(20)]
    for i, p in enumerate(grid):
        p.grad = _partial_grad(mesh2d, p.shape, i)[0]
    with dt.CommCounter() as c_grid:
        reduce_gradients(grid)
    want = {(kind, k) for kind, k, n in (("reduce_scatter", 0, mesh2d.shape[0]), ("all_reduce", 1, mesh2d.shape[1]))
            if n > 1}
    assert {(r.kind, r.mesh_dim) for r in c_grid.records} == want and c_grid.count == len(want)


def test_reduce_gradients_refuses_mismatched_shapes(mesh1d: dt.DeviceMesh) -> None:
    p = Parameter(dt.zeros(3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Replicate()]))
    p._grad = dt.zeros(4, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Partial()])  # behind .grad's check
    with pytest.raises(dt.ShapeMismatchError, match="parameter 0"):
        reduce_gradients([p])


def _torch_total_norm(fulls: list[np.ndarray], p: float) -> float:
    """PyTorch's total: the p-norm of the gradients' own p-norms (NumPy's vector norms; p = 0
    thus counts the gradients with a nonzero entry; an empty gradient has no -inf norm)."""
    with np.errstate(divide="ignore"):
        norms = [np.linalg.norm(f.ravel(), ord=p) for f in fulls if f.size or p != -math.inf]
        return float(np.linalg.norm(np.array(norms), ord=p))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, 0.5, math.inf, -math.inf, 0.0, -1.0])
def test_clip_grad_norm(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker, norm_type: float) -> None:
    R, S0, S1 = dt.Replicate(), dt.Shard(0), dt.Shard(1)
    layouts = [(mesh2d, [S0, R]), (mesh2d, [R, R]), (mesh2d, [R, S1]), (mesh2d, [S1, S0])]
    for mesh, plcs in ((mesh1d, [[S0], [S1], [R], [S0]]), (mesh2d, [plc for _, plc in layouts])):
        for max_norm in (1e9, 0.5):
            fulls = [reference(shape, seed=i) for i, shape in enumerate([(SIZE + 1, 3), (2, 2 * SIZE + 1), (0, 4), (5, 1)])]
            if norm_type == 0:
                fulls[3][:] = 0  # p = 0 counts the gradients with a nonzero entry: 2 of 4
            params = []
            for full, plc in zip(fulls, plcs):
                p = Parameter(dt.zeros(*full.shape, dtype=np.float64, device_mesh=mesh, placements=plc))
                p.grad = dt.distribute_tensor(full, mesh, plc)
                params.append(p)
            with dt.CommCounter() as counter:
                total = clip_grad_norm_(params, max_norm, norm_type)
            want = _torch_total_norm(fulls, norm_type)
            check.true(isinstance(total, float) and math.isclose(total, want, rel_tol=1e-12),
                       f"{mesh.shape} p={norm_type}: norm {total} != {want}")
            check.true(counter.count == (1 if SIZE > 1 else 0), f"{counter.count} collectives")
            scale = min(1.0, max_norm / (want + 1e-6))
            for p, full in zip(params, fulls):
                assert p.grad is not None
                check.equal(p.grad.to_torch(), full * scale, f"{mesh.shape} clipped {list(p.placements)}",
                            exact=False, rtol=1e-12, atol=1e-14)
    check.done()


def test_clip_grad_norm_refuses_partial(mesh1d: dt.DeviceMesh) -> None:
    p = Parameter(dt.zeros(3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Replicate()]))
    p.grad = dt.zeros(3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Partial()])
    with pytest.raises(dt.PlacementError, match="reduce_gradients"):
        clip_grad_norm_([p], 1.0)
    p.grad = dt.full(3, np.inf, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Replicate()])
    with pytest.raises(RuntimeError, match="inf"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
