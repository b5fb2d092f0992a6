"""HDF5 checkpoints: round trips, resharding across mesh sizes and shapes, plain-h5py
readability, atomic saves, and damaged or foreign files rejected on every rank. Runs on the
pip-only stack (serial h5py: ranks write in turn) and on the parallel-HDF5 stack (MPI-IO)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np
import pytest
from conftest import RANK, SIZE, Checker
from mpi4py import MPI
from test_redistribute import make_pieces

import dtorch_mpi as dt
from dtorch_mpi.checkpoint import hdf5 as ck
from dtorch_mpi.checkpoint.checksum import checksum

WORLD = MPI.COMM_WORLD
LAYOUTS_1D = [[dt.Shard(0)], [dt.Shard(1)], [dt.Replicate()], [dt.Partial("sum")], [dt.Partial("max")]]


@pytest.fixture
def shared_dir() -> Iterator[str]:
    path = WORLD.bcast(tempfile.mkdtemp(prefix="dtorch-ck-") if RANK == 0 else None, root=0)
    yield path
    WORLD.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


def full_value(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-9, 9, size=shape).astype(np.float64)


def state(mesh: dt.DeviceMesh, layouts: list[list[dt.Placement]], shape: tuple[int, ...]) -> tuple[dict, dict]:
    fulls, sd = {}, {}
    for i, plc in enumerate(layouts):
        full = full_value(shape, i)
        fulls[f"layer{i}.w"] = full
        sd[f"layer{i}.w"] = dt.DTensor.from_local(make_pieces(full, mesh, plc), mesh, plc, shape=shape)
    return fulls, sd


def targets(mesh: dt.DeviceMesh, layouts: list[list[dt.Placement]], shape: tuple[int, ...]) -> dict:
    return {f"layer{i}.w": dt.zeros(*shape, dtype=np.float64, device_mesh=mesh, placements=layouts[i % len(layouts)])
            for i in range(len(LAYOUTS_1D))}


def test_round_trip_every_placement(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, shared_dir: str,
                                    check: Checker) -> None:
    path = os.path.join(shared_dir, "ck.h5")
    for rows in (0, 1, SIZE + 1, 2 * SIZE + 1):
        fulls, sd = state(mesh1d, LAYOUTS_1D, (rows, 3))
        dt.save(sd, path)
        for mesh, layouts in ((mesh1d, LAYOUTS_1D), (mesh2d, [[dt.Shard(0), dt.Shard(1)], [dt.Partial(), dt.Shard(0)],
                                                               [dt.Replicate(), dt.Replicate()]])):
            tgt = targets(mesh, layouts, (rows, 3))
            out = dt.load(path, tgt)
            check.true(out is tgt, "load returns its target")
            for k, v in tgt.items():
                check.equal(v.to_torch(), fulls[k], f"rows={rows} {k} -> {list(v.placements)}")
    check.done()


def test_partial_is_saved_reduced_and_plain_h5py_reads_it(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    path = os.path.join(shared_dir, "plain.h5")
    fulls, sd = state(mesh1d, LAYOUTS_1D, (2 * SIZE + 1, 4))
    dt.save(sd, path)
    if RANK == 0:
        with h5py.File(path, "r") as f:
            assert f.attrs["format"] == "dtorch_mpi" and int(f.attrs["version"]) == 2
            for i in range(len(LAYOUTS_1D)):
                ds = f[f"layer{i}/w"]
                assert ds.shape == (2 * SIZE + 1, 4) and ds.dtype == np.float64
                assert np.array_equal(ds[()], fulls[f"layer{i}.w"])
                assert ds.attrs["placements"] == repr(LAYOUTS_1D[i])
                assert ds.attrs["dtype"] == "<f8"
                # the collectively combined checksum is the checksum of the complete array
                assert int(ds.attrs["checksum"]) == checksum(fulls[f"layer{i}.w"], (0, 0), ds.shape)


@pytest.mark.mpi(min_size=2)
def test_reshard_across_mesh_sizes_and_shapes(shared_dir: str, check: Checker) -> None:
    """Save on every rank, load on sub-meshes of 1..SIZE ranks (and 2x2), and back."""
    path = os.path.join(shared_dir, "reshard.h5")
    with dt.init_device_mesh("cpu", (SIZE,)) as full_mesh:
        fulls, sd = state(full_mesh, LAYOUTS_1D, (2 * SIZE + 1, 5))
        dt.save(sd, path)
    shapes = [[list(range(n))] for n in range(1, SIZE + 1)]
    if SIZE == 4:
        shapes.append([[0, 1], [2, 3]])
    for ranks in shapes:
        ranks_arr = np.array(ranks[0] if len(ranks) == 1 else ranks)
        with dt.DeviceMesh("cpu", ranks_arr) as mesh:
            layouts = [[dt.Shard(1)] * mesh.ndim, [dt.Shard(0)] * mesh.ndim, [dt.Partial("min")] * mesh.ndim]
            tgt = targets(mesh, layouts, (2 * SIZE + 1, 5))
            dt.load(path, tgt)
            for k, v in tgt.items():
                got = v.to_torch()
                if mesh.get_coordinate() is not None:
                    check.equal(got, fulls[k], f"load on {ranks_arr.tolist()} {k}")
            # and save from the smaller mesh, load back on all ranks
            small = os.path.join(shared_dir, f"small{mesh.size()}.h5")
            dt.save(tgt, small)
    with dt.init_device_mesh("cpu", (SIZE,)) as full_mesh:
        back = targets(full_mesh, [[dt.Shard(0)]], (2 * SIZE + 1, 5))
        dt.load(os.path.join(shared_dir, "small1.h5"), back)
        for k, v in back.items():
            check.equal(v.to_torch(), fulls[k], f"from a 1-rank save: {k}")
    check.done()


def test_strict_and_partial_loads(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    path = os.path.join(shared_dir, "subset.h5")
    fulls, sd = state(mesh1d, LAYOUTS_1D, (3, 2))
    dt.save(sd, path)
    one = {"layer1.w": dt.zeros(3, 2, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)])}
    with pytest.raises(dt.CheckpointError, match="unexpected keys"):
        dt.load(path, one)
    dt.load(path, one, strict=False)
    assert np.array_equal(one["layer1.w"].to_torch(), fulls["layer1.w"])
    extra = dict(one, extra=dt.zeros(2, device_mesh=mesh1d))
    with pytest.raises(dt.CheckpointError, match=r"missing keys \['extra'\]"):
        dt.load(path, extra)


def test_module_round_trip(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    path = os.path.join(shared_dir, "model.h5")
    dt.manual_seed(1)
    model = dt.nn.Sequential(dt.nn.Linear(4, 2 * SIZE + 1, device_mesh=mesh1d), dt.nn.ReLU(),
                             dt.nn.Linear(2 * SIZE + 1, 3, device_mesh=mesh1d))
    dt.parallelize_module(model, mesh1d, {"0": dt.ColwiseParallel(), "2": dt.RowwiseParallel()})
    dt.save(model.state_dict(), path)
    dt.manual_seed(2)
    other = dt.nn.Sequential(dt.nn.Linear(4, 2 * SIZE + 1, device_mesh=mesh1d), dt.nn.ReLU(),
                             dt.nn.Linear(2 * SIZE + 1, 3, device_mesh=mesh1d))
    dt.load(path, other)  # replicated target: resharded on load
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert np.array_equal(a.to_torch(), b.to_torch()), k


def test_failed_save_leaves_the_previous_file(mesh1d: dt.DeviceMesh, shared_dir: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.path.join(shared_dir, "atomic.h5")
    fulls, sd = state(mesh1d, LAYOUTS_1D, (SIZE + 2, 3))
    dt.save(sd, path)
    before = open(path, "rb").read() if RANK == 0 else b""
    real = ck._writer_piece
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if RANK == SIZE - 1 and calls["n"] == 2:
            raise OSError("out of memory preparing the piece (planted)")
        return real(*args, **kwargs)

    monkeypatch.setattr(ck, "_writer_piece", failing)
    _, changed = state(mesh1d, LAYOUTS_1D, (SIZE + 2, 3))
    for v in changed.values():
        v.to_local()[...] = 7
    with pytest.raises(dt.CheckpointError, match="planted"):
        dt.save(changed, path)
    monkeypatch.setattr(ck, "_writer_piece", real)
    WORLD.Barrier()
    if RANK == 0:
        assert open(path, "rb").read() == before, "the previous checkpoint changed"
        assert sorted(os.listdir(shared_dir)) == ["atomic.h5"], os.listdir(shared_dir)
    tgt = targets(mesh1d, LAYOUTS_1D, (SIZE + 2, 3))
    dt.load(path, tgt)
    for k, v in tgt.items():
        assert np.array_equal(v.to_torch(), fulls[k])


@pytest.mark.parametrize("damage", ["missing", "truncated", "garbage", "foreign", "version", "shape", "dtype"])
def test_damaged_and_foreign_files_are_rejected_everywhere(damage: str, mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    path = os.path.join(shared_dir, "bad.h5")
    _, sd = state(mesh1d, LAYOUTS_1D[:2], (2 * SIZE + 1, 3))
    if damage != "missing":
        dt.save(sd, path)
    if RANK == 0:
        if damage == "truncated":
            data = open(path, "rb").read()
            open(path, "wb").write(data[: len(data) // 2])
        elif damage == "garbage":
            open(path, "wb").write(b"\x89HDF\r\n\x1a\n" + os.urandom(4000))
        elif damage == "foreign":
            with h5py.File(path, "w") as f:
                f["layer0/w"] = np.zeros((2 * SIZE + 1, 3))
        elif damage == "version":
            with h5py.File(path, "r+") as f:
                f.attrs["version"] = 99
        elif damage in ("shape", "dtype"):
            with h5py.File(path, "r+") as f:
                del f["layer1/w"]
                f["layer1/w"] = np.zeros((2, 2)) if damage == "shape" else np.zeros((2 * SIZE + 1, 3), np.complex64)
                f["layer1/w"].attrs.update(dtype=f["layer1/w"].dtype.str, checksum=np.uint64(0))  # well formed
    WORLD.Barrier()
    tgt = {f"layer{i}.w": dt.zeros(2 * SIZE + 1, 3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)])
           for i in range(2)}
    expected = {"shape": dt.ShapeMismatchError, "dtype": dt.DTypeMismatchError}.get(damage, dt.CheckpointError)
    pattern = {"missing": "no checkpoint", "truncated": "HDF5|damaged|opened", "garbage": "HDF5|opened|damaged",
               "foreign": "not a dtorch_mpi checkpoint", "version": "version 99", "shape": "has shape",
               "dtype": "cannot load complex64"}[damage]
    with pytest.raises(expected, match=pattern):
        dt.load(path, tgt)
    assert not any(v.to_local().any() for v in tgt.values()), "a failed load changed the target"


def test_save_errors(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    with pytest.raises(dt.CheckpointError, match="does not exist"):
        dt.save({"a": dt.zeros(2, device_mesh=mesh1d)}, os.path.join(shared_dir, "no", "such", "x.h5"))
    with pytest.raises(dt.CheckpointError, match="takes DTensors"):
        dt.save({"a": np.zeros(2)}, os.path.join(shared_dir, "x.h5"))
    with pytest.raises(dt.CheckpointError, match="cannot be a dataset name"):
        dt.save({"a..b": dt.zeros(2, device_mesh=mesh1d)}, os.path.join(shared_dir, "x.h5"))
    if SIZE > 1:
        with pytest.raises(dt.CheckpointError, match="different state_dicts"):
            dt.save({f"k{RANK % 2}": dt.zeros(2, device_mesh=mesh1d)}, os.path.join(shared_dir, "x.h5"))
    WORLD.Barrier()
    if RANK == 0:
        assert not [f for f in os.listdir(shared_dir) if f.endswith(".tmp")]
