"""Habits from PyTorch and NumPy (issue 13): Python scalar conversions, the NumPy protocol,
pickling, redistribute's positional argument, layers on plain arrays and the input check of
RowwiseParallel. Every decision is metadata, so every rank returns the same value or raises
the same error (the collective verdict fails a test where ranks differ)."""

from __future__ import annotations

import copy
import itertools
import math
import os
import pickle
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import SIZE, Checker, lengths_for, reference

import dtorch_mpi as dt
from dtorch_mpi import nn

# metadata decisions and all_reduce (whose MPI call is the same on every path)
pytestmark = pytest.mark.path_independent

R, S0, S1 = dt.Replicate(), dt.Shard(0), dt.Shard(1)
ERF = np.vectorize(math.erf, otypes=[np.float64])


def _layouts(mesh: dt.DeviceMesh, ndim: int) -> list[list[dt.Placement]]:
    """Every combination of Replicate, Partial("sum") and Shard(d) over the mesh dims."""
    choices = [R, dt.Partial("sum"), dt.Partial("max")] + [dt.Shard(d) for d in range(ndim)]
    return [list(c) for c in itertools.product(choices, repeat=mesh.ndim)]


# --- bool(), float(), int(), item() ------------------------------------------------------------
@pytest.mark.parametrize("value", [0.0, 2.5, -3.75, 1.0])
def test_one_element_conversions(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker, value: float) -> None:
    """A one-element tensor converts where its value is local (every mesh dim Replicate) and
    names the redistribute otherwise, for every layout of shapes (), (1,) and (1, 1)."""
    for mesh, shape in itertools.product((mesh1d, mesh2d), ((), (1,), (1, 1))):
        full = np.full(shape, value)
        for plc in _layouts(mesh, len(shape)):
            x = dt.distribute_tensor(full, mesh, plc)
            if all(p == R for p in plc):
                check.true(bool(x) is bool(value) and float(x) == value and int(x) == int(value)
                           and x.item() == value and type(x.item()) is float, f"{shape} {plc}: value {value}")
                continue
            for convert in (bool, float, int, dt.DTensor.item):
                with pytest.raises(dt.PlacementError, match=r"is not local .*x\.redistribute\(placements=\["):
                    convert(x)
            replicated = x.redistribute(placements=[R] * mesh.ndim)
            check.true(float(replicated) == value, f"{shape} {plc}: after redistribute")
    check.done()


@pytest.mark.parametrize("plc", [[R], [S0]])
def test_conversions_of_many_or_no_elements(mesh1d: dt.DeviceMesh, plc: list[dt.Placement]) -> None:
    for n in lengths_for(SIZE):
        if n == 1:
            continue
        x = dt.distribute_tensor(np.zeros(n), mesh1d, plc)
        with pytest.raises(ValueError, match="ambiguous" if n else "empty DTensor is ambiguous"):
            bool(x)
        for convert in (float, int, dt.DTensor.item):
            with pytest.raises(ValueError, match=rf"one-element DTensor .* shape \({n},\)"):
                convert(x)


def test_if_loss_below_tol_takes_the_right_branch(mesh1d: dt.DeviceMesh) -> None:
    """The habit that used to fall back to len(): ``if loss < tol:`` on a replicated scalar."""
    x = dt.distribute_tensor(np.array([0.0]), mesh1d, [R])
    assert not bool(x)
    data = reference((2 * SIZE + 1, 3))
    loss = (dt.distribute_tensor(data, mesh1d, [S0]) ** 2).mean()
    assert loss.placements == (dt.Partial("sum"),) or SIZE == 1
    loss = loss.redistribute(placements=[R])
    want = float((data ** 2).mean())
    assert math.isclose(float(loss), want, rel_tol=1e-12)
    assert bool(loss < want + 1) and not bool(loss < want - 1)
    with pytest.raises(ValueError, match="more than one element is ambiguous"):
        bool(dt.zeros(5, 4, device_mesh=mesh1d, placements=[R]) > 1)


# --- the NumPy protocol ------------------------------------------------------------------------
UFUNCS: dict[str, tuple[Callable[[Any], Any], Callable[[np.ndarray], np.ndarray]]] = {
    "np.exp(x)": (np.exp, np.exp),
    "np.sqrt(abs(x))": (lambda x: np.sqrt(np.abs(x)), lambda a: np.sqrt(np.abs(a))),
    "np.float64(2) * x": (lambda x: np.float64(2) * x, lambda a: np.float64(2) * a),
    "np.float32(1.5) + x": (lambda x: np.float32(1.5) + x, lambda a: np.float32(1.5) + a),
    "np.float64(0.25) < x": (lambda x: np.float64(0.25) < x, lambda a: np.float64(0.25) < a),
    "np.maximum(x, x * 2)": (lambda x: np.maximum(x, x * 2), lambda a: np.maximum(a, a * 2)),
    "np.power(x, 2)": (lambda x: np.power(x, 2), lambda a: np.power(a, 2)),
    "np.negative(x)": (np.negative, np.negative),
    "np.equal(x, x)": (lambda x: np.equal(x, x), lambda a: np.equal(a, a)),
}


def test_numpy_ufuncs_run_the_dtorch_operator(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    """A ufunc called as a function is the dtorch operator of that name: same rules and
    placements, no communication, values equal to NumPy on the complete array."""
    for mesh, n in itertools.product((mesh1d, mesh2d), lengths_for(SIZE)):
        full = reference((n, 3), seed=n)
        for plc in ([R] * mesh.ndim, [S0] + [R] * (mesh.ndim - 1), [S1] * mesh.ndim):
            x = dt.distribute_tensor(full, mesh, plc)
            for name, (call, ref) in UFUNCS.items():
                with dt.CommCounter() as moved:
                    got = call(x)
                check.true(isinstance(got, dt.DTensor) and got.placements == tuple(plc) and not moved.kinds(),
                           f"{name} {plc}: {got!r}, moved {moved.kinds()}")
                check.equal(got.to_torch(), ref(full), f"{name} n={n} {plc}")
    check.done()


REFUSED: dict[str, Callable[[dt.DTensor], Any]] = {
    "np.asarray": np.asarray, "np.array": np.array, "list": list, "iter": iter,
    "unpack": lambda x: [*x], "np.sum": np.sum, "np.concatenate": lambda x: np.concatenate([x, x]),
    "np.add.reduce": np.add.reduce, "np.exp(out=)": lambda x: np.exp(x, out=np.empty(x.shape)),
    "np.ldexp (no dtorch op)": lambda x: np.ldexp(x, 2),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_numpy_protocol_refuses_hidden_gathers(mesh1d: dt.DeviceMesh, name: str) -> None:
    """No implicit conversion to NumPy (it would gather without saying so): a TypeError that
    names ``to_torch()`` and ``to_local()``, the same for every placement (even Replicate)."""
    for plc in ([R], [S0], [dt.Partial("sum")]):
        x = dt.distribute_tensor(reference((2 * SIZE + 1, 2)), mesh1d, plc)
        with pytest.raises(TypeError, match=r"to_torch\(\).*to_local\(\)"):
            REFUSED[name](x)


def test_plain_array_operands_are_refused_either_side(mesh1d: dt.DeviceMesh) -> None:
    """``ndarray + x`` is refused exactly as ``x + ndarray`` is (a plain array is not an
    operand: make it a DTensor explicitly); Python and NumPy scalars work on both sides."""
    x = dt.distribute_tensor(reference((SIZE + 1, 2)), mesh1d, [S0])
    a = np.ones((SIZE + 1, 2))
    for expr in (lambda: a + x, lambda: x + a, lambda: a @ x.T, lambda: a < x, lambda: a == x):
        with pytest.raises(TypeError, match="not a DTensor; make it one explicitly"):
            expr()
    assert np.array_equal((np.int64(3) - x).to_torch(), 3 - x.to_torch())


def test_pickle_points_to_save_and_to_torch(mesh1d: dt.DeviceMesh) -> None:
    x = dt.ones(SIZE + 1, device_mesh=mesh1d, placements=[S0])
    p = nn.Linear(2, 3, device_mesh=mesh1d).weight
    for dump, objs in ((pickle.dumps, (x, p, {"w": p})), (copy.deepcopy, (x, p, {"w": p})), (copy.copy, (x, p))):
        for obj in objs:
            with pytest.raises(TypeError, match=r"cannot be pickled.*dt\.save.*to_torch\(\).*clone\(\)"):
                dump(obj)
    assert np.array_equal(pickle.loads(pickle.dumps(x.to_torch())), np.ones(SIZE + 1))


def test_redistribute_positional_placements(mesh1d: dt.DeviceMesh) -> None:
    x = dt.ones(SIZE + 1, device_mesh=mesh1d, placements=[S0])
    for bad in ([R], (R,), R):
        with pytest.raises(TypeError, match=r"first positional argument is device_mesh.*placements="):
            x.redistribute(bad)  # type: ignore[arg-type]
    assert x.redistribute(mesh1d, [R]).placements == (R,)
    assert x.redistribute(placements=[R]).placements == (R,)


# --- layers on plain arrays --------------------------------------------------------------------
def _ln(a: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + eps)


def test_layers_with_parameters_lift_a_plain_array(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh,
                                                  check: Checker) -> None:
    """Linear, LayerNorm, RMSNorm take a plain array as the complete value (Replicate, no
    communication) and return a DTensor equal to NumPy and to the same call on a DTensor."""
    for mesh, rows in itertools.product((mesh1d, mesh2d), lengths_for(SIZE)):
        a = reference((rows, 5), seed=rows)
        lin = nn.Linear(5, 3, device_mesh=mesh, dtype=np.float64)
        w, b = lin.weight.to_torch(), lin.bias.to_torch()
        cases = {"Linear": (lin, a @ w.T + b), "LayerNorm": (nn.LayerNorm(5, device_mesh=mesh, dtype=np.float64), _ln(a)),
                 "RMSNorm": (nn.RMSNorm(5, eps=1e-6, device_mesh=mesh, dtype=np.float64),
                             a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6))}
        for name, (module, want) in cases.items():
            with dt.CommCounter() as moved:
                got = module(a)
            check.true(isinstance(got, dt.DTensor) and got.placements == (R,) * mesh.ndim and not moved.kinds(),
                       f"{name}({rows} rows): {got!r}, moved {moved.kinds()}")
            check.equal(got.to_torch(), want, f"{name} rows={rows}", exact=False)
            check.equal(module(dt.distribute_tensor(a, mesh, [R] * mesh.ndim)).to_torch(), got.to_torch(),
                        f"{name} rows={rows}: array and DTensor inputs agree")
    check.done()


ELEMENTWISE: dict[str, tuple[nn.Module, Callable[[np.ndarray], np.ndarray]]] = {
    "ReLU": (nn.ReLU(), lambda a: np.maximum(a, 0)),
    "GELU": (nn.GELU(), lambda a: 0.5 * a * (1 + ERF(a / math.sqrt(2)))),
    "GELU(tanh)": (nn.GELU("tanh"),
                   lambda a: 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))),
    "SiLU": (nn.SiLU(), lambda a: a / (1 + np.exp(-a))),
}


def test_elementwise_layers_keep_a_plain_array(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    for rows in lengths_for(SIZE):
        a = reference((rows, 4), seed=rows)
        for name, (module, ref) in ELEMENTWISE.items():
            got = module(a)
            check.true(type(got) is np.ndarray, f"{name}: {type(got).__name__}")
            check.equal(got, ref(a), f"{name} rows={rows}", exact=False, rtol=1e-12, atol=1e-14)
            check.equal(module(dt.distribute_tensor(a, mesh1d, [S0])).to_torch(), got, f"{name}: as a DTensor",
                        exact=False, rtol=1e-12, atol=1e-14)
    check.done()


def test_dropout_on_a_plain_array_is_the_replicated_mask(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    for rows, p in itertools.product(lengths_for(SIZE), (0.0, 0.3, 1.0)):
        a = reference((rows, 4), seed=rows)
        drop = nn.Dropout(p)
        dt.manual_seed(11)
        got = drop(a)
        dt.manual_seed(11)
        want = drop(dt.distribute_tensor(a, mesh1d, [R])).to_torch()
        check.true(type(got) is np.ndarray, f"Dropout({p}): {type(got).__name__}")
        check.equal(got, want, f"Dropout({p}) rows={rows}")
        check.true(dt.random.state()[1] == (0 if p in (0.0, 1.0) else 1), f"Dropout({p}): random calls")
    check.true(drop.eval()(a) is a, "Dropout in eval mode returns its input")
    check.done()
    with pytest.raises(dt.DTypeMismatchError, match="floating-point"):
        nn.Dropout(0.5)(np.ones(3, dtype=np.int64))


def test_sequential_on_a_plain_array(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    model = nn.Sequential(nn.Linear(4, 6, device_mesh=mesh1d, dtype=np.float64), nn.LayerNorm(6, device_mesh=mesh1d, dtype=np.float64),
                          nn.GELU(), nn.Linear(6, 2, device_mesh=mesh1d, dtype=np.float64))
    a = reference((SIZE + 2, 4))
    w0, b0 = model[0].weight.to_torch(), model[0].bias.to_torch()
    w3, b3 = model[3].weight.to_torch(), model[3].bias.to_torch()
    h = _ln(a @ w0.T + b0)
    want = (0.5 * h * (1 + ERF(h / math.sqrt(2)))) @ w3.T + b3
    check.equal(model(a).to_torch(), want, "Sequential(Linear, LayerNorm, GELU, Linear) on an array", exact=False)
    check.done()


@pytest.mark.parametrize("act", ["GELU", "SiLU", "ReLU"])
def test_local_pieces_flow_through_activations(mesh1d: dt.DeviceMesh, check: Checker, act: str) -> None:
    """Colwise -> activation -> Rowwise with use_local_output=True (inference, under no_grad:
    with grad on it is refused, see test_tp_autograd.py): the activation runs on this rank's
    Shard(-1) piece as a plain array; the MLP equals NumPy with one all-reduce."""
    hidden = 2 * SIZE + 1
    module, ref = ELEMENTWISE[act]
    model = nn.Sequential(nn.Linear(5, hidden, device_mesh=mesh1d, dtype=np.float64), module,
                          nn.Linear(hidden, 3, device_mesh=mesh1d, dtype=np.float64))
    sd = {k: v.to_torch() for k, v in model.state_dict().items()}
    dt.parallelize_module(model, mesh1d, {"0": dt.ColwiseParallel(use_local_output=True),
                                         "2": dt.RowwiseParallel(use_local_output=True)})
    x = reference((4, 5))
    with dt.CommCounter() as moved, dt.no_grad():
        y = model(x)
    check.true(isinstance(y, np.ndarray), f"use_local_output=True returns a plain array, got {type(y).__name__}")
    want = ref(x @ sd["0.weight"].T + sd["0.bias"]) @ sd["2.weight"].T + sd["2.bias"]
    check.equal(y, want, f"{act} MLP", exact=False)
    check.true(moved.kinds() == ([] if SIZE == 1 else ["all_reduce"]), f"moved {moved.kinds()}")
    check.done()


# --- RowwiseParallel's input check -------------------------------------------------------------
@pytest.mark.parametrize("in_features", sorted(set(lengths_for(SIZE)) | {13}))
def test_rowwise_plain_input_is_checked_on_every_rank(mesh1d: dt.DeviceMesh, check: Checker, in_features: int) -> None:
    lin = nn.Linear(in_features, 6, device_mesh=mesh1d, dtype=np.float64)
    w, b = lin.weight.to_torch(), lin.bias.to_torch()
    dt.parallelize_module(lin, mesh1d, dt.RowwiseParallel())
    full = reference((5, in_features))
    (_, width), (_, start) = dt.compute_local_shape_and_offset(full.shape, mesh1d, [S1])
    check.equal(lin(full[:, start:start + width]).to_torch(), full @ w.T + b, f"the right slice, in={in_features}", exact=False)
    check.done()
    first = dt.compute_local_shape_and_offset(full.shape, mesh1d, [S1], coordinate=(0,))[0]
    for wrong in (full, full[:, :first[1]]):  # full width; rank 0's width everywhere
        if all(dt.compute_local_shape_and_offset(full.shape, mesh1d, [S1], coordinate=(c,))[0] == wrong.shape
               for c in range(SIZE)):
            continue  # right on every rank (one rank, or every piece that wide)
        with pytest.raises(dt.ShapeMismatchError, match=r"RowwiseParallel takes a plain input .* expects local shape"):
            lin(wrong)


# --- docs stand alone in a clone ---------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                        if f.endswith(".md")]


@pytest.mark.parametrize("doc", DOCS)
def test_docs_stand_alone(doc: str) -> None:
    """Every relative link and every repository path a page names exists in the repository,
    and no page points outside it (``../shared``) or to the issue tracker ("issue 3")."""
    text = open(os.path.join(ROOT, doc)).read()
    here = os.path.dirname(os.path.join(ROOT, doc))
    links = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
    paths = re.findall(r"`((?:docs|examples|scripts|tests|dtorch_mpi)/[\w./-]+\.(?:md|py|sh))`", text)
    missing = [t for t in links if not os.path.exists(os.path.join(here, t))]
    missing += [t for t in paths if not os.path.exists(os.path.join(ROOT, t))]
    assert not missing, f"{doc} names what a clone does not have: {missing}"
    assert "../shared" not in text and not re.search(r"\bissue \d", text, re.I), f"{doc} points outside the repository"
