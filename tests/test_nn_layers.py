"""Layers and nn.functional forwards against NumPy on complete arrays, for every placement
each accepts, uneven shapes included (autograd makes them trainable later)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from conftest import RANK, SIZE, Checker, lengths_for, reference
from helpers import numeric_grad

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.nn import functional as F

R, S0, S1 = dt.Replicate(), dt.Shard(0), dt.Shard(1)
ERF = np.vectorize(math.erf, otypes=[np.float64])


def _np_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis, keepdims=True, initial=-np.inf))
    return e / e.sum(axis, keepdims=True)


ELEMENTWISE: dict[str, tuple[Callable[[dt.DTensor], dt.DTensor], Callable[[np.ndarray], np.ndarray]]] = {
    "relu": (F.relu, lambda x: np.maximum(x, 0)),
    "silu": (F.silu, lambda x: x / (1 + np.exp(-x))),
    "gelu-tanh": (lambda x: F.gelu(x, approximate="tanh"),
                  lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))),
    "SiLU module": (nn.SiLU(), lambda x: x / (1 + np.exp(-x))),
    "GELU(tanh) module": (nn.GELU("tanh"),
                          lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))),
}
ROW_WISE: dict[str, tuple[Callable[[dt.DTensor], dt.DTensor], Callable[[np.ndarray], np.ndarray]]] = {
    "softmax": (F.softmax, _np_softmax),
    "log_softmax": (F.log_softmax, lambda x: np.log(_np_softmax(x))),
    "layer_norm": (lambda x: F.layer_norm(x, x.shape[-1], eps=1e-5),
                   lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)),
    "rms_norm": (lambda x: F.rms_norm(x, eps=1e-6), lambda x: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)),
}


def _inputs(mesh: dt.DeviceMesh, layouts: list[list[dt.Placement]]) -> list[tuple[np.ndarray, dt.DTensor]]:
    out = []
    for n in lengths_for(SIZE):
        for shape in ((n, 5), (3, n)):
            full = reference(shape, seed=n)
            out += [(full, dt.distribute_tensor(full, mesh, plc)) for plc in layouts]
    return out


@pytest.mark.path_independent  # elementwise layers never communicate
def test_elementwise_every_placement(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    for mesh, layouts in ((mesh1d, [[S0], [S1], [R]]), (mesh2d, [[S0, S1], [R, S0], [S1, R], [R, R]])):
        for full, x in _inputs(mesh, layouts):
            for name, (fn, ref) in ELEMENTWISE.items():
                y = fn(x)
                check.true(y.placements == x.placements, f"{name}: placements {y.placements}")
                check.equal(y.to_torch(), ref(full), f"{name} {full.shape} {list(x.placements)}", exact=False,
                            rtol=1e-12, atol=1e-12)
    check.done()


def test_gelu_exact(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    for full, x in _inputs(mesh1d, [[S0], [S1], [R]]):
        want = 0.5 * full * (1 + ERF(full / math.sqrt(2)))
        check.equal(nn.GELU()(x).to_torch(), want, f"GELU {full.shape}", exact=False, rtol=1e-12, atol=1e-12)
    check.done()


def test_row_wise_every_placement(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    """Softmax and the norms act on the last dim, which must be whole: Shard(0) or Replicate."""
    for mesh, layouts in ((mesh1d, [[S0], [R]]), (mesh2d, [[S0, R], [R, S0], [S0, S0], [R, R]])):
        for full, x in _inputs(mesh, layouts):
            for name, (fn, ref) in ROW_WISE.items():
                check.equal(fn(x).to_torch(), ref(full), f"{name} {full.shape} {list(x.placements)}",
                            exact=False, rtol=1e-10, atol=1e-12)
    check.done()


def test_norm_modules_with_weights(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    full = reference((2 * SIZE + 1, 6), seed=3)
    w, b = reference((6,), seed=4), reference((6,), seed=5)
    rms = nn.RMSNorm(6, device_mesh=mesh1d, dtype=np.float64)
    ln = nn.LayerNorm(6, device_mesh=mesh1d, dtype=np.float64)
    rms.load_state_dict({"weight": w})
    ln.load_state_dict({"weight": w, "bias": b})
    eps = float(np.finfo(np.float64).eps)
    for plc in ([S0], [R]):
        x = dt.distribute_tensor(full, mesh1d, plc)
        check.equal(rms(x).to_torch(), full / np.sqrt((full ** 2).mean(-1, keepdims=True) + eps) * w, "RMSNorm",
                    exact=False, rtol=1e-12)
        want = (full - full.mean(-1, keepdims=True)) / np.sqrt(full.var(-1, keepdims=True) + 1e-5) * w + b
        check.equal(ln(x).to_torch(), want, "LayerNorm", exact=False, rtol=1e-10, atol=1e-12)
    check.done()


def test_linear_and_mse_loss(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    for n in lengths_for(SIZE):
        x_full, w_full, b_full = reference((n, 4), seed=1), reference((3, 4), seed=2), reference((3,), seed=3)
        t_full = reference((n, 3), seed=4)
        for xp, wp, bp in (([S0], [R], [R]), ([R], [S0], [S0]), ([R], [R], [R])):
            x, w = dt.distribute_tensor(x_full, mesh1d, xp), dt.distribute_tensor(w_full, mesh1d, wp)
            y = F.linear(x, w, dt.distribute_tensor(b_full, mesh1d, bp))
            want = x_full @ w_full.T + b_full
            check.equal(y.to_torch(), want, f"linear {n} {xp} {wp}", exact=False, rtol=1e-12, atol=1e-12)
            target = dt.distribute_tensor(t_full, mesh1d, y.placements)
            for reduction, ref in (("mean", lambda d: (d ** 2).mean() if d.size else np.nan),
                                   ("sum", lambda d: (d ** 2).sum()), ("none", lambda d: d ** 2)):
                loss = F.mse_loss(y, target, reduction=reduction)
                check.equal(loss.to_torch(), ref(want - t_full), f"mse_loss {reduction} {n} {xp} {wp}",
                            exact=False, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="reduction"):
        F.mse_loss(y, target, reduction="avg")
    check.done()


def test_dropout_same_mask_on_every_plan(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    p = 0.3
    for shape in ((2 * SIZE + 1, 7), (0, 3), (SIZE - 1, 2)):
        full = reference(shape, seed=7) + 10.0  # no zeros of its own
        dt.manual_seed(11)
        u = dt.rand(*shape, dtype=np.float64, device_mesh=mesh1d, placements=[R]).to_torch()
        want = full * ((u >= p) * (1 / (1 - p)))
        layouts = [(mesh1d, [S0]), (mesh1d, [S1]), (mesh1d, [R]), (mesh2d, [S1, S0]), (mesh2d, [R, S0])]
        for mesh, plc in layouts:
            dt.manual_seed(11)
            drop = nn.Dropout(p)
            check.equal(drop(dt.distribute_tensor(full, mesh, plc)).to_torch(), want,
                        f"dropout {shape} {mesh.shape} {plc}", exact=False, rtol=1e-15)
            drop.eval()
            x = dt.distribute_tensor(full, mesh, plc)
            check.true(drop(x) is x, "eval mode is the identity")
        # a Partial input: the mask is replicated over the Partial dim, the terms scale alike
        terms = [reference(shape, seed=30 + r) for r in range(SIZE)]
        x = dt.DTensor.from_local(terms[RANK].copy(), mesh1d, [dt.Partial()], shape=shape)
        dt.manual_seed(11)
        got = F.dropout(x, p)
        check.true(got.placements == (dt.Partial(),), "dropout keeps Partial")
        check.equal(got.to_torch(), sum(terms) * ((u >= p) * (1 / (1 - p))), "dropout of a Partial input",
                    exact=False, rtol=1e-12, atol=1e-12)
    big = F.dropout(dt.ones(200, 50, dtype=np.float64, device_mesh=mesh1d, placements=[S0]), p).to_torch()
    check.true(abs(float((big == 0).mean()) - p) < 0.03, f"dropped fraction {(big == 0).mean()} for p={p}")
    with pytest.raises(ValueError, match="between 0 and 1"):
        nn.Dropout(1.5)
    check.done()


def test_train_eval_recurse() -> None:
    model = nn.Sequential(nn.Dropout(0.1), nn.Sequential(nn.Dropout(0.2), nn.SiLU()))
    assert all(m.training for m in model.modules())
    assert model.eval() is model and not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())


def _embedding_cases(mesh: dt.DeviceMesh) -> list[tuple[list[dt.Placement], list[dt.Placement], list[dt.Placement]]]:
    """(weight, index, expected output) placements."""
    if mesh.ndim == 1:
        return [([R], [R], [R]), ([R], [S0], [S0]), ([R], [S1], [S1]), ([S1], [R], [dt.Shard(2)]),
                ([S0], [R], [dt.Partial()])]
    return [([S0, R], [R, S0], [dt.Partial(), S0]), ([R, S1], [S1, R], [S1, dt.Shard(2)]),
            ([S0, S0], [R, R], [dt.Partial(), dt.Partial()]), ([S0, S1], [R, R], [dt.Partial(), dt.Shard(2)])]


def test_embedding_every_rule(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    for num in (1, SIZE, 2 * SIZE + 1):
        w_full = reference((num, 5), seed=num)
        idx_full = np.random.default_rng(num).integers(0, num, size=(SIZE + 1, 3))
        want = w_full[idx_full]
        for mesh in (mesh1d, mesh2d):
            for wp, ip, op in _embedding_cases(mesh):
                weight = dt.distribute_tensor(w_full, mesh, wp)
                y = F.embedding(dt.distribute_tensor(idx_full, mesh, ip), weight)
                check.true(y.placements == tuple(op), f"embedding {wp} {ip}: placements {y.placements} != {op}")
                check.equal(y.to_torch(), want, f"embedding num={num} {wp} {ip}")
            emb = nn.Embedding(num, 5, device_mesh=mesh, dtype=np.float64)
            emb.load_state_dict({"weight": w_full})
            check.equal(emb(idx_full).to_torch(), want, f"Embedding module, plain index, num={num}")
    check.done()


def test_embedding_parallel_styles(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """Vocab-parallel (RowwiseParallel: rows sharded, one all-reduce of the lookup) and
    ColwiseParallel (columns sharded, no communication)."""
    num = 2 * SIZE + 1
    w_full = reference((num, 4), seed=2)
    idx = np.arange(num)[::-1].reshape(1, num) % num
    for style, out_layout, kinds in ((nn.RowwiseParallel(), R, ["all_reduce"]),
                                     (nn.RowwiseParallel(output_layouts=S0, use_local_output=False), S0,
                                      ["reduce_scatter"]),
                                     (nn.ColwiseParallel(use_local_output=False), dt.Shard(2), [])):
        emb = nn.Embedding(num, 4, device_mesh=mesh1d, dtype=np.float64)
        emb.load_state_dict({"weight": w_full})
        dt.parallelize_module(emb, mesh1d, style)
        with dt.CommCounter() as counter:
            y = emb(idx)
        if isinstance(y, dt.DTensor):
            check.true(y.placements == (out_layout,), f"{style}: output {y.placements}")
            y = y.to_torch()
        check.equal(y, w_full[idx], f"{style}")
        check.true(counter.kinds() == (kinds if SIZE > 1 else []), f"{style}: collectives {counter.kinds()}")
        check.equal(emb.weight.to_torch(), w_full, f"{style}: weight")
    check.done()


def test_embedding_errors(mesh1d: dt.DeviceMesh) -> None:
    weight = dt.distribute_tensor(reference((4, 2)), mesh1d, [S1])
    with pytest.raises(dt.PlacementError, match="matches no rule"):
        F.embedding(dt.distribute_tensor(np.zeros((SIZE, 2), dtype=np.int64), mesh1d, [S0]), weight)
    bad = np.zeros((SIZE, 2), dtype=np.int64)
    bad[-1, -1] = 4  # only on the last rank's piece
    with pytest.raises(IndexError, match="out of range"):
        F.embedding(dt.distribute_tensor(bad, mesh1d, [S0]), dt.distribute_tensor(reference((4, 2)), mesh1d, [R]))
    with pytest.raises(TypeError, match="integer"):
        F.embedding(np.zeros(3), weight)


def test_functional_names() -> None:
    names = {"linear", "relu", "gelu", "silu", "softmax", "log_softmax", "dropout", "layer_norm", "embedding",
             "mse_loss"}
    assert names <= set(F.__all__) and all(callable(getattr(F, n)) for n in names)


def test_module_reprs() -> None:
    assert repr(nn.GELU()) == "GELU(approximate='none')" and repr(nn.Dropout(0.25)) == "Dropout(p=0.25)"


# --- training: every layer's gradients against float64 finite differences --------------------
def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _lin(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    return x @ w.T + b


def _ln(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + float(np.finfo(np.float64).eps)) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


H = SIZE + 1  # hidden width: uneven over the ranks, below the rank count's double
LayerCase = tuple[str, Callable[[dt.DeviceMesh], nn.Module], dict[str, np.ndarray], Callable[..., np.ndarray]]


def _layer_cases() -> list[LayerCase]:
    """(name, build(mesh) -> module, parameters by name, NumPy forward f(x, *parameters))."""
    p = {"w1": reference((H, 4), seed=1), "b1": reference((H,), seed=2), "w2": reference((3, H), seed=3),
         "b2": reference((3,), seed=4), "g": reference((4,), seed=5) + 2.0, "beta": reference((4,), seed=6)}
    f64 = np.float64

    def mlp(mesh: dt.DeviceMesh) -> nn.Module:
        return nn.Sequential(nn.Linear(4, H, device_mesh=mesh, dtype=f64), nn.GELU("tanh"),
                             nn.Linear(H, 3, device_mesh=mesh, dtype=f64))

    def tp_mlp(mesh: dt.DeviceMesh) -> nn.Module:
        return dt.parallelize_module(mlp(mesh), mesh, {"0": nn.ColwiseParallel(use_local_output=False),
                                                       "2": nn.RowwiseParallel(use_local_output=False)})

    mlp_params = {"0.weight": p["w1"], "0.bias": p["b1"], "2.weight": p["w2"], "2.bias": p["b2"]}
    return [
        ("Linear", lambda m: nn.Linear(4, H, device_mesh=m, dtype=f64), {"weight": p["w1"], "bias": p["b1"]}, _lin),
        ("LayerNorm", lambda m: nn.LayerNorm(4, device_mesh=m, dtype=f64), {"weight": p["g"], "bias": p["beta"]},
         _ln),
        ("RMSNorm", lambda m: nn.RMSNorm(4, device_mesh=m, dtype=f64), {"weight": p["g"]}, _rms),
        ("GELU", lambda m: nn.GELU("tanh"), {}, _gelu_tanh),
        ("SiLU", lambda m: nn.SiLU(), {}, _silu),
        ("Sequential", lambda m: nn.Sequential(nn.LayerNorm(4, device_mesh=m, dtype=f64), nn.SiLU(),
                                               nn.Linear(4, H, device_mesh=m, dtype=f64)),
         {"0.weight": p["g"], "0.bias": p["beta"], "2.weight": p["w1"], "2.bias": p["b1"]},
         lambda x, g, beta, w, b: _lin(_silu(_ln(x, g, beta)), w, b)),
        ("MLP", mlp, mlp_params, lambda x, w1, b1, w2, b2: _lin(_gelu_tanh(_lin(x, w1, b1)), w2, b2)),
        ("Colwise->GELU->Rowwise", tp_mlp, mlp_params,
         lambda x, w1, b1, w2, b2: _lin(_gelu_tanh(_lin(x, w1, b1)), w2, b2)),
    ]


@pytest.mark.parametrize("case", _layer_cases(), ids=lambda c: c[0])
def test_layer_gradients(case: LayerCase, mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    """d sum(layer(x) * C) / d(x, parameters) equals the finite difference of the NumPy layer,
    for batch-sharded and replicated inputs (empty pieces included); after reduce_gradients
    every gradient is placed as its parameter."""
    name, build, params, ref = case
    tp = name.startswith("Colwise")
    layouts = [(mesh1d, [R])] if tp else [(mesh1d, [S0]), (mesh1d, [R]), (mesh2d, [S0, R]), (mesh2d, [R, S0])]
    for n in (0, SIZE + 1) if not tp else (2,):
        full = reference((n, 4), seed=n + 7)
        arrays = [full, *params.values()]
        for mesh, plc in layouts:
            model = build(mesh)
            if params:
                model.load_state_dict(params)
            x = dt.distribute_tensor(full, mesh, plc).requires_grad_()
            y = model(x)
            want = ref(*arrays)
            check.equal(y.to_torch(), want, f"{name} forward {n} {plc}", exact=False, rtol=1e-12, atol=1e-12)
            cot = reference(want.shape, seed=42)
            (y * dt.distribute_tensor(cot, mesh, [R] * mesh.ndim)).sum().backward()
            named = dict(model.named_parameters())
            dt.nn.utils.reduce_gradients(list(named.values()))
            for i, (pname, tensor) in enumerate([("x", x)] + [(k, named[k]) for k in params]):
                label = f"{name} d/d{pname} n={n} {mesh.shape} {plc}"
                if tensor.grad is None:
                    check.true(False, f"{label}: no gradient")
                    continue
                check.equal(tensor.grad.to_torch(), numeric_grad(ref, arrays, i, cot), label, exact=False,
                            rtol=1e-6, atol=1e-7)
                # a Replicate input of Colwise-sharded compute gets Partial("sum"); the rest are reduced
                placed = (dt.Partial(),) if tp and pname == "x" else tensor.placements
                check.true(tensor.grad.placements == placed, f"{label}: placed {tensor.grad.placements}")
    check.done()


def test_dropout_gradient_is_its_mask(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    p, shape = 0.3, (2 * SIZE + 1, 5)
    full, cot = reference(shape, seed=1), reference(shape, seed=2)
    dt.manual_seed(5)
    keep = (dt.rand(*shape, dtype=np.float64, device_mesh=mesh1d, placements=[R]).to_torch() >= p) / (1 - p)
    for mesh, plc in ((mesh1d, [S0]), (mesh1d, [S1]), (mesh1d, [R]), (mesh2d, [S1, S0])):
        x = dt.distribute_tensor(full, mesh, plc).requires_grad_()
        dt.manual_seed(5)
        (nn.Dropout(p)(x) * dt.distribute_tensor(cot, mesh, [R] * mesh.ndim)).sum().backward()
        assert x.grad is not None
        check.equal(x.grad.to_torch(), cot * keep, f"dropout grad {plc}", exact=False, rtol=1e-15)
    check.done()


def test_embedding_gradient_every_rule(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    """Each looked-up row's gradient is added into its weight row (repeats summed); a
    vocab-parallel Shard(0) weight gets a Shard(0) gradient and backward moves nothing."""
    for num in (1, SIZE, 2 * SIZE + 1):
        w_full = reference((num, 5), seed=num)
        idx_full = np.random.default_rng(num).integers(0, num, size=(SIZE + 1, 3))
        cot = reference(idx_full.shape + (5,), seed=3)
        want = np.zeros_like(w_full)
        np.add.at(want, idx_full, cot)
        for mesh in (mesh1d, mesh2d):
            for wp, ip, _ in _embedding_cases(mesh):
                weight = dt.distribute_tensor(w_full, mesh, wp).requires_grad_()
                y = F.embedding(dt.distribute_tensor(idx_full, mesh, ip), weight)
                loss = (y * dt.distribute_tensor(cot, mesh, [R] * mesh.ndim)).sum()
                with dt.CommCounter() as moved:
                    loss.backward()
                assert weight.grad is not None
                label = f"embedding grad num={num} {mesh.shape} {wp} {ip}"
                check.equal(weight.grad.to_torch(), want, label, exact=False, rtol=1e-12, atol=1e-12)
                declared = tuple(w if isinstance(w, dt.Shard) else dt.Partial() if isinstance(i, dt.Shard) else R
                                 for w, i in zip(wp, ip))
                check.true(weight.grad.placements == declared, f"{label}: placed {weight.grad.placements}")
                check.true(moved.count == 0, f"{label}: backward moved {moved.kinds()}")
    # vocab-parallel through the style: the lookup's all-reduce has an identity adjoint
    emb = nn.Embedding(2 * SIZE + 1, 5, device_mesh=mesh1d, dtype=np.float64)
    emb.load_state_dict({"weight": reference((2 * SIZE + 1, 5), seed=2 * SIZE + 1)})
    dt.parallelize_module(emb, mesh1d, nn.RowwiseParallel(use_local_output=False))
    idx = np.random.default_rng(2 * SIZE + 1).integers(0, 2 * SIZE + 1, size=(SIZE + 1, 3))
    (emb(idx) * dt.distribute_tensor(cot, mesh1d, [R])).sum().backward()
    want = np.zeros((2 * SIZE + 1, 5))
    np.add.at(want, idx, cot)
    assert emb.weight.grad is not None
    check.equal(emb.weight.grad.to_torch(), want, "vocab-parallel Embedding grad", exact=False, rtol=1e-12)
    check.true(emb.weight.grad.placements == (S0,), f"vocab-parallel grad placed {emb.weight.grad.placements}")
    check.done()
