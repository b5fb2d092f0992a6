"""HDF5 checkpoints: round trips, resharding across mesh sizes and shapes, plain-h5py
readability, atomic saves, and damaged or foreign files rejected on every rank. Runs on the
pip-only stack (serial h5py: ranks write in turn) and on the parallel-HDF5 stack (MPI-IO)."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from typing import Any

import h5py
import numpy as np
import pytest
from backend_meshes import mesh1d_per_backend, mesh2d_per_backend  # noqa: F401 (fixtures: this module's meshes, per array backend)
from conftest import RANK, SIZE, Checker, to_numpy
from helpers import a_writing_rank, full_value, make_pieces, patch_bytes
from mpi4py import MPI
from mpi_launch import child_env, run

import dtorch_mpi as dt
from dtorch_mpi.checkpoint import writer as ck
from dtorch_mpi.checkpoint.checksum import checksum

# the checkpoint's own exchanges are plain MPI Allreduce/Allgather(v)/Bcast; its one path-dependent step (a
# Partial is reduce-scattered before it is saved) is a redistribute, checked on every path by
# test_redistribute and test_mpi_trace
pytestmark = pytest.mark.path_independent

WORLD = MPI.COMM_WORLD
LAYOUTS_1D = [[dt.Shard(0)], [dt.Shard(1)], [dt.Replicate()], [dt.Partial("sum")], [dt.Partial("max")]]


AGREEMENT_AT_TWO = pytest.mark.max_ranks(2)  # a refusal of metadata every rank reads alike: it takes two
# ranks to check that every rank raises; more ranks only re-run the same reads (docs/testing.md)


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



def assert_previous_file_intact(path: str, before: bytes, directory: str) -> None:
    """After a failed save: the old checkpoint unchanged, bit for bit, and no temporary left."""
    WORLD.Barrier()
    if RANK == 0:
        assert open(path, "rb").read() == before, "the previous checkpoint changed"
        assert sorted(os.listdir(directory)) == [os.path.basename(path)], os.listdir(directory)

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


def test_an_async_save_in_small_write_calls_round_trips(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, shared_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch, check: Checker) -> None:
    """An async save writes each piece in calls of at most ASYNC_WRITE_BYTES (h5py holds the GIL
    in each): with 16 bytes (two float64s) the pieces go in many row blocks, a rank with fewer
    rows (or none) making empty collective calls, and the file equals the blocking save's."""
    from dtorch_mpi.checkpoint import writer

    monkeypatch.setattr(writer, "ASYNC_WRITE_BYTES", 16)
    path = os.path.join(shared_dir, "small_writes.h5")
    for rows in (1, 2 * SIZE + 1):  # fewer rows than ranks; several blocks per piece, uneven
        fulls, sd = state(mesh2d, [[dt.Shard(0), dt.Shard(1)], [dt.Shard(1), dt.Replicate()],
                                   [dt.Replicate(), dt.Replicate()]], (rows, 3))
        handle = dt.save({**sd, "step": 3}, path, async_op=True)
        assert handle is not None
        handle.wait()
        tgt = {f"layer{i}.w": dt.zeros(rows, 3, dtype=np.float64, device_mesh=mesh1d, placements=LAYOUTS_1D[i])
               for i in range(3)}
        dt.load(path, {**tgt, "step": None})
        for k, v in tgt.items():
            check.equal(v.to_torch(), fulls[k], f"rows={rows} {k}")
    check.done()
    slab = writer._Slab("w", (5, 3), np.dtype(np.float64), None, None)  # 120 bytes over 2 ranks
    assert [writer._parts(slab, 2, n) for n in (None, 1, 16, 60, 1 << 20)] == [1, 5, 4, 1, 1]  # at most the rows
    assert [b is None for b in writer._row_blocks(((2, 0), (3, 3), np.zeros((3, 3))), 5)] == [True, False, True, False,
                                                                                              False]


def test_partial_is_saved_reduced_and_plain_h5py_reads_it(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    path = os.path.join(shared_dir, "plain.h5")
    fulls, sd = state(mesh1d, LAYOUTS_1D, (2 * SIZE + 1, 4))
    dt.save(sd, path)
    if RANK == 0:
        with h5py.File(path, "r") as f:
            assert f.attrs["format"] == b"dtorch_mpi" and int(f.attrs["version"]) == 3  # fixed-length strings
            for i in range(len(LAYOUTS_1D)):
                ds = f[f"layer{i}/w"]
                assert ds.shape == (2 * SIZE + 1, 4) and ds.dtype == np.float64
                assert np.array_equal(ds[()], fulls[f"layer{i}.w"])
                assert ds.attrs["placements"] == repr(LAYOUTS_1D[i])
                assert ds.attrs["dtype"] == b"<f8"
                # the collectively combined checksum is the checksum of the complete array
                assert int(ds.attrs["checksum"]) == checksum(fulls[f"layer{i}.w"], (0, 0), ds.shape)


@pytest.mark.mpi(min_size=2)
def test_reshard_across_mesh_sizes_and_shapes(mesh1d: dt.DeviceMesh, shared_dir: str, check: Checker) -> None:
    """Save on every rank, load on sub-meshes of 1..SIZE ranks (and 2x2), and back (meshes of
    ``mesh1d``'s device type)."""
    path = os.path.join(shared_dir, "reshard.h5")
    device = mesh1d.device_type
    with dt.init_device_mesh(device, (SIZE,)) as full_mesh:
        fulls, sd = state(full_mesh, LAYOUTS_1D, (2 * SIZE + 1, 5))
        dt.save(sd, path)
    shapes = [[list(range(n))] for n in range(1, SIZE + 1)]
    if SIZE == 4:
        shapes.append([[0, 1], [2, 3]])
    for ranks in shapes:
        ranks_arr = np.array(ranks[0] if len(ranks) == 1 else ranks)
        with dt.DeviceMesh(device, ranks_arr) as mesh:
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
    with dt.init_device_mesh(device, (SIZE,)) as full_mesh:
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


@pytest.mark.parametrize("staging", ["all", "chunks"])
def test_load_is_in_place_for_every_holder_of_the_old_arrays(staging: str, mesh1d: dt.DeviceMesh, shared_dir: str,
                                                              check: Checker) -> None:
    """Both staging modes load in place: an array taken with to_local() before the load, and a
    second DTensor sharing a target's local array (tied weights), see the loaded values; a
    target still waiting on an async redistribute gets that collective completed first."""
    path = os.path.join(shared_dir, "ck.h5")
    shape = (2 * SIZE + 1, 3)
    fulls, sd = state(mesh1d, LAYOUTS_1D, shape)
    dt.save(sd, path)
    tgt = targets(mesh1d, LAYOUTS_1D, shape)
    # layer1.w: nobody else holds its array (swapped in); layer0.w: replaced by a pending tensor below
    held = [k for k in tgt if k not in ("layer0.w", "layer1.w")]
    before = {k: tgt[k].to_local() for k in held}
    tied = {k: dt.DTensor.from_local(tgt[k].to_local(), mesh1d, tgt[k].placements, shape=tgt[k].shape) for k in held}
    tgt["layer0.w"] = dt.zeros(*shape, dtype=np.float64, device_mesh=mesh1d,
                               placements=[dt.Replicate()]).redistribute(placements=[dt.Shard(0)], async_op=True)
    dt.load(path, tgt, staging=staging)
    for k, v in tgt.items():
        check.equal(v.to_torch(), fulls[k], f"{k} -> {list(v.placements)}")
        if k in held:
            check.true(np.shares_memory(before[k], v.to_local()), f"{k}: the load replaced an array others hold")
            check.true(np.array_equal(before[k], v.to_local()), f"{k}: the array taken before the load was not loaded")
            check.equal(tied[k].to_torch(), fulls[k], f"{k}: a tensor sharing the array")
    check.done()


def test_saves_and_loads_leave_nothing_to_the_cycle_collector(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    """A reference cycle made per save or load (a recursive closure did: tree.walk, validate.scan)
    keeps what it reaches, the load's h5py datasets included, until the cycle collector runs."""
    _, sd = state(mesh1d, LAYOUTS_1D, (SIZE + 1, 3))
    sd["meta"] = {"step": 3, "names": ["a", "b"], "array": np.arange(4)}
    path = os.path.join(shared_dir, "ck.h5")
    dt.save(sd, path)  # the first call of each kind imports and caches what later calls reuse
    dt.load(path, sd)
    gc.collect()
    gc.freeze()  # everything alive now is left out of the collections below (fast in a long session)
    try:
        left = {}
        for name, call in (("save", lambda: dt.save(sd, path)), ("async save", lambda: dt.save(sd, path, async_op=True).wait()),
                           ("load", lambda: dt.load(path, sd)), ("load chunks", lambda: dt.load(path, sd, staging="chunks"))):
            call()
            left[name] = gc.collect()
    finally:
        gc.unfreeze()
    assert not any(left.values()), f"objects only the cycle collector frees, per call: {left}"


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
    assert_previous_file_intact(path, before, shared_dir)
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
                f["layer1/w"].attrs.update(dtype=np.bytes_(f["layer1/w"].dtype.str), checksum=np.uint64(0))  # well formed
            reseal(path)
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
    with pytest.raises(dt.CheckpointError, match="cannot save a set"):
        dt.save({"a": {1, 2}}, os.path.join(shared_dir, "x.h5"))
    with pytest.raises(dt.CheckpointError, match="cannot be a dataset name"):
        dt.save({"a..b": dt.zeros(2, device_mesh=mesh1d)}, os.path.join(shared_dir, "x.h5"))
    for name in ("a\x00b", "\x00", "ok.a\x00"):  # HDF5 names end at a NUL: "a\x00b" was stored as "a"
        for value in (dt.zeros(2, device_mesh=mesh1d), 1.5, {"inner": 2}):
            with pytest.raises(dt.CheckpointError, match="no NUL character"):
                dt.save({name: value}, os.path.join(shared_dir, "x.h5"))
        with pytest.raises(dt.CheckpointError, match="no NUL character"):
            dt.save({"outer": {name: 1}}, os.path.join(shared_dir, "x.h5"))
    assert not os.path.exists(os.path.join(shared_dir, "x.h5"))
    if SIZE > 1:
        with pytest.raises(dt.CheckpointError, match="different state_dicts"):
            dt.save({f"k{RANK % 2}": dt.zeros(2, device_mesh=mesh1d)}, os.path.join(shared_dir, "x.h5"))
    WORLD.Barrier()
    if RANK == 0:
        assert not [f for f in os.listdir(shared_dir) if f.endswith(".tmp")]


# ---- untrusted files: crafted with plain h5py, each refused on every rank before the target changes ----

N_ROWS = 2 * SIZE + 1


def _replace(f: h5py.File, name: str, make: Any) -> None:
    """Replace dataset ``name`` by ``make(group, leaf)``, keeping the original attributes."""
    attrs = dict(f[name].attrs)
    del f[name]
    group, leaf = name.rsplit("/", 1)
    make(f[group], leaf)
    if isinstance(f.get(name, getlink=True), h5py.HardLink) and isinstance(f[name], h5py.Dataset):
        f[name].attrs.update(attrs)


def _craft(kind: str, path: str, d: str) -> None:
    """Damage a valid checkpoint at ``path`` (rank 0 only); ``d`` holds any side files."""
    value = full_value((N_ROWS, 3), 1)
    if kind == "bit_flip":
        patch_bytes(path, "layer1/w", lambda b: b.__setitem__(11, b[11] ^ 0x10))
        return
    if kind == "zeroed":
        patch_bytes(path, "layer1/w", lambda b: b.__setitem__(slice(0, len(b) // 4), bytes(len(b) // 4)))
        return
    with h5py.File(path, "r+") as f:
        secret = os.path.join(d, "secret.bin")
        if kind == "external":
            with open(secret, "wb") as fh:
                fh.write(np.full((N_ROWS, 3), 42.0).tobytes())
            _replace(f, "layer1/w", lambda g, n: g.create_dataset(n, shape=(N_ROWS, 3), dtype="<f8",
                                                                   external=[(secret, 0, value.nbytes)]))
        elif kind == "virtual":
            with h5py.File(secret, "w") as other:
                other["x"] = np.full((N_ROWS, 3), 42.0)
            layout = h5py.VirtualLayout(shape=(N_ROWS, 3), dtype="<f8")
            layout[...] = h5py.VirtualSource(secret, "x", shape=(N_ROWS, 3))
            _replace(f, "layer1/w", lambda g, n: g.create_virtual_dataset(n, layout))
        elif kind == "external_link":
            with h5py.File(secret, "w") as other:
                other["x"] = np.full((N_ROWS, 3), 42.0)
            _replace(f, "layer1/w", lambda g, n: g.__setitem__(n, h5py.ExternalLink(secret, "/x")))
        elif kind == "soft_link":
            _replace(f, "layer1/w", lambda g, n: g.__setitem__(n, h5py.SoftLink("/layer0/w")))
        elif kind == "second_name":
            f["alias"] = f["layer0"]  # the same group under two names (a hard link)
        elif kind == "gzip":
            _replace(f, "layer1/w", lambda g, n: g.create_dataset(n, data=value, chunks=(1, 3), compression="gzip"))
        elif kind == "chunk_bomb":  # a 1.5 MiB gzip chunk for a few dozen bytes of data
            _replace(f, "layer1/w", lambda g, n: g.create_dataset(n, data=value, maxshape=(None, 3), chunks=(1 << 16, 3),
                                                                   compression="gzip"))
        elif kind == "null_dataspace":
            _replace(f, "layer1/w", lambda g, n: g.create_dataset(n, data=h5py.Empty("<f8")))
        elif kind == "dotted_name":  # /layer1.w and /layer1/w would both be key layer1.w
            f["layer1.w"] = value
        elif kind == "format_array":
            f.attrs["format"] = np.array([b"dtorch_mpi", b"dtorch_mpi"])
        elif kind.startswith("version_"):
            f.attrs["version"] = {"version_str": "one", "version_list": np.array([1, 1]), "version_float": 1.9,
                                  "version_1": 1}[kind]
        elif kind == "dtype_flip":  # the same bytes declared uint64
            _replace(f, "layer1/w", lambda g, n: g.create_dataset(n, data=value.view("<u8")))
        elif kind == "never_written":
            _replace(f, "layer1/w", lambda g, n: g.create_dataset(n, shape=(N_ROWS, 3), dtype="<f8", fillvalue=np.nan))
        elif kind == "fill_value":  # allocated (as MPI-IO writers do) but never written: NaN everywhere
            def early(g: h5py.Group, n: str) -> None:
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_value(np.array(np.nan))
                space = h5py.h5s.create_simple((N_ROWS, 3))
                h5py.h5d.create(g.id, n.encode(), h5py.h5t.IEEE_F64LE, space, dcpl=dcpl)
            _replace(f, "layer1/w", early)
        elif kind == "no_checksum":
            del f["layer1/w"].attrs["checksum"]
        elif kind == "checksum_array_type":  # a scalar dataspace whose type is an array of 3 uint64
            del f["layer1/w"].attrs["checksum"]
            atype = h5py.h5t.array_create(h5py.h5t.STD_U64LE, (3,))
            h5py.h5a.create(f["layer1/w"].id, b"checksum", atype, h5py.h5s.create(h5py.h5s.SCALAR)).write(
                np.arange(3, dtype=np.uint64), mtype=atype)
    if kind == "huge_attribute":  # 128 KiB for a scalar (dense attribute storage needs libver latest)
        with h5py.File(path, "r+", libver="latest") as f:
            _replace(f, "layer1/w", lambda g, n: g.create_dataset(n, data=value))
            f["layer1/w"].attrs["checksum"] = np.zeros(1 << 14, np.uint64)


def reseal(path: str) -> None:
    """Give a crafted file the ``layout`` digest of what it now holds (as a forger would), so the
    checks after it are what refuses it; a file that ``scan`` already refuses is left as it is."""
    with h5py.File(path, "r") as f:
        try:
            digest = ck.validate.listing_digest(ck.validate.scan(f, path))
        except dt.CheckpointError:
            return
    with h5py.File(path, "r+") as f:
        f.attrs[ck.validate.LAYOUT] = digest


UNTRUSTED = {  # kind -> what the error must say (each names the dataset or attribute)
    "external": "layer1/w keeps its data in external files",
    "virtual": "layer1/w is a virtual dataset",
    "external_link": "layer1/w is a ExternalLink",
    "soft_link": "layer1/w is a SoftLink",
    "second_name": "second name of an object",
    "gzip": r"layer1/w uses HDF5 filters \['deflate'\]",
    "chunk_bomb": "layer1/w is stored in chunks of 1572864 bytes",
    "null_dataspace": "layer1/w has a null dataspace",
    "dotted_name": r"/layer1\.w has a '\.' in its name",
    "format_array": "attribute 'format' of / is an array",
    "version_str": "attribute 'version' must be an integer, got a str",
    "version_list": "attribute 'version' of / is an array",
    "checksum_array_type": r"attribute 'checksum' of /layer1/w is an array of shape \(3,\); expected a scalar",
    "version_float": "attribute 'version' must be an integer, got a float",
    "version_1": "version 1 predates per-dataset checksums",
    "dtype_flip": "layer1/w is stored as <u8 but its 'dtype' attribute says str '<f8'",
    "never_written": "layer1/w has no data stored",
    "fill_value": "checksum mismatch in dataset /layer1/w",
    "bit_flip": "checksum mismatch in dataset /layer1/w",
    "zeroed": "checksum mismatch in dataset /layer1/w",
    "no_checksum": "/layer1/w lacks the attribute 'checksum'",
    "huge_attribute": "attribute 'checksum' of /layer1/w holds 131072 bytes",
}


@AGREEMENT_AT_TWO
@pytest.mark.parametrize(("kind", "staging"), [(kind, "all") for kind in sorted(UNTRUSTED)] + [
    (kind, "chunks") for kind in ("bit_flip", "zeroed", "fill_value", "external")])  # checksums: both stagings
def test_untrusted_files_are_refused_before_reading(kind: str, staging: str, mesh1d: dt.DeviceMesh,
                                                    shared_dir: str) -> None:
    path = os.path.join(shared_dir, "crafted.h5")
    _, sd = state(mesh1d, LAYOUTS_1D[:3], (N_ROWS, 3))
    dt.save(sd, path)
    if RANK == 0:
        _craft(kind, path, shared_dir)
    WORLD.Barrier()
    tgt = {f"layer{i}.w": dt.zeros(N_ROWS, 3, dtype=np.float64, device_mesh=mesh1d, placements=LAYOUTS_1D[i])
           for i in range(3)}
    with pytest.raises(dt.CheckpointError, match=UNTRUSTED[kind]):
        dt.load(path, tgt, staging=staging)
    assert not any(v.to_local().any() for v in tgt.values()), "a refused load changed the target"


def test_chunked_staging_matches_and_verifies(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, shared_dir: str,
                                              monkeypatch: pytest.MonkeyPatch, check: Checker) -> None:
    """staging='chunks' (here with 40-byte chunks: several per piece) loads exactly what 'all' loads."""
    from dtorch_mpi.checkpoint import reader

    monkeypatch.setattr(reader, "CHUNK_BYTES", 40)
    path = os.path.join(shared_dir, "chunks.h5")
    for rows in (0, 1, 2 * SIZE + 1):
        fulls, sd = state(mesh1d, LAYOUTS_1D, (rows, 3))
        dt.save(sd, path)
        for mesh, layouts in ((mesh1d, LAYOUTS_1D), (mesh2d, [[dt.Shard(1), dt.Shard(0)], [dt.Partial("avg"), dt.Shard(1)],
                                                               [dt.Replicate(), dt.Partial("max")]])):
            tgt = targets(mesh, layouts, (rows, 3))
            dt.load(path, tgt, staging="chunks")
            for k, v in tgt.items():
                check.equal(v.to_torch(), fulls[k], f"rows={rows} {k} -> {list(v.placements)} (chunks)")
    check.done()
    with pytest.raises(dt.CheckpointError, match=r"staging='tensor'.*use one of all, chunks"):
        dt.load(path, targets(mesh1d, LAYOUTS_1D, (2 * SIZE + 1, 3)), staging="tensor")


def test_zero_dim_tensors_round_trip(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, shared_dir: str,
                                     check: Checker) -> None:
    path = os.path.join(shared_dir, "scalars.h5")
    plain = {"r": [dt.Replicate()], "psum": [dt.Partial("sum")], "pmax": [dt.Partial("max")]}
    sd = {k: dt.full((), 3.5, dtype=np.float32, device_mesh=mesh1d, placements=plc) for k, plc in plain.items()}
    dt.save(sd, path)
    for mesh in (mesh1d, mesh2d):
        for staging in ("all", "chunks"):
            tgt = {k: dt.zeros((), dtype=np.float32, device_mesh=mesh, placements=[p] * mesh.ndim)
                   for k, p in zip(plain, (dt.Partial("min"), dt.Replicate(), dt.Partial("avg")))}
            dt.load(path, tgt, staging=staging)
            for k, v in tgt.items():
                got = v.to_torch()
                check.true(got.shape == () and float(got) == 3.5, f"{k} on {mesh.shape} ({staging}): {got!r}")
    check.done()


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_paths_raise_everywhere(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    _, sd = state(mesh1d, LAYOUTS_1D, (N_ROWS, 3))
    mine = os.path.join(shared_dir, f"rank{RANK % 2}.h5")
    with pytest.raises(dt.CheckpointError, match="ranks passed different paths"):
        dt.save(sd, mine)
    dt.save(sd, os.path.join(shared_dir, "rank0.h5"))
    dt.save(sd, os.path.join(shared_dir, "rank1.h5"))
    tgt = targets(mesh1d, LAYOUTS_1D, (N_ROWS, 3))
    before = {k: v.to_local().copy() for k, v in tgt.items()}
    with pytest.raises(dt.CheckpointError, match="ranks passed different paths"):
        dt.load(mine, tgt)
    assert all(np.array_equal(v.to_local(), before[k]) for k, v in tgt.items()), "a refused load changed the target"
    WORLD.Barrier()
    if RANK == 0:
        assert sorted(os.listdir(shared_dir)) == ["rank0.h5", "rank1.h5"], os.listdir(shared_dir)


def test_io_error_in_a_collective_write_raises_everywhere(mesh1d: dt.DeviceMesh, shared_dir: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The write itself reports an error on one rank (after the collective completed): every rank
    raises, the previous file is intact and the temporary file is gone (both HDF5 stacks)."""
    path = os.path.join(shared_dir, "io.h5")
    fulls, sd = state(mesh1d, LAYOUTS_1D, (N_ROWS, 3))
    dt.save(sd, path)
    before = open(path, "rb").read() if RANK == 0 else b""
    real, calls = ck._write_slab, {"n": 0}
    writer = a_writing_rank()

    def failing_write(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        calls["n"] += 1
        if writer == RANK and calls["n"] == 2:
            raise OSError(28, "No space left on device (planted)")

    monkeypatch.setattr(ck, "_write_slab", failing_write)
    for v in sd.values():
        v.to_local()[...] = 7
    with pytest.raises(dt.CheckpointError, match="No space left on device"):
        dt.save(sd, path)
    monkeypatch.setattr(ck, "_write_slab", real)
    assert_previous_file_intact(path, before, shared_dir)
    tgt = targets(mesh1d, LAYOUTS_1D, (N_ROWS, 3))
    dt.load(path, tgt)
    for k, v in tgt.items():
        assert np.array_equal(v.to_torch(), fulls[k])


def _fails_on(rank: int, real: Any, error: Exception) -> Any:
    """``real``, raising ``error`` instead on ``rank``."""
    def failing(*args: Any, **kwargs: Any) -> Any:
        if rank == RANK:
            raise error
        return real(*args, **kwargs)
    return failing


@pytest.mark.parametrize("stage", ["structure", "directory", "reduce", "pieces", "exchange", "finish"])
def test_a_save_failing_on_one_rank_at_any_step_fails_everywhere(mesh1d: dt.DeviceMesh, shared_dir: str,
                                                                monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    """Each step of a save agrees on its errors in a collective it makes anyway (spmd.agreed_min,
    agreed_allgather, pieces.exchange, the end of Job.run): a failure on one rank at any of them
    raises on every rank, names that rank, and leaves the previous file intact with no temporary."""
    path = os.path.join(shared_dir, "steps.h5")
    _, sd = state(mesh1d, LAYOUTS_1D, (N_ROWS, 3))
    dt.save(sd, path)
    before = open(path, "rb").read() if RANK == 0 else b""
    last = SIZE - 1
    planted = OSError(5, f"planted failure at {stage}")
    if stage == "structure":  # (a refused value raises CheckpointError there)
        monkeypatch.setattr(ck.tree, "flatten", _fails_on(last, ck.tree.flatten, dt.CheckpointError(str(planted))))
    elif stage == "directory":
        real_isdir = os.path.isdir  # a directory one rank does not see (node-local storage)
        monkeypatch.setattr(ck.os.path, "isdir", lambda d: last != RANK and real_isdir(d))
    elif stage == "reduce":  # after the last tensor's reduction (a failure inside one is the collective's own)
        real_writable, calls = ck._writable, {"n": 0}

        def writable_then_fail(value: Any) -> Any:
            out = real_writable(value)
            calls["n"] += 1
            if last == RANK and calls["n"] == len(sd):
                raise planted
            return out
        monkeypatch.setattr(ck, "_writable", writable_then_fail)
    elif stage == "pieces":
        monkeypatch.setattr(ck, "_slab", _fails_on(last, ck._slab, planted))
    elif stage == "exchange":
        monkeypatch.setattr(ck._Slab, "own", _fails_on(last, ck._Slab.own, planted))
    else:
        monkeypatch.setattr(ck, "_fsync_file", _fails_on(0, ck._fsync_file, planted))
    for v in sd.values():
        v.to_local()[...] = 7
    failing = 0 if stage == "finish" else last
    pattern = "does not exist" if stage == "directory" else f"planted failure at {stage}"
    with pytest.raises(dt.CheckpointError, match=pattern) as raised:
        dt.save(sd, path)
    if SIZE > 1:
        assert f"rank {failing}" in str(raised.value), str(raised.value)
    monkeypatch.undo()
    assert_previous_file_intact(path, before, shared_dir)


def test_chunked_staging_notices_a_file_changing_between_passes(mesh1d: dt.DeviceMesh, shared_dir: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """staging='chunks' reads twice; data that differs in the second read raises on every rank."""
    from dtorch_mpi.checkpoint import reader

    path = os.path.join(shared_dir, "changing.h5")
    _, sd = state(mesh1d, LAYOUTS_1D[:3], (N_ROWS, 3))
    dt.save(sd, path)
    real, reads = reader._read, {"n": 0}
    first_pass = len(sd)  # rank 0 holds a non-empty piece of each tensor: one chunk each

    def changing(ds: Any, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        out = real(ds, offset, shape)
        reads["n"] += 1
        if RANK == 0 and reads["n"] > first_pass:
            out.reshape(-1)[0] += 1.0  # as if another job rewrote the file meanwhile
        return out

    monkeypatch.setattr(reader, "_read", changing)
    tgt = targets(mesh1d, LAYOUTS_1D, (N_ROWS, 3))
    with pytest.raises(dt.CheckpointError, match="changed while loading"):
        dt.load(path, {k: tgt[k] for k in sd}, staging="chunks")


@pytest.mark.parametrize("staging", ["all", "chunks"])
def test_read_error_on_one_rank_raises_everywhere_and_changes_nothing(mesh1d: dt.DeviceMesh, shared_dir: str,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      staging: str) -> None:
    """A read that fails on one rank only (its report travels with the verdicts): every rank
    raises naming it, and no target changed."""
    from dtorch_mpi.checkpoint import reader

    path = os.path.join(shared_dir, "readfail.h5")
    fulls, sd = state(mesh1d, LAYOUTS_1D[:3], (N_ROWS, 3))
    dt.save(sd, path)
    real = reader._read

    def failing(ds: Any, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        if RANK == SIZE - 1:
            raise OSError(5, "Input/output error (planted)")
        return real(ds, offset, shape)

    tgt = targets(mesh1d, LAYOUTS_1D[:3], (N_ROWS, 3))
    tgt = {k: tgt[k] for k in sd}
    locals_before = {k: v._local for k, v in tgt.items()}
    monkeypatch.setattr(reader, "_read", failing)
    with pytest.raises(dt.CheckpointError, match=r"Input/output error \(planted\)"):
        dt.load(path, tgt, staging=staging)
    monkeypatch.setattr(reader, "_read", real)
    for k, v in tgt.items():
        assert v._local is locals_before[k] and not v.to_local().any(), f"{k}: a failed load changed the target"
    dt.load(path, tgt, staging=staging)
    for k, v in tgt.items():
        assert np.array_equal(v.to_torch(), fulls[k])


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_staging_raise_everywhere(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    """Path and staging are agreed in one collective; each still has its own message (the path first)."""
    path = os.path.join(shared_dir, "staging.h5")
    _, sd = state(mesh1d, LAYOUTS_1D[:3], (N_ROWS, 3))
    dt.save(sd, path)
    tgt = targets(mesh1d, LAYOUTS_1D[:3], (N_ROWS, 3))
    tgt = {k: tgt[k] for k in sd}
    mine = ("all", "chunks")[RANK % 2]
    with pytest.raises(dt.CheckpointError, match=r"ranks passed different staging options.*rank 0: 'all'; rank 1: 'chunks'"):
        dt.load(path, tgt, staging=mine)
    with pytest.raises(dt.CheckpointError, match="ranks passed different paths"):
        dt.load(path if RANK % 2 else path + ".other", tgt, staging=mine)
    assert all(not v.to_local().any() for v in tgt.values()), "a refused load changed the target"


# ---- training state: nested mappings, Python scalars with exact types, optimizers ----

SCALARS: dict[str, Any] = {
    "step": 7, "big": -(2 ** 63), "lr": 0.1, "nan": float("nan"), "neg0": -0.0, "inf": float("-inf"),
    "flag": True, "off": False, "name": "héllo ✓", "empty_str": "", "none": None,
    "betas": (0.9, 0.999), "params": [0, 1, 2], "flags": [True, False], "ints_t": (3,),
    "mixed": [1, "a", None, 2.5, (True, 2)], "empty": [], "empty_t": (), "empty_map": {},
    "nested": {"deep": {3: "x", -1: (True, False)}, "groups": [{"lr": 1e-3, "params": [4, 5]}]},
    "dotted.key": 3, "zero_d": np.float32(2.5), "ints": np.arange(5, dtype=np.int16),
}


def _same(got: Any, want: Any, where: str = "") -> None:
    """Equal values of exactly the same types, recursively (NaN equals NaN, -0.0 is not 0.0)."""
    if isinstance(want, np.generic):
        want = np.asarray(want)
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(want, float):
        assert np.float64(got).tobytes() == np.float64(want).tobytes(), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def test_scalars_round_trip_with_exact_types(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    path = os.path.join(shared_dir, "scalars.h5")
    fulls, sd = state(mesh1d, LAYOUTS_1D[:2], (N_ROWS, 3))
    dt.save({**SCALARS, "tensors": sd}, path)
    tgt = targets(mesh1d, LAYOUTS_1D, (N_ROWS, 3))
    slots: dict[str, Any] = {k: None for k in SCALARS}
    slots["dotted"] = {"key": None}
    del slots["dotted.key"]
    slots["tensors"] = {k: tgt[k] for k in sd}
    assert dt.load(path, slots) is slots
    want = dict(SCALARS, dotted={"key": 3})
    del want["dotted.key"]
    for key, value in want.items():
        _same(slots[key], value, key)
    for k in sd:
        assert np.array_equal(tgt[k].to_torch(), fulls[k]), k
    if RANK == 0:  # plain h5py reads every value
        with h5py.File(path, "r") as f:
            assert f["step"][()] == 7 and f["step"].attrs["pytype"] == b"int"
            assert f["name"][()].tobytes().decode() == "héllo ✓" and f["mixed"].attrs["pytype"] == b"list"
            assert list(f["betas"][()]) == [0.9, 0.999] and f["betas"].attrs["pytype"] == b"tuple[float]"
            assert f["nested/deep"].attrs["pytype"] == b"dict[int]" and f["dotted/key"][()] == 3


def test_save_refuses_unstorable_keys_and_values(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    path = os.path.join(shared_dir, "bad.h5")
    cases: list[tuple[Any, str]] = [
        ({"a/b": 1}, "cannot be a dataset name"), ({"": 1}, "cannot be a dataset name"),
        ({"a.b": 1, "a": {"b": 2}}, "names two values"), ({"a": 1, "a.b": 2}, "names two values"),
        ({"m": {1: 1, "x": 2}}, "mixes key types"), ({"m": {True: 1}}, "keys are str or int"),
        ({"n": 2 ** 63}, "int64 range"), ({"n": [1, 2 ** 64]}, "int64 range"), ({"o": object()}, "cannot save a object"),
        ({"s": np.array(["x"])}, "dtype <U1"), ({"bad": "\ud800"}, "UTF-8"),
    ]
    for obj, message in cases:
        with pytest.raises(dt.CheckpointError, match=message):
            dt.save(obj, path)
    if SIZE > 1:
        with pytest.raises(dt.CheckpointError, match="different state_dicts"):
            dt.save({"step": RANK}, path)
        with pytest.raises(dt.CheckpointError, match="different state_dicts"):
            dt.save({"array": np.full(3, RANK)}, path)
    WORLD.Barrier()
    if RANK == 0:
        assert os.listdir(shared_dir) == [], os.listdir(shared_dir)


class _TwoLayer(dt.nn.Module):
    """Linear -> ReLU -> Linear; ``sharded``: the first Colwise and the second Rowwise (its
    Partial output all-reduced), else everything replicated."""

    def __init__(self, mesh: dt.DeviceMesh, sharded: bool) -> None:
        super().__init__()
        self.fc1 = dt.nn.Linear(3, N_ROWS, device_mesh=mesh, dtype=np.float64)
        self.fc2 = dt.nn.Linear(N_ROWS, 2, device_mesh=mesh, dtype=np.float64)
        if sharded:
            for layer, w, b in ((self.fc1, dt.Shard(0), dt.Shard(0)), (self.fc2, dt.Shard(1), dt.Replicate())):
                layer.weight = dt.nn.Parameter(layer.weight.redistribute(placements=[w] * mesh.ndim))
                layer.bias = dt.nn.Parameter(layer.bias.redistribute(placements=[b] * mesh.ndim))

    def forward(self, x: dt.DTensor) -> dt.DTensor:
        h = dt.nn.functional.relu(dt.nn.functional.linear(x, self.fc1.weight, self.fc1.bias)) @ self.fc2.weight.T
        if any(p.is_partial() for p in h.placements):
            h = h.redistribute(placements=[dt.Replicate()] * len(h.placements))
        return h + self.fc2.bias


def _training_state(mesh: dt.DeviceMesh, seed: int, lr: float = 0.01, sharded: bool = True) -> tuple[Any, Any]:
    """A model and AdamW after two steps (so the optimizer has moments and step counts)."""
    dt.manual_seed(seed)
    model = _TwoLayer(mesh, sharded)
    opt = dt.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.9))
    x = dt.distribute_tensor(np.random.default_rng(3).standard_normal((4, 3)), mesh, [dt.Replicate()] * mesh.ndim)
    for _ in range(2):
        opt.zero_grad()
        out = model(x)
        dt.nn.functional.mse_loss(out, dt.distribute_tensor(np.ones(out.shape), mesh, out.placements)).backward()
        dt.nn.utils.reduce_gradients(list(model.parameters()))
        opt.step()
    return model, opt


def _snapshot(model: Any, opt: Any) -> list[Any]:
    tensors = [p.to_local().copy() for p in model.parameters()]
    tensors += [s[k].to_local().copy() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return [tensors, repr(opt.param_groups), [s["step"] for s in opt.state.values()]]


def _unchanged(before: list[Any], after: list[Any]) -> bool:
    return (all(np.array_equal(a, b) for a, b in zip(before[0], after[0])) and before[1:] == after[1:]
            and len(before[0]) == len(after[0]))


MALFORMED = {  # kind -> (what the crafted file has, what the error must say)
    "unknown_pytype": "dataset /step: unknown pytype attribute str 'complex'",
    "pytype_not_str": "dataset /step: unknown pytype attribute int 5",
    "int_stored_as_float": r"pytype 'int' is stored as a 0-d <i8 dataset, this one is 0-d <f8",
    "bool_not_0_1": "malformed 'bool' value",
    "str_not_utf8": "malformed 'str' value .not UTF-8",
    "none_not_empty": "malformed 'None' value",
    "scalar_bit_flip": "checksum mismatch in dataset /step",
    "group_pytype": "group /mixed: unknown group pytype attribute str 'set'",
    "list_member_missing": r"list group 'mixed' must hold members 0..0, has \['1'\]",
    "dict_int_member": "dict.int. group 'optim.state' has non-integer member names",
    "moment_missing": "lacks .'exp_avg'.",
    "moment_is_scalar": "is not a tensor dataset",
    "step_is_tensor": "unexpected tensor 'step'",
    "optimizer_groups": "does not fit the optimizer",
    "hyperparameter_type": "optimizer state at 'optim' is malformed",
    "moment_bit_flip": "checksum mismatch in dataset /optim/state/1/exp_avg_sq",
    "moment_shape": r"optim.state.0.exp_avg: value has shape",
}


def _craft_scalar(kind: str, path: str) -> None:
    with h5py.File(path, "r+") as f:
        def put(name: str, data: np.ndarray, pytype: Any) -> None:
            attrs = {k: v for k, v in f[name].attrs.items() if k != "pieces"} if name in f else {}  # lin64 only
            if name in f:
                del f[name]
            f[name] = data
            f[name].attrs.update(attrs, dtype=np.bytes_(data.dtype.str),
                                 checksum=np.uint64(checksum(data, (0,) * data.ndim, data.shape)))
            f[name].attrs["pytype"] = np.bytes_(pytype) if isinstance(pytype, str) else pytype
        if kind == "unknown_pytype":
            f["step"].attrs["pytype"] = np.bytes_("complex")
        elif kind == "pytype_not_str":
            f["step"].attrs["pytype"] = 5
        elif kind == "int_stored_as_float":
            put("step", np.array(7.0), "int")
        elif kind == "bool_not_0_1":
            put("flag", np.array(7, dtype=np.uint8), "bool")
        elif kind == "str_not_utf8":
            put("name", np.frombuffer(b"\xff\xfe", dtype=np.uint8), "str")
        elif kind == "none_not_empty":
            put("none", np.zeros(2, dtype=np.uint8), "None")
        elif kind == "group_pytype":
            f["mixed"].attrs["pytype"] = np.bytes_("set")
        elif kind == "list_member_missing":
            del f["mixed/0"]
        elif kind == "dict_int_member":
            f.move("optim/state/0", "optim/state/x")
        elif kind == "moment_missing":
            del f["optim/state/0/exp_avg"]
        elif kind == "moment_is_scalar":
            put("optim/state/0/exp_avg", np.array(1.0), "float")
        elif kind == "step_is_tensor":
            attrs = {k: v for k, v in f["optim/state/0/step"].attrs.items() if k != "pytype"}
            del f["optim/state/0/step"]
            f["optim/state/0/step"] = np.array(2)
            f["optim/state/0/step"].attrs.update(attrs, dtype=np.bytes_(np.dtype(int).str))
        elif kind == "optimizer_groups":
            put("optim/param_groups/0/params", np.arange(3), "list[int]")
        elif kind == "hyperparameter_type":
            put("optim/param_groups/0/lr", np.frombuffer(b"fast", dtype=np.uint8), "str")
    if kind == "scalar_bit_flip":
        patch_bytes(path, "step", lambda data: data.__setitem__(0, data[0] ^ 1))
    elif kind == "moment_bit_flip":
        patch_bytes(path, "optim/state/1/exp_avg_sq", lambda data: data.__setitem__(3, data[3] ^ 16))
    elif kind == "moment_shape":
        with h5py.File(path, "r+") as f:
            _replace(f, "optim/state/0/exp_avg", lambda g, n: g.create_dataset(n, data=np.zeros((1, 3))))
            f["optim/state/0/exp_avg"].attrs["checksum"] = np.uint64(0)
            del f["optim/state/0/exp_avg"].attrs["pieces"]  # the old table no longer fits the shape
    reseal(path)


@AGREEMENT_AT_TWO
@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_training_state_is_refused_and_changes_nothing(kind: str, mesh1d: dt.DeviceMesh,
                                                                 shared_dir: str) -> None:
    """Crafted scalar metadata and optimizer state: a CheckpointError naming it, on every rank,
    and neither the model, the optimizer nor the scalar slots change."""
    path = os.path.join(shared_dir, "train.h5")
    model, opt = _training_state(mesh1d, 0)
    dt.save({"model": model, "optim": opt, "step": 7, "flag": True, "name": "x", "none": None,
             "mixed": [1, "a"]}, path)
    WORLD.Barrier()
    if RANK == 0:
        _craft_scalar(kind, path)
    WORLD.Barrier()
    fresh_model, fresh_opt = _training_state(mesh1d, 1, lr=0.5)
    before = _snapshot(fresh_model, fresh_opt)
    slots: dict[str, Any] = {"step": 0, "flag": None, "name": None, "none": 1, "mixed": None}
    target = {"model": fresh_model, "optim": fresh_opt, **slots}
    error = dt.ShapeMismatchError if kind == "moment_shape" else dt.CheckpointError
    with pytest.raises(error, match=MALFORMED[kind]):
        dt.load(path, target)
    assert _unchanged(before, _snapshot(fresh_model, fresh_opt)), "a refused load changed the model or optimizer"
    assert {k: target[k] for k in slots} == slots, "a refused load filled the slots"


def test_optimizer_state_reshards_onto_current_placements(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh,
                                                         shared_dir: str) -> None:
    """Saved under Colwise/Rowwise on a 1-D mesh, loaded into a replicated model on a 2-D mesh:
    every moment equals the saved one as a complete array and has its parameter's placements;
    step counts and hyperparameters come back; the load returns its target. Over the array
    backends the two meshes' device types differ too: saved from NumPy, resumed on CuPy and back."""
    path = os.path.join(shared_dir, "optim.h5")
    model, opt = _training_state(mesh1d, 0)
    dt.save({"model": model, "optim": opt}, path)
    saved = [{k: v.to_torch().copy() if isinstance(v, dt.DTensor) else v for k, v in s.items()}
             for s in opt.state.values()]
    other, other_opt = _training_state(mesh2d, 5, lr=0.5, sharded=False)
    target = {"model": other, "optim": other_opt}
    assert dt.load(path, target) is target
    assert other_opt.param_groups[0]["betas"] == (0.8, 0.9) and other_opt.param_groups[0]["lr"] == 0.01
    for p, want in zip(other.parameters(), saved):
        got = other_opt.state[p]
        assert got["step"] == want["step"] == 2 and type(got["step"]) is int
        for name in ("exp_avg", "exp_avg_sq"):
            assert got[name].placements == p.placements and got[name].device_mesh == mesh2d
            assert np.array_equal(to_numpy(got[name].to_torch()), to_numpy(want[name]))
    for a, b in zip(model.parameters(), other.parameters()):
        assert np.array_equal(to_numpy(a.to_torch()), to_numpy(b.to_torch()))


_WITHOUT = """
import os, sys, tempfile
for name in sys.argv[1:]:
    sys.modules[name] = None  # as if it were not installed
import numpy as np
import dtorch_mpi as dt
mesh = dt.init_device_mesh("cpu", (1,))
assert dt.ones(3, device_mesh=mesh).to_torch().sum() == 3
try:
    dt.save({"w": np.zeros(2)}, os.path.join(tempfile.mkdtemp(), "unused.h5"))
except dt.CheckpointError as exc:
    print("save:", exc)
"""


@pytest.mark.rank_independent  # launches its own process
@pytest.mark.parametrize("missing, needs", [(["h5py", "xxhash"], "need h5py"), (["xxhash"], "need xxhash")])
def test_the_package_imports_and_computes_without_the_checkpoint_extras(missing: list[str], needs: str) -> None:
    """h5py and xxhash come with the hdf5 extra: importing dtorch_mpi and computing need
    neither; a checkpoint call without them is a CheckpointError naming the package."""
    proc = run([sys.executable, "-c", _WITHOUT, *missing], timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"save: checkpoints {needs}" in proc.stdout, proc.stdout + proc.stderr


# ---- what decides how a value is restored is verified (issue 23 item 2) ----

RETYPED = {  # edit -> what it changes about how the file's values come back
    "list_to_tuple": lambda f: f["seq"].attrs.__setitem__("pytype", np.bytes_("tuple[float]")),
    "str_to_bools": lambda f: f["name"].attrs.__setitem__("pytype", np.bytes_("list[bool]")),
    "tensor_to_scalar": lambda f: f["w"].attrs.__setitem__("pytype", np.bytes_("list[float]")),
    "scalar_to_tensor": lambda f: f["seq"].attrs.__delitem__("pytype"),
    "group_list_to_tuple": lambda f: f["mixed"].attrs.__setitem__("pytype", np.bytes_("tuple")),
    "pytype_variable_length": lambda f: f["seq"].attrs.__setitem__("pytype", "list[float]"),  # h5py's str
    "group_list_to_mapping": lambda f: f["mixed"].attrs.__delitem__("pytype"),
    "extra_dataset": lambda f: f.copy(f["seq"], "seq2"),
    "layout_flipped": lambda f: f.attrs.__setitem__("layout", np.uint64(int(f.attrs["layout"]) ^ 1)),
    "layout_missing": lambda f: f.attrs.__delitem__("layout"),
    "version_2_with_layout": lambda f: f.attrs.__setitem__("version", 2),
}


@AGREEMENT_AT_TWO
@pytest.mark.parametrize("edit", sorted(RETYPED))
def test_a_changed_pytype_or_layout_is_refused(edit: str, mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    """The ``pytype`` attributes (and the names, dtypes and shapes) are covered by the root's
    ``layout`` digest: any change is a CheckpointError on every rank, and nothing changes."""
    path = os.path.join(shared_dir, "retyped.h5")
    w = dt.distribute_tensor(full_value((N_ROWS,), 0), mesh1d, [dt.Shard(0)])
    dt.save({"w": w, "seq": [1.0, 2.0], "name": "ab", "mixed": [1, "a"]}, path)
    if RANK == 0:
        with h5py.File(path, "r+") as f:
            RETYPED[edit](f)
    WORLD.Barrier()
    target: dict[str, Any] = {"w": dt.zeros(N_ROWS, device_mesh=mesh1d), "seq": None, "name": None, "mixed": None}
    pattern = {"layout_missing": "lacks the attribute 'layout'", "pytype_variable_length": "variable-length string",
               "version_2_with_layout": "a version-2 file with a 'layout' attribute"}.get(edit, "differ from what was saved")
    for strict in (True, False):
        with pytest.raises(dt.CheckpointError, match=pattern):
            dt.load(path, target, strict=strict)
        assert not target["w"].to_local().any() and target["seq"] is None and target["mixed"] is None


def test_version_2_files_still_load(mesh1d: dt.DeviceMesh, shared_dir: str, check: Checker) -> None:
    """A file of the previous format (no ``layout`` digest, variable-length strings) loads as before."""
    path = os.path.join(shared_dir, "v2.h5")
    full = full_value((N_ROWS, 3), 0)
    dt.save({"w": dt.distribute_tensor(full, mesh1d, [dt.Shard(0)]), "step": 3}, path)
    if RANK == 0:
        with h5py.File(path, "r+") as f:
            del f.attrs["layout"]
            f.attrs["version"] = 2
            for obj in [f, *(f[name] for name in f)]:  # version 2 wrote str attributes variable-length
                for name in ("format", "dtype", "pytype"):
                    if name in obj.attrs:
                        obj.attrs[name] = obj.attrs[name].decode()
    WORLD.Barrier()
    target: dict[str, Any] = {"w": dt.zeros(N_ROWS, 3, dtype=np.float64, device_mesh=mesh1d), "step": 0}
    dt.load(path, target)
    check.equal(target["w"].full_tensor(), full, "a version-2 file's tensor")
    check.true(target["step"] == 3, f"a version-2 file's scalar: {target['step']!r}")
    check.done()


@pytest.mark.parametrize("stored", ["float", "list", "group", "tensor_for_optimizer"])
def test_a_kind_mismatch_is_refused_whatever_strict(stored: str, mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    """A tensor target whose key holds a Python value or a group (``dt.save({"w": 1.5}, p)``),
    or an optimizer whose key holds a tensor: CheckpointError on every rank, strict or not, and
    the target keeps its values (before: the key was skipped and the load "succeeded")."""
    path = os.path.join(shared_dir, "kinds.h5")
    saved = {"float": 1.5, "list": [1.0, 2.0], "group": {"a": np.zeros(2)},
             "tensor_for_optimizer": dt.zeros(N_ROWS, device_mesh=mesh1d)}[stored]
    dt.save({"w": saved}, path)
    model, opt = _training_state(mesh1d, 1)
    before = _snapshot(model, opt)
    w = dt.full((N_ROWS,), 2.0, device_mesh=mesh1d)
    target: Any = {"w": opt} if stored == "tensor_for_optimizer" else {"w": w}
    what = {"float": "a Python float", "list": "a Python list.float.", "group": "a mapping group",
            "tensor_for_optimizer": "a tensor dataset"}[stored]
    for strict in (True, False):
        with pytest.raises(dt.CheckpointError, match=f"'w' is {what} .*nothing was loaded"):
            dt.load(path, target, strict=strict)
    assert np.all(w.to_local() == 2.0) and _unchanged(before, _snapshot(model, opt)), "a refused load changed it"


# ---- training state: restored whole or refused (issue 23 item 3, the checkpoint side) ----

def test_loading_into_an_optimizer_state_dict_is_refused(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    """``dt.load(path, {"optim": opt.state_dict()})`` used to replace the moments (the live
    tensors) but not the step counts or hyperparameters (copies): now refused, naming the fix,
    with nothing changed; loading into the Optimizer restores all of it."""
    path = os.path.join(shared_dir, "optim_sd.h5")
    model, opt = _training_state(mesh1d, 0, lr=0.01)
    dt.save({"optim": opt}, path)
    other_model, other = _training_state(mesh1d, 1, lr=0.5)
    for _ in range(2):  # a different step count, so a half restore would show
        other.step()
    before = _snapshot(other_model, other)
    with pytest.raises(dt.CheckpointError, match=r"'optim' is an optimizer's state_dict\(\).*pass the Optimizer"):
        dt.load(path, {"optim": other.state_dict()})
    assert _unchanged(before, _snapshot(other_model, other)), "a refused load changed the optimizer"
    slot: dict[str, Any] = {"optim": None}  # the other documented way: a slot, then the optimizer's own load
    dt.load(path, slot)
    other.load_state_dict(slot["optim"])
    dt.load(path, {"optim": other})
    assert _snapshot(other_model, other)[1:] == _snapshot(model, opt)[1:], "steps and hyperparameters restored"


class _Checked(dt.optim.AdamW):
    """An optimizer whose checked load refuses a negative step on rank 0 only (a verdict that
    differs between ranks: the load must still raise on every rank)."""

    def prepare_load(self, state_dict: Any) -> Any:
        if RANK == 0 and any(s.get("step", 0) < 0 for s in state_dict["state"].values()):
            raise ValueError("step must be a non-negative int")
        return super().prepare_load(state_dict)


def test_the_optimizers_checked_load_decides_before_anything_changes(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    """dt.load routes optimizer state through the optimizer's own prepare_load: its refusal
    (here on rank 0 only) is a CheckpointError on every rank, and neither the model, the
    optimizer nor a slot changed."""
    path = os.path.join(shared_dir, "steps.h5")
    model, opt = _training_state(mesh1d, 0)
    sd = opt.state_dict()
    sd["state"][0]["step"] = -1
    dt.save({"model": model, "optim": sd, "epoch": 3}, path)
    dt.manual_seed(1)
    fresh = _TwoLayer(mesh1d, True)
    checked = _Checked(fresh.parameters(), lr=0.5)
    before = _snapshot(fresh, checked)
    target: dict[str, Any] = {"model": fresh, "optim": checked, "epoch": 0}
    with pytest.raises(dt.CheckpointError, match=r"optimizer state at 'optim' is malformed.*non-negative"):
        dt.load(path, target)
    assert _unchanged(before, _snapshot(fresh, checked)) and target["epoch"] == 0, "a refused load changed the target"


@pytest.mark.parametrize("where", ["every rank", "rank 0", "the last rank"])
def test_a_missing_xxhash_raises_on_every_rank(where: str, mesh1d: dt.DeviceMesh, shared_dir: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 23 item 5: without xxhash on some ranks (here with a 1-element tensor, so the other
    ranks hash nothing), save and load raise CheckpointError on every rank, before any
    collective that depends on hashing (before: rank 0 raised alone and MPICH aborted)."""
    path = os.path.join(shared_dir, "hasher.h5")
    state_dict = {"w": dt.distribute_tensor(np.arange(1.0), mesh1d, [dt.Shard(0)]), "step": 1}
    dt.save(state_dict, path)
    if where == "every rank" or {"rank 0": 0, "the last rank": SIZE - 1}.get(where) == RANK:
        monkeypatch.setitem(sys.modules, "xxhash", None)  # as if it were not installed
    with pytest.raises(dt.CheckpointError, match="checkpoints need xxhash"):
        dt.save(state_dict, os.path.join(shared_dir, "other.h5"))
    target: dict[str, Any] = {"w": dt.zeros(1, device_mesh=mesh1d), "step": 0}
    for staging in ("all", "chunks"):
        with pytest.raises(dt.CheckpointError, match="checkpoints need xxhash"):
            dt.load(path, target, staging=staging)
    assert not target["w"].to_local().any() and target["step"] == 0
    monkeypatch.undo()
    WORLD.Barrier()
    assert not os.path.exists(os.path.join(shared_dir, "other.h5"))


def test_a_directory_missing_on_some_ranks_names_them(mesh1d: dt.DeviceMesh, shared_dir: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On a cluster a node-local directory (/tmp) exists on some ranks only: the save refuses on
    every rank, naming the ranks that lack it (why the examples default to the working directory)."""
    if RANK > 0:  # as if shared_dir were node-local to rank 0
        real = os.path.isdir
        monkeypatch.setattr(os.path, "isdir", lambda p: False if p == shared_dir else real(p))
    ranks = ", ".join(map(str, range(1, SIZE)))
    pattern = f"directory {shared_dir} does not exist" + (rf" \[on ranks? {ranks}\]" if SIZE > 1 else "")
    with pytest.raises(dt.CheckpointError, match=pattern) if SIZE > 1 else contextlib.nullcontext():
        dt.save({"w": dt.zeros(2, device_mesh=mesh1d)}, os.path.join(shared_dir, "x.h5"))
