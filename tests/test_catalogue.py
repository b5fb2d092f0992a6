"""The bad-input catalogue: each case asserts the exact error type and a message that says what
to fix, raised on every rank (the collective verdict fails the test if any rank differs)."""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import RANK, SIZE
from mpi4py import MPI

import dtorch_mpi as dt

# errors are raised before any collective, or agreed through spmd.py's own exchange (not the
# collective path)
pytestmark = pytest.mark.path_independent

WORLD = MPI.COMM_WORLD


def _mesh() -> dt.DeviceMesh:
    return dt.init_device_mesh("cpu", (SIZE,))


def _ones(mesh: dt.DeviceMesh, *shape: int, plc: Any = None) -> dt.DTensor:
    return dt.ones(*shape, dtype=np.float64, device_mesh=mesh, placements=plc or [dt.Shard(0)])


def _ck_dir() -> str:
    return WORLD.bcast(tempfile.mkdtemp(prefix="dtorch-cat-") if RANK == 0 else None, root=0)


def _write(path: str, data: bytes) -> None:
    if RANK == 0:
        with open(path, "wb") as fh:
            fh.write(data)
    WORLD.Barrier()


def _bad_ck(kind: str) -> Callable[[dt.DeviceMesh], Any]:
    def run(mesh: dt.DeviceMesh) -> Any:
        d = _ck_dir()
        path = os.path.join(d, "c.h5")
        good = {"w": _ones(mesh, 5, 3)}
        if kind != "missing":
            dt.save(good, path)
        if kind == "truncated" and RANK == 0:
            data = open(path, "rb").read()
            open(path, "wb").write(data[:200])
        if kind == "text":
            _write(path, b"not a checkpoint at all\n" * 10)
        if kind == "npy" and RANK == 0:
            np.save(path + ".npy", np.zeros(3))
            os.replace(path + ".npy", path)
        WORLD.Barrier()
        target = {"w": _ones(mesh, 5, 3)} if kind != "shape" else {"w": _ones(mesh, 6, 3)}
        if kind == "extra_key":
            target["v"] = _ones(mesh, 2)
        return dt.load(path, target)
    return run


def _debug(make: Callable[[dt.DeviceMesh], Any]) -> Callable[[dt.DeviceMesh], Any]:
    """The case run with DTORCH_SPMD_DEBUG=1."""
    def run(mesh: dt.DeviceMesh) -> Any:
        from dtorch_mpi.comm.config import set_spmd_debug, spmd_debug

        before = spmd_debug()
        set_spmd_debug(True)
        try:
            return make(mesh)
        finally:
            set_spmd_debug(before)
    return run


def _on_two_meshes(mesh: dt.DeviceMesh) -> Any:
    with dt.DeviceMesh("cpu", list(range(SIZE))) as other:
        return dt.distribute_tensor(np.zeros(4), mesh if RANK == 0 else other, [dt.Shard(0)])


def _divergent_seed(mesh: dt.DeviceMesh) -> Any:
    dt.manual_seed(RANK)
    try:
        return dt.randn(4, device_mesh=mesh)
    finally:  # leave one sequence on every rank: later tests' "replicated" parameters must agree
        dt.manual_seed(0)


def _step_after_replacing(m: dt.DeviceMesh) -> None:
    """An SGD state made for a Replicate Linear, then parallelize_module re-places it (issue 23)."""
    lin = dt.nn.Linear(3, 5, device_mesh=m, dtype=np.float64)
    opt = dt.optim.SGD(list(lin.named_parameters()), lr=0.1, momentum=0.9)
    lin(np.ones((2, 3))).sum().backward()
    opt.step()
    dt.parallelize_module(lin, m, dt.ColwiseParallel())
    opt.zero_grad()
    lin(np.ones((2, 3))).sum().backward()
    opt.step()


def _adamw_state(step: Any) -> dict[str, Any]:
    return {"state": {0: {"step": step, "exp_avg": np.zeros(4), "exp_avg_sq": np.zeros(4)}},
            "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                              "amsgrad": False}]}


CASES: list[tuple[str, Callable[[dt.DeviceMesh], Any], type[Exception], str]] = [
    # placements
    ("shard dim out of range", lambda m: _ones(m, 4, plc=[dt.Shard(2)]), dt.PlacementError, r"use a dim in \[-1, 0\]"),
    ("too many placements", lambda m: _ones(m, 4, plc=[dt.Shard(0), dt.Replicate()]), dt.PlacementError, "one placement per mesh dim"),
    ("no placements", lambda m: dt.zeros(4, device_mesh=m, placements=[]), dt.PlacementError, "one placement per mesh dim"),
    ("not a placement", lambda m: dt.zeros(4, device_mesh=m, placements=["S0"]), dt.PlacementError, "not a Shard, Replicate or Partial"),
    ("bad partial op", lambda m: dt.Partial("prod"), ValueError, "use one of sum, avg, max, min"),
    ("shard of a 0-d tensor", lambda m: dt.zeros(device_mesh=m, placements=[dt.Shard(0)]), dt.PlacementError, "cannot be sharded"),
    ("non-int shard dim", lambda m: dt.Shard(1.5), TypeError, "int tensor dim"),
    # meshes
    ("mesh names a rank twice", lambda m: dt.DeviceMesh("cpu", [0, 0]), ValueError, "names a rank twice"),
    ("mesh rank out of range", lambda m: dt.DeviceMesh("cpu", [SIZE + 3]), ValueError, "launch with more ranks"),
    ("unknown device type", lambda m: dt.DeviceMesh("tpu", [0]), ValueError, "use 'cpu' or 'cuda'"),
    ("wrong mesh_dim_names", lambda m: dt.init_device_mesh("cpu", (SIZE,), mesh_dim_names=("a", "b")), ValueError, "must name each"),
    ("unknown mesh dim name", lambda m: m["pp"], KeyError, "no dim named 'pp'"),
    ("empty mesh", lambda m: dt.DeviceMesh("cpu", []), ValueError, "non-empty"),
    # redistribute
    ("redistribute to another mesh", lambda m: _ones(m, 4).redistribute(dt.DeviceMesh("cpu", np.arange(SIZE).reshape(SIZE, 1)), [dt.Replicate()] * 2), dt.MeshMismatchError, "another mesh"),
    ("redistribute wrong length", lambda m: _ones(m, 4).redistribute(placements=[dt.Replicate()] * 2), dt.PlacementError, "one placement per mesh dim"),
    # from_local / distribute_tensor
    ("from_local not an array", lambda m: dt.DTensor.from_local([1, 2], m, [dt.Shard(0)]), TypeError, "needs an array piece"),
    ("from_local unsupported dtype", lambda m: dt.DTensor.from_local(np.zeros(2, "U1"), m, [dt.Shard(0)]), dt.DTypeMismatchError, "not supported; use one of"),
    ("from_local rank-divergent dtype", lambda m: dt.DTensor.from_local(np.zeros(2, np.float32 if RANK else np.float64), m, [dt.Shard(0)]), dt.DTypeMismatchError, "differ in dtype"),
    ("from_local off the split rule", lambda m: dt.DTensor.from_local(np.zeros((3 if RANK == 0 else 1, 2)), m, [dt.Shard(0)]), dt.ShapeMismatchError, "split rule gives"),
    ("from_local shape ndim", lambda m: dt.DTensor.from_local(np.zeros(2), m, [dt.Shard(0)], shape=(2, 2), run_check=True), dt.ShapeMismatchError, "has 2 dims but the local piece has 1"),
    ("distribute_tensor not an array", lambda m: dt.distribute_tensor("abc", m, [dt.Shard(0)], src_data_rank=None), TypeError, "needs an array"),
    ("distribute_tensor bad source rank", lambda m: dt.distribute_tensor(np.zeros(2), m, [dt.Shard(0)], src_data_rank=SIZE), ValueError, "is not a rank of a mesh"),
    ("distribute_tensor divergent shapes", lambda m: dt.distribute_tensor(np.zeros(2 + RANK), m, [dt.Shard(0)], src_data_rank=None), dt.ShapeMismatchError, "same array shape"),
    # construction: trusted pieces, 0-d, ranks that disagree, limits (issue 12 items 3, 5, 6, 7, 15)
    ("trusted from_local piece off the split rule", lambda m: dt.DTensor.from_local(np.zeros(7), m, [dt.Shard(0)], shape=(6,)), dt.ShapeMismatchError, r"this rank \(coordinate .* split rule gives"),
    ("trusted from_local shape ndim", lambda m: dt.DTensor.from_local(np.zeros(2), m, [dt.Shard(0)], shape=(2, 2)), dt.ShapeMismatchError, "has 2 dims but the local piece has 1"),
    ("distribute_tensor shards a 0-d array", lambda m: dt.distribute_tensor(np.array(1.5), m, [dt.Shard(0)], src_data_rank=None), dt.PlacementError, "cannot be sharded"),
    ("from_local shards a 0-d piece", lambda m: dt.DTensor.from_local(np.array(1.5), m, [dt.Shard(0)]), dt.PlacementError, "cannot be sharded"),
    ("distribute_tensor rank-divergent placements", lambda m: dt.distribute_tensor(np.zeros((4, 4)), m, [dt.Shard(RANK % 2)]), dt.SPMDDivergenceError, r"ranks disagree on placements: rank 0: \[Shard\(dim=0\)\]; rank 1: \[Shard\(dim=1\)\]"),
    ("distribute_tensor rank-divergent source", lambda m: dt.distribute_tensor(np.zeros(4), m, [dt.Shard(0)], src_data_rank=RANK % 2), dt.SPMDDivergenceError, "src_data_rank: rank 0: 0; rank 1: 1"),
    ("distribute_tensor source out of range on one rank", lambda m: dt.distribute_tensor(np.zeros(4), m, [dt.Shard(0)], src_data_rank=SIZE * (RANK == 1)), ValueError, "is not a rank of a mesh"),
    ("from_local rank-divergent placements", lambda m: dt.DTensor.from_local(np.zeros(2), m, [dt.Replicate() if RANK else dt.Partial()]), dt.SPMDDivergenceError, r"ranks disagree on placements: rank 0: \[Partial\(\"sum\"\)\]"),
    ("DeviceMesh invalid on one rank", lambda m: dt.DeviceMesh("cpu", [0, 0] if RANK == 1 else [0, 1]), ValueError, "names a rank twice"),
    ("ranks pass different meshes", lambda m: dt.DeviceMesh("cpu", [RANK % 2]), dt.MeshMismatchError, r"different meshes to DeviceMesh\(\): ranks disagree on mesh: rank 0: \[0\]; rank 1: \[1\]"),
    ("factory shape beyond 2**63", lambda m: dt.zeros(2**63, device_mesh=m), dt.ShapeMismatchError, r"at most 2\*\*63 - 1"),
    ("factory element count beyond 2**63", lambda m: dt.ones(2**32, 2**32, device_mesh=m), dt.ShapeMismatchError, r"at most 2\*\*63 - 1"),
    ("from_local shape beyond 2**63", lambda m: dt.DTensor.from_local(np.zeros(1), m, [dt.Shard(0)], shape=(2**63,)), dt.ShapeMismatchError, r"at most 2\*\*63 - 1"),
    ("from_local checked shape beyond 2**63", lambda m: dt.DTensor.from_local(np.zeros(1), m, [dt.Shard(0)], shape=(2**64,), run_check=True), dt.ShapeMismatchError, r"at most 2\*\*63 - 1"),
    ("non-int shape", lambda m: dt.zeros(2.5, device_mesh=m), TypeError, "a shape holds ints"),
    ("complex Partial(max) factory", lambda m: dt.zeros(3, dtype=np.complex64, device_mesh=m, placements=[dt.Partial("max")]), dt.DTypeMismatchError, r"Partial\('max'\) is undefined for complex"),
    ("complex Partial(min) distribute_tensor", lambda m: dt.distribute_tensor(np.ones(3, np.complex128), m, [dt.Partial("min")]), dt.DTypeMismatchError, r"Partial\('min'\) is undefined for complex"),
    ("complex Partial(max) from_local", lambda m: dt.DTensor.from_local(np.ones(3, np.complex64), m, [dt.Partial("max")]), dt.DTypeMismatchError, r"use Partial\('sum'\)"),
    ("complex Partial(max) trusted from_local", lambda m: dt.DTensor.from_local(np.ones(3, np.complex64), m, [dt.Partial("max")], shape=(3,)), dt.DTypeMismatchError, "undefined for complex"),
    ("debug: trusted from_local with divergent placements", _debug(lambda m: dt.DTensor.from_local(np.zeros(1), m, [dt.Replicate() if RANK else dt.Partial()], shape=(1,))), dt.SPMDDivergenceError, "ranks disagree on placements"),
    ("debug: ranks on different meshes", _debug(_on_two_meshes), dt.SPMDDivergenceError, r"distribute_tensor \(DTORCH_SPMD_DEBUG=1\): ranks disagree on mesh"),
    ("debug: divergent manual_seed", _debug(_divergent_seed), dt.SPMDDivergenceError, r"ranks disagree on random state \(seed, calls\): rank 0: \(0, 0\); rank 1: \(1, 0\)"),
    # factories
    ("negative dim", lambda m: dt.zeros(-2, device_mesh=m), dt.ShapeMismatchError, "negative dimension"),
    ("randn of ints", lambda m: dt.randn(3, dtype=np.int64, device_mesh=m), dt.DTypeMismatchError, "floating-point"),
    ("factory without mesh", lambda m: dt.ones(3), TypeError, "device_mesh"),
    ("unsupported factory dtype", lambda m: dt.zeros(3, dtype="U2", device_mesh=m), dt.DTypeMismatchError, "not supported"),
    ("arange zero step", lambda m: dt.arange(0, 3, 0, device_mesh=m), ValueError, "must not be zero"),
    # operators
    ("softmax over a sharded dim", lambda m: _ones(m, 4, 3).softmax(0), dt.PlacementError, r"redistribute\(placements="),
    ("partial plus scalar", lambda m: _ones(m, 3, plc=[dt.Partial()]) + 1, dt.PlacementError, "No data is moved implicitly"),
    ("shards on different dims", lambda m: _ones(m, 4, 4) + _ones(m, 4, 4, plc=[dt.Shard(1)]), dt.PlacementError, r"([ab]) = \1.redistribute\(placements=\[Shard\(dim=[01]\)\]\)"),
    ("stretched shard", lambda m: _ones(m, 1, 4) + _ones(m, 5, 4, plc=[dt.Replicate()]), dt.PlacementError, "stretches from size 1"),
    ("numpy operand", lambda m: _ones(m, 4) + np.ones(4), TypeError, "make it one explicitly"),
    ("shapes do not broadcast", lambda m: _ones(m, 3) + _ones(m, 4), dt.ShapeMismatchError, "do not broadcast"),
    ("matmul inner dims", lambda m: _ones(m, 3, 4) @ _ones(m, 3, 4), dt.ShapeMismatchError, "inner dims differ"),
    ("reshape not expressible", lambda m: _ones(m, 3, 2 * SIZE + 1, plc=[dt.Shard(1)]).reshape(3 * (2 * SIZE + 1)), dt.PlacementError, "not the outermost of them"),
    ("reshape wrong size", lambda m: _ones(m, 4, 3).reshape(5, 5), dt.ShapeMismatchError, "do not fit"),
    ("advanced indexing", lambda m: _ones(m, 4)[np.array([0, 1])], TypeError, "advanced indexing"),
    ("cast of a partial to int", lambda m: _ones(m, 3, plc=[dt.Partial()]).astype(np.int32), dt.PlacementError, "redistribute first"),
    ("prod over a sharded dim", lambda m: _ones(m, 4).prod(), dt.PlacementError, "Accepted rules"),
    ("operands on different meshes", lambda m: _ones(m, 4) + _ones(dt.DeviceMesh("cpu", np.arange(SIZE).reshape(SIZE, 1)), 4, plc=[dt.Shard(0), dt.Replicate()]), dt.MeshMismatchError, "different meshes"),
    # Python and NumPy habits (issue 13)
    ("bool of a many-element tensor", lambda m: bool(_ones(m, 5, 4) > 1), ValueError, "more than one element is ambiguous"),
    ("float of a Partial scalar", lambda m: float(_ones(m, SIZE + 1).sum()), dt.PlacementError, r"not local .*redistribute\(placements=\[Replicate\(\)\]\)"),
    ("item of a many-element tensor", lambda m: _ones(m, 3).item(), ValueError, "only a one-element DTensor"),
    ("np.asarray of a DTensor", lambda m: np.asarray(_ones(m, 3)), TypeError, r"x\.to_torch\(\) is the complete value"),
    ("iterate a DTensor", lambda m: list(_ones(m, 3)), TypeError, "not iterable element by element"),
    ("np.sum of a DTensor", lambda m: np.sum(_ones(m, 3)), TypeError, r"use dt\.sum\(\.\.\.\)"),
    ("ndarray + DTensor", lambda m: np.ones(3) + _ones(m, 3), TypeError, "not a DTensor; make it one explicitly"),
    ("pickle a DTensor", lambda m: pickle.dumps(_ones(m, 3)), TypeError, r"cannot be pickled.*dt\.save"),
    ("redistribute placements positionally", lambda m: _ones(m, 3).redistribute([dt.Replicate()]), TypeError, "first positional argument is device_mesh"),
    ("RowwiseParallel full-width input", lambda m: dt.parallelize_module(dt.nn.Linear(13, 6, device_mesh=m), m, dt.RowwiseParallel())(np.ones((5, 13), np.float32)), dt.ShapeMismatchError, r"expects local shape \(5, \d+\)"),
    # training (issue 23)
    ("use_local_output=True with grad on", lambda m: dt.parallelize_module(dt.nn.Linear(4, 6, device_mesh=m), m, dt.ColwiseParallel(use_local_output=True))(np.ones((2, 4), np.float32)), RuntimeError, r"autograd cannot follow.*use_local_output=False"),
    ("grad of another shape", lambda m: setattr(_ones(m, 5, 3).requires_grad_(), "grad", _ones(m, 7)), dt.ShapeMismatchError, r"gradient has shape \(7,\)"),
    ("grad as a NumPy array", lambda m: setattr(_ones(m, 5, 3).requires_grad_(), "grad", np.zeros((5, 3))), TypeError, r"must be a DTensor or None.*distribute_tensor"),
    ("backward(gradient=ndarray)", lambda m: (_ones(m, 3).requires_grad_() * 2).backward(gradient=np.ones(3)), TypeError, r"backward\(gradient=\.\.\.\) takes a DTensor"),
    ("Parameter of an integer DTensor", lambda m: dt.nn.Parameter(dt.zeros(3, dtype=np.int64, device_mesh=m)), TypeError, r"floating or complex.*requires_grad=False"),
    ("AdamW lr NaN", lambda m: dt.optim.AdamW([dt.nn.Parameter(_ones(m, 4))], lr=float("nan")), ValueError, r"invalid lr nan \(must be finite"),
    ("AdamW three betas", lambda m: dt.optim.AdamW([dt.nn.Parameter(_ones(m, 4))], betas=(0.9, 0.99, 0.999)), ValueError, r"invalid betas .*a pair"),
    ("optimizer state step 'abc'", lambda m: dt.optim.AdamW([dt.nn.Parameter(_ones(m, 4))]).load_state_dict(_adamw_state("abc")), dt.StateDictError, r"step is 'abc'; it must be a whole number"),
    ("optimizer state step -1", lambda m: dt.optim.AdamW([dt.nn.Parameter(_ones(m, 4))]).load_state_dict(_adamw_state(-1)), dt.StateDictError, r"step is -1"),
    ("step after parallelize_module", _step_after_replacing, dt.PlacementError, r"^weight .*re-placed.*opt\.load_state_dict\(opt\.state_dict\(\)\)"),
    # state_dict
    ("state_dict missing key", lambda m: dt.nn.Linear(2, 3, device_mesh=m).load_state_dict({"weight": np.ones((3, 2))}), dt.StateDictError, r"missing keys \['bias'\]"),
    ("state_dict wrong shape", lambda m: dt.nn.Linear(2, 3, device_mesh=m).load_state_dict({"weight": np.ones((2, 3)), "bias": np.ones(3)}), dt.ShapeMismatchError, "weight: value has shape"),
    ("state_dict float into int", lambda m: dt.nn.Linear(2, 3, device_mesh=m, dtype=np.float32).load_state_dict({"weight": np.ones((3, 2), np.complex64), "bias": np.ones(3)}), dt.DTypeMismatchError, "cast the value first"),
    ("state_dict value not an array", lambda m: dt.nn.Linear(2, 3, device_mesh=m).load_state_dict({"weight": "w", "bias": np.ones(3)}), dt.StateDictError, "not an array"),
    # checkpoints
    ("checkpoint missing", _bad_ck("missing"), dt.CheckpointError, "no checkpoint at"),
    ("checkpoint truncated", _bad_ck("truncated"), dt.CheckpointError, "HDF5|opened|damaged"),
    ("checkpoint of another format", _bad_ck("text"), dt.CheckpointError, "not an HDF5 file"),
    ("checkpoint is a .npy", _bad_ck("npy"), dt.CheckpointError, "not an HDF5 file"),
    ("checkpoint shape does not fit", _bad_ck("shape"), dt.ShapeMismatchError, "has shape"),
    ("checkpoint lacks a key", _bad_ck("extra_key"), dt.CheckpointError, r"missing keys \['v'\]"),
]


NEEDS_TWO_RANKS = {"from_local rank-divergent dtype", "from_local off the split rule",
                   "distribute_tensor divergent shapes", "distribute_tensor rank-divergent placements",
                   "distribute_tensor rank-divergent source", "distribute_tensor source out of range on one rank",
                   "from_local rank-divergent placements", "DeviceMesh invalid on one rank",
                   "ranks pass different meshes", "debug: trusted from_local with divergent placements",
                   "debug: ranks on different meshes", "debug: divergent manual_seed",
                   "RowwiseParallel full-width input"}
"""Cases whose bad input only exists when ranks disagree."""


def test_catalogue_has_at_least_40_cases() -> None:
    assert len(CASES) >= 40, len(CASES)


@pytest.mark.parametrize("name,make,error,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name: str, make: Callable[[dt.DeviceMesh], Any], error: type[Exception], pattern: str) -> None:
    if name in NEEDS_TWO_RANKS and SIZE < 2:
        pytest.skip("the bad input is a disagreement between ranks")
    mesh = _mesh()
    try:
        with pytest.raises(error, match=pattern):
            make(mesh)
    finally:
        mesh.free()
