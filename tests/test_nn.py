"""Modules, tensor-parallel styles, and state_dict loading (shard on load, gather on read)."""

from __future__ import annotations

import os
from typing import Any

import h5py
import numpy as np
import pytest
from conftest import RANK, SIZE, Checker, to_numpy

import dtorch_mpi as dt
from dtorch_mpi.nn import Module, Parameter

ALL = [dt.Shard(0), dt.Shard(1), dt.Replicate(), dt.Partial("sum"), dt.Partial("max"),
       dt.Partial("min"), dt.Partial("avg")]


class Holder(Module):
    """One parameter per placement under test."""

    def __init__(self, mesh: dt.DeviceMesh, shape: tuple[int, ...], placements: list[list[dt.Placement]]) -> None:
        super().__init__()
        for i, plc in enumerate(placements):
            setattr(self, f"p{i}", Parameter(dt.zeros(*shape, dtype=np.float64, device_mesh=mesh, placements=plc)))


class Recorder:
    """A lazily indexable array that records every index it is asked for."""

    def __init__(self, base: Any) -> None:
        self.base, self.reads = base, []
        self.shape, self.dtype = base.shape, base.dtype

    def __getitem__(self, index: Any) -> Any:
        self.reads.append(index)
        return self.base[index]


def test_every_placement_kind_loads(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    for mesh, layouts in ((mesh1d, [[p] for p in ALL]),
                          (mesh2d, [[a, b] for a in ALL[:4] for b in (dt.Shard(0), dt.Partial("max"), dt.Replicate())])):
        for rows in (0, 1, SIZE + 1, 2 * SIZE + 1):
            full = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) - 4
            model = Holder(mesh, (rows, 3), layouts)
            model.load_state_dict({f"p{i}": full for i in range(len(layouts))})
            for name, p in model.state_dict().items():
                check.equal(p.to_torch(), full, f"{mesh.shape} {list(p.placements)} rows={rows}")
                want_shape = dt.compute_local_shape_and_offset(full.shape, mesh, p.placements)[0]
                check.true(p.to_local().shape == want_shape, f"{name}: local shape")
            # the Partial pieces: the value at coordinate 0, the identity elsewhere
            p_sum = model.p3 if mesh is mesh1d else None
            if p_sum is not None and rows and RANK:
                check.true(not p_sum.to_local().any(), "Partial(sum) piece off coordinate 0 is zero")
    check.done()


def test_lazy_sources_are_read_per_rank(mesh1d: dt.DeviceMesh, tmp_path_factory: Any, check: Checker) -> None:
    rows = 2 * SIZE + 1
    full = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    tmp = str(tmp_path_factory.mktemp(f"lazy{RANK}"))
    np.save(os.path.join(tmp, "w.npy"), full)
    mm = Recorder(np.load(os.path.join(tmp, "w.npy"), mmap_mode="r"))
    with h5py.File(os.path.join(tmp, "w.h5"), "w") as fh:
        fh["w"] = full
    model = Holder(mesh1d, (rows, 4), [[dt.Shard(0)], [dt.Shard(1)], [dt.Partial("sum")]])
    with h5py.File(os.path.join(tmp, "w.h5"), "r") as fh:
        ds = Recorder(fh["w"])
        part = Recorder(full)
        model.load_state_dict({"p0": mm, "p1": ds, "p2": part})
    size0, off0 = dt.compute_local_shape_and_offset(full.shape, mesh1d, [dt.Shard(0)])
    size1, off1 = dt.compute_local_shape_and_offset(full.shape, mesh1d, [dt.Shard(1)])
    want0 = [(slice(off0[0], off0[0] + size0[0]), slice(0, 4))] if size0[0] else []
    want1 = [(slice(0, rows), slice(off1[1], off1[1] + size1[1]))] if size1[1] else []
    check.true(mm.reads == want0, f"memmap reads {mm.reads} != {want0}")
    check.true(ds.reads == want1, f"h5py reads {ds.reads} != {want1}")
    check.true(part.reads == ([(slice(0, rows), slice(0, 4))] if RANK == 0 else []),
               f"Partial reads {part.reads}: only coordinate 0 reads")
    full = full.astype(np.float64)  # loaded into float64 parameters (a same-kind cast)
    check.equal(model.p0.to_torch(), full, "memmap")
    check.equal(model.p1.to_torch(), full, "h5py")
    check.equal(model.p2.to_torch(), full, "partial")
    check.done()


def test_dtensor_values_are_redistributed(mesh1d: dt.DeviceMesh) -> None:
    full = np.arange(12.0).reshape(4, 3)
    model = Holder(mesh1d, (4, 3), [[dt.Shard(1)]])
    value = dt.distribute_tensor(full, mesh1d, [dt.Shard(0)])
    model.load_state_dict({"p0": value})
    assert np.array_equal(model.p0.to_torch(), full)


def _snapshot(model: Module) -> dict[str, np.ndarray]:
    return {k: v.to_local().copy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "dtype", "not_array",
                                  "not_mapping", "rank_divergent_shape", "mesh"])
def test_load_errors_raise_everywhere_and_change_nothing(case: str, mesh1d: dt.DeviceMesh) -> None:
    model = Holder(mesh1d, (SIZE + 1, 2), [[dt.Shard(0)], [dt.Replicate()]])
    good = {"p0": np.ones((SIZE + 1, 2)), "p1": np.full((SIZE + 1, 2), 2.0)}
    model.load_state_dict(good)
    before = _snapshot(model)
    bad: Any = dict(good)
    expected: type[Exception] = dt.StateDictError
    match = ""
    if case == "missing":
        del bad["p1"]
        match = r"missing keys \['p1'\]"
    elif case == "unexpected":
        bad["p9"] = np.ones(2)
        match = r"unexpected keys \['p9'\]"
    elif case == "shape":
        bad["p1"] = np.ones((SIZE + 2, 2))
        expected, match = dt.ShapeMismatchError, "p1: value has shape"
    elif case == "dtype":
        bad["p1"] = np.ones((SIZE + 1, 2), dtype=np.complex128)
        expected, match = dt.DTypeMismatchError, "cannot load complex128 into a float64"
    elif case == "not_array":
        bad["p1"] = [[1.0, 2.0]] * (SIZE + 1)
        match = "not an array"
    elif case == "not_mapping":
        bad = [("p0", 1)]
        match = "needs a mapping"
    elif case == "rank_divergent_shape":
        if RANK == SIZE - 1:
            bad["p0"] = np.ones((SIZE + 1, 3))
        expected, match = dt.ShapeMismatchError, "p0: value has shape"
    elif case == "mesh":
        with dt.init_device_mesh("cpu", (SIZE, 1)) as other:
            bad["p0"] = dt.ones(SIZE + 1, 2, device_mesh=other, placements=[dt.Shard(0), dt.Replicate()])
            with pytest.raises(dt.MeshMismatchError, match="another mesh"):
                model.load_state_dict(bad)
        after = _snapshot(model)
        assert all(np.array_equal(before[k], after[k]) for k in before)
        return
    with pytest.raises(expected, match=match):
        model.load_state_dict(bad)
    after = _snapshot(model)
    assert all(np.array_equal(before[k], after[k]) for k in before), "a failed load changed a parameter"
    if case == "missing":
        model.load_state_dict({"p0": np.zeros((SIZE + 1, 2))}, strict=False)
        assert not model.p0.to_torch().any() and np.all(model.p1.to_torch() == 2)


def test_tensor_parallel_mlp_equals_numpy(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    rng = np.random.default_rng(7)
    sd = {"0.weight": rng.standard_normal((SIZE * 2 + 1, 5)), "0.bias": rng.standard_normal(SIZE * 2 + 1),
          "2.weight": rng.standard_normal((3, SIZE * 2 + 1)), "2.bias": rng.standard_normal(3)}
    model = dt.nn.Sequential(dt.nn.Linear(5, SIZE * 2 + 1, device_mesh=mesh1d, dtype=np.float64), dt.nn.ReLU(),
                             dt.nn.Linear(SIZE * 2 + 1, 3, device_mesh=mesh1d, dtype=np.float64))
    dt.parallelize_module(model, mesh1d, {"0": dt.ColwiseParallel(), "2": dt.RowwiseParallel()})
    check.true(model[0].weight.placements == (dt.Shard(0),), "colwise weight Shard(0)")
    check.true(model[2].weight.placements == (dt.Shard(1),), "rowwise weight Shard(1)")
    model.load_state_dict(sd)
    x = rng.standard_normal((4, 5))
    with dt.CommCounter() as moved:
        y = model(x)
    ref = np.maximum(x @ sd["0.weight"].T + sd["0.bias"], 0) @ sd["2.weight"].T + sd["2.bias"]
    check.equal(y.to_torch(), ref, "MLP output", exact=False)
    check.true(moved.kinds() == ([] if SIZE == 1 else ["all_reduce"]), f"moved {moved.kinds()}")
    gathered = {k: v.to_torch() for k, v in model.state_dict().items()}
    for k in sd:
        check.equal(gathered[k], sd[k], f"to_torch of {k}")
    check.done()


def test_rowwise_reduce_scatter_output_and_dtensor_outputs(mesh1d: dt.DeviceMesh) -> None:
    lin = dt.nn.Linear(2 * SIZE, 3, device_mesh=mesh1d, dtype=np.float64)
    dt.parallelize_module(lin, mesh1d, dt.RowwiseParallel(output_layouts=dt.Shard(0), use_local_output=False))
    x = dt.distribute_tensor(np.ones((SIZE + 1, 2 * SIZE)), mesh1d, [dt.Replicate()])
    with dt.CommCounter() as moved:
        y = lin(x)
    assert y.placements == (dt.Shard(0),)
    ref = np.ones((SIZE + 1, 2 * SIZE)) @ lin.weight.to_torch().T + lin.bias.to_torch()
    assert np.allclose(y.to_torch(), ref)
    assert "reduce_scatter" in moved.kinds() or SIZE == 1


def test_same_weights_whatever_the_plan(mesh1d: dt.DeviceMesh) -> None:
    dt.manual_seed(5)
    plain = dt.nn.Linear(4, 2 * SIZE + 1, device_mesh=mesh1d)
    dt.manual_seed(5)
    sharded = dt.parallelize_module(dt.nn.Linear(4, 2 * SIZE + 1, device_mesh=mesh1d), mesh1d, dt.ColwiseParallel())
    assert np.array_equal(plain.weight.to_torch(), sharded.weight.to_torch())
    assert sharded.weight.to_local().shape[0] < 2 * SIZE + 1 or SIZE == 1


def test_module_api(mesh1d: dt.DeviceMesh) -> None:
    model = dt.nn.Sequential(dt.nn.Linear(3, 4, device_mesh=mesh1d), dt.nn.Sequential(
        dt.nn.Linear(4, 4, bias=False, device_mesh=mesh1d), dt.nn.LayerNorm(4, device_mesh=mesh1d)))
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.0.weight", "1.1.weight", "1.1.bias"]
    assert [n for n, _ in model.named_modules()] == ["", "0", "1", "1.0", "1.1"]
    assert len(list(model.parameters())) == 5 and len(model) == 2
    assert "Linear(in_features=4, out_features=4, bias=False)" in repr(model)
    x = dt.distribute_tensor(np.arange(6.0, dtype=np.float32).reshape(2, 3), mesh1d, [dt.Replicate()])
    y = model(x).to_torch()
    assert y.shape == (2, 4) and np.allclose(y.mean(-1), 0, atol=1e-5)
    with pytest.raises(ValueError, match="matches no submodule"):
        dt.parallelize_module(model, mesh1d, {"9": dt.ColwiseParallel()})
    with pytest.raises(TypeError, match="applies to Linear"):
        dt.parallelize_module(model, mesh1d, {"1.1": dt.ColwiseParallel()})
    wild = dt.nn.Sequential(dt.nn.Linear(2, 2 * SIZE, device_mesh=mesh1d), dt.nn.Linear(2, 2 * SIZE, device_mesh=mesh1d))
    dt.parallelize_module(wild, mesh1d, {"*": dt.ColwiseParallel()})
    assert all(p.placements == (dt.Shard(0),) for p in wild.parameters())


def test_parallelize_module_moves_deferred_parameters_onto_its_mesh(xp_mesh1d: dt.DeviceMesh,
                                                                    check: Checker) -> None:
    """Layers built without ``device_mesh`` (the default CPU world mesh) and parallelized onto
    another mesh (here one of each array backend, named "tp" so it differs from the default)
    get their parameters made on that mesh, with the values they would have had there: the
    plan trains and computes the NumPy result. Before, they stayed on the default mesh and the
    first forward failed with "operands live on different meshes". A parameter that already
    has its values on another mesh is refused on every rank, nothing changed."""
    with dt.init_device_mesh(xp_mesh1d.device_type, (SIZE,), mesh_dim_names=("tp",)) as mesh:
        def build(on: dt.DeviceMesh | None) -> Any:
            dt.manual_seed(3)
            return dt.nn.Sequential(dt.nn.Linear(4, SIZE + 1, device_mesh=on, dtype=np.float64), dt.nn.ReLU(),
                                    dt.nn.Linear(SIZE + 1, 3, device_mesh=on, dtype=np.float64))

        model, there = build(None), build(mesh)
        dt.parallelize_module(model, mesh, {"0": dt.ColwiseParallel(), "2": dt.RowwiseParallel()})
        want = {k: to_numpy(v.to_torch()) for k, v in there.named_parameters()}
        for name, p in model.named_parameters():
            check.true(p.device_mesh is mesh, f"{name} on {p.device_mesh!r}")
            check.true(type(p.to_local()).__module__.split(".")[0] == ("numpy" if mesh.device_type == "cpu" else "cupy"),
                       f"{name}: piece is {type(p.to_local())}")
            check.equal(p.to_torch(), want[name], name)
        check.true(model[2].bias.placements == (dt.Replicate(),), "the kept Rowwise bias moves Replicate")
        x = np.random.default_rng(1).standard_normal((5, 4))
        y = model(dt.distribute_tensor(x, mesh, [dt.Replicate()]))
        y.square().sum().backward()
        ref = np.maximum(x @ want["0.weight"].T + want["0.bias"], 0) @ want["2.weight"].T + want["2.bias"]
        check.equal(y.to_torch(), ref, "forward", exact=False)
        check.true(all(p.grad is not None for p in model.parameters()), "every parameter got a gradient")

        valued = dt.nn.Linear(4, SIZE + 1, dtype=np.float64)
        before = valued.weight.to_torch()  # touching the values makes them (on the default mesh)
        with pytest.raises(dt.MeshMismatchError, match="already has its values on"):
            dt.parallelize_module(valued, mesh, dt.ColwiseParallel())
        check.true(valued.weight.device_mesh != mesh and valued.weight.placements == (dt.Replicate(),),
                   "a refused parallelize_module changes nothing")
        check.equal(valued.weight.to_torch(), before, "refused: values kept")
    check.done()
