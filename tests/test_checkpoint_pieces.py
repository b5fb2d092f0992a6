"""The checkpoint's fast check (pieces.py): a load whose every read region is tiled by pieces the
save wrote verifies with those pieces' xxh3, any other load with lin64; both load NumPy-identical
values, both catch a flipped byte with nothing changed, and a damaged or forged piece table is
refused by name or falls back to lin64, never passing damaged data. Runs on both HDF5 stacks."""

from __future__ import annotations

import os
import tracemalloc
from typing import Any

import h5py
import numpy as np
import pytest
import xxhash
from conftest import RANK, SIZE, Checker
from helpers import full_value, make_pieces, patch_bytes
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.checkpoint import reader

# as test_checkpoint.py: the piece tables travel in a plain MPI Allgatherv
pytestmark = pytest.mark.path_independent

WORLD = MPI.COMM_WORLD
LAYOUTS_1D: list[list[dt.Placement]] = [[dt.Shard(0)], [dt.Shard(1)], [dt.Replicate()]]
LAYOUTS_2D: list[list[dt.Placement]] = [[dt.Shard(0), dt.Shard(1)], [dt.Replicate(), dt.Shard(0)],
                                        [dt.Shard(1), dt.Replicate()], [dt.Shard(0), dt.Shard(0)]]
STAGINGS = ["all", "chunks"]


def region(t: dt.DTensor, writer: bool) -> tuple[Any, ...] | None:
    """This rank's non-empty region of ``t`` (a writer: only the first replica), else None."""
    coord = t.device_mesh.get_coordinate()
    if coord is None or (writer and any(isinstance(p, dt.Replicate) and coord[k] for k, p in enumerate(t.placements))):
        return None
    shape, offset = dt.compute_local_shape_and_offset(t.shape, t.device_mesh, t.placements)
    return (tuple(offset), tuple(shape)) if all(shape) else None


def expected_kind(saved: dt.DTensor, target: dt.DTensor) -> str:
    """The rule, from every rank's regions: xxh3 when no written piece reaches partly into a
    non-empty region read (the written pieces cover the array once, so they then tile it)."""
    written = {r for r in WORLD.allgather(region(saved, writer=True)) if r is not None}
    read = {r for r in WORLD.allgather(region(target, writer=False)) if r is not None}

    def partly_in(piece: tuple[Any, ...], box: tuple[Any, ...]) -> bool:
        (po, ps), (bo, bs) = piece, box
        overlaps = all(p < b + n and b < p + m for p, m, b, n in zip(po, ps, bo, bs))
        inside = all(b <= p and p + m <= b + n for p, m, b, n in zip(po, ps, bo, bs))
        return overlaps and not inside

    tiled = all(not partly_in(w, r) for w in written for r in read)
    return "xxh3" if written and tiled else "lin64"


def sharded(full: np.ndarray, mesh: dt.DeviceMesh, plc: list[dt.Placement]) -> dt.DTensor:
    return dt.DTensor.from_local(make_pieces(full, mesh, plc), mesh, plc, shape=full.shape)


@pytest.mark.parametrize("staging", STAGINGS)
def test_tiled_regions_take_xxh3_and_any_other_lin64(staging: str, mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh,
                                                      shared_dir: str, check: Checker) -> None:
    """Every saved layout loaded into every layout of the same mesh: values equal NumPy's, and
    the check each dataset took is the rule's (non-empty and the same layout or a replicated
    target: xxh3)."""
    path = os.path.join(shared_dir, "ck.h5")
    for mesh, layouts in ((mesh1d, LAYOUTS_1D), (mesh2d, LAYOUTS_2D)):
        for shape in ((0, 3), (1, 4), (SIZE + 1, 5), (2 * SIZE + 1, 3), (7, 2 * SIZE - 1)):
            fulls = {f"t{i}": full_value(shape, i) for i in range(len(layouts))}
            saved = {k: sharded(fulls[k], mesh, plc) for k, plc in zip(fulls, layouts)}
            dt.save(saved, path)
            for plc in layouts:
                tgt = {k: dt.zeros(*shape, dtype=np.float64, device_mesh=mesh, placements=plc) for k in fulls}
                dt.load(path, tgt, staging=staging)
                for k, v in tgt.items():
                    what = f"{shape} {list(saved[k].placements)} -> {plc}"
                    check.equal(v.to_torch(), fulls[k], what)
                    want = expected_kind(saved[k], v)
                    check.true(reader.VERIFIED[k] == want, f"{what}: verified by {reader.VERIFIED[k]}, expected {want}")
                    if (list(saved[k].placements) == plc or all(p.is_replicate() for p in plc)) and all(shape):
                        check.true(want == "xxh3", f"{what}: the same layout and a replicated one take the fast check")
    check.done()


def test_replicate_target_of_a_one_piece_save_is_exact(mesh1d: dt.DeviceMesh, shared_dir: str, check: Checker) -> None:
    """A dataset written as one piece (a Replicate tensor) read whole by every rank: xxh3."""
    path = os.path.join(shared_dir, "rep.h5")
    full = full_value((5, 3), 3)
    dt.save({"w": sharded(full, mesh1d, [dt.Replicate()])}, path)
    tgt = {"w": dt.zeros(5, 3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Replicate()])}
    dt.load(path, tgt)
    check.equal(tgt["w"].to_torch(), full, "Replicate -> Replicate")
    check.true(reader.VERIFIED == {"w": "xxh3"}, f"verified by {reader.VERIFIED}")
    check.done()


def _flip(path: str, name: str, at: int) -> None:
    patch_bytes(path, name, lambda b: b.__setitem__(at, b[at] ^ 0x40))


@pytest.mark.parametrize("staging", STAGINGS)
@pytest.mark.parametrize("target", ["same", "other", "replicated"])
def test_a_flipped_byte_fails_on_either_check_and_changes_nothing(target: str, staging: str, mesh1d: dt.DeviceMesh,
                                                                   shared_dir: str) -> None:
    shape = (2 * SIZE + 1, 3)
    path = os.path.join(shared_dir, "flip.h5")
    dt.save({"w": sharded(full_value(shape, 0), mesh1d, [dt.Shard(0)])}, path)
    if RANK == 0:
        _flip(path, "w", 8 * shape[1] * (shape[0] - 1) + 5)  # in the last rank's piece
    WORLD.Barrier()
    plc = {"same": [dt.Shard(0)], "other": [dt.Shard(1)], "replicated": [dt.Replicate()]}[target]
    tgt = dt.zeros(*shape, dtype=np.float64, device_mesh=mesh1d, placements=plc)
    kept = tgt.to_local()
    with pytest.raises(dt.CheckpointError, match="checksum mismatch in dataset /w"):
        dt.load(path, {"w": tgt}, staging=staging)
    assert tgt.to_local() is kept and not kept.any(), "a failed load changed the target"
    want = "lin64" if target == "other" and SIZE > 1 else "xxh3"
    assert list(reader.VERIFIED.items()) == [("w", want)], reader.VERIFIED


def _tables(path: str, edit: Any) -> None:
    """Rank 0 rewrites dataset /w with its piece table replaced by ``edit(table, dataset)`` (None:
    no table); the dataset is recreated so that its header takes an attribute over 64 KiB."""
    try:
        if RANK == 0:
            with h5py.File(path, "r+", libver="latest") as f:
                attrs, data = dict(f["w"].attrs), f["w"][()]
                new = edit(np.array(attrs.pop("pieces")), f["w"])
                del f["w"]
                f["w"] = data
                f["w"].attrs.update(attrs)
                if new is not None and new.dtype == object:  # variable-length rows
                    f["w"].attrs.create("pieces", new, dtype=h5py.vlen_dtype(np.uint64))
                elif new is not None:
                    f["w"].attrs["pieces"] = new
    finally:
        WORLD.Barrier()


def _ragged(rows: int) -> np.ndarray:
    table = np.empty(rows, dtype=object)
    table[:] = [np.arange(1000, dtype=np.uint64)] * rows
    return table


def _shifted(t: np.ndarray, ds: Any) -> np.ndarray:
    t = t.copy()
    t[0, 0] = ds.shape[0]  # offset at the end, shape >= 1: outside
    return t


FORGED = {  # kind -> (edit of the table, the error it must raise, or None: loads with lin64)
    "float_table": (lambda t, ds: t.astype(np.float64), "'pieces' .the piece table. must be a uint64 array, got float64"),
    "scalar_table": (lambda t, ds: np.uint64(5), "'pieces' .the piece table. must be a uint64 array, got a uint64 scalar"),
    "int8_table": (lambda t, ds: t.astype(np.int8), "must be a uint64 array, got int8"),
    "wrong_columns": (lambda t, ds: t[:, 1:], r"has shape \(\d+, 4\); a 2-d dataset needs \(pieces >= 1, 5\)"),
    "one_d_table": (lambda t, ds: t.ravel(), r"has shape \(\d+,\); a 2-d dataset needs"),
    "offset_out_of_range": (_shifted, r"piece 0 \(offset \[\d+, 0\], shape \[\d+, 3\]\) is empty or outside"),
    "huge_offset": (lambda t, ds: np.vstack([t, np.array([[2**64 - 1, 0, 2, 3, 0]], np.uint64)]), "is empty or outside"),
    "empty_piece": (lambda t, ds: np.vstack([t, np.array([[0, 0, 0, 3, 0]], np.uint64)]), "is empty or outside"),
    "region_twice": (lambda t, ds: np.vstack([t, t[:1]]), "lists a region twice"),
    "too_many_rows": (lambda t, ds: np.zeros((2000, 5), np.uint64),
                      r"attribute 'pieces' of /w holds 80000 bytes \(limit 65536\)"),
    "other_digest": (lambda t, ds: np.column_stack([t[:, :-1], t[:, -1] ^ np.uint64(1)]),
                     "checksum mismatch in dataset /w"),
    "missing": (lambda t, ds: None, None),
    "other_split": (lambda t, ds: np.array([[0, 0, 1, 3, 0]], np.uint64) if ds.shape[0] > 1 else None, None),
}


@pytest.mark.parametrize("kind", sorted(FORGED))
def test_forged_piece_tables_are_refused_or_fall_back(kind: str, mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    """A damaged table is a CheckpointError naming the dataset (nothing changed), or — where it
    no longer covers the regions read — lin64, which still loads the right values."""
    shape = (2 * SIZE + 1, 3)
    full = full_value(shape, 1)
    path = os.path.join(shared_dir, "forged.h5")
    dt.save({"w": sharded(full, mesh1d, [dt.Shard(0)])}, path)
    edit, error = FORGED[kind]
    _tables(path, edit)
    tgt = dt.zeros(*shape, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)])
    if error is not None:
        with pytest.raises(dt.CheckpointError, match=error):
            dt.load(path, {"w": tgt})
        assert not tgt.to_local().any(), "a refused load changed the target"
        return
    dt.load(path, {"w": tgt})
    assert list(reader.VERIFIED.items()) == [("w", "lin64")], reader.VERIFIED
    assert np.array_equal(tgt.to_torch(), full)
    if RANK == 0:  # and with a flipped byte, lin64 catches it
        _flip(path, "w", 3)
    WORLD.Barrier()
    with pytest.raises(dt.CheckpointError, match="checksum mismatch in dataset /w"):
        dt.load(path, {"w": dt.zeros(*shape, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)])})


def test_a_variable_length_table_is_refused_before_it_is_read(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    """A variable-length row costs 16 bytes of attribute storage whatever it holds, so the size
    bound does not cover it: 4000 rows of 8 KB (32 MB in the file behind a 64 KB attribute) are
    refused by their stored type, before anything is read."""
    shape = (2 * SIZE + 1, 3)
    path = os.path.join(shared_dir, "ragged.h5")
    dt.save({"w": sharded(full_value(shape, 1), mesh1d, [dt.Shard(0)])}, path)
    _tables(path, lambda t, ds: _ragged(4000))
    tgt = dt.zeros(*shape, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)])
    tracemalloc.start()
    try:
        with pytest.raises(dt.CheckpointError, match="must be a uint64 array, got object"):
            dt.load(path, {"w": tgt})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 << 10, f"the refused table was read first ({peak} bytes traced; ~15 KB when refused by type)"
    assert not tgt.to_local().any()


def test_the_table_records_what_each_rank_wrote(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    """One row per non-empty written piece: its offset, shape and the xxh3 of its little-endian
    bytes (a big-endian tensor too); a zero-size dataset carries no table."""
    path = os.path.join(shared_dir, "table.h5")
    full = full_value((SIZE + 1, 2), 2).astype(">f8")
    saved = sharded(full, mesh1d, [dt.Shard(0)])
    dt.save({"w": saved, "e": sharded(np.zeros((0, 3)), mesh1d, [dt.Shard(0)])}, path)
    mine = region(saved, writer=True)
    row = None if mine is None else (*mine[0], *mine[1], xxhash.xxh3_64_intdigest(saved.to_local().astype("<f8").tobytes()))
    want = sorted(r for r in WORLD.allgather(row) if r is not None)
    if RANK == 0:
        with h5py.File(path, "r") as f:
            assert f["w"].attrs["pieces"].dtype == np.uint64
            got = sorted(tuple(int(v) for v in r) for r in f["w"].attrs["pieces"])
            assert "pieces" not in f["e"].attrs
        assert got == want, (got, want)


def test_files_without_tables_load_with_lin64(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, shared_dir: str,
                                              check: Checker) -> None:
    """Checkpoints written before the tables (no 'pieces' attribute anywhere) load as before."""
    path = os.path.join(shared_dir, "old.h5")
    fulls = {f"t{i}": full_value((SIZE + 2, 3), i) for i in range(len(LAYOUTS_1D))}
    dt.save({k: sharded(fulls[k], mesh1d, plc) for k, plc in zip(fulls, LAYOUTS_1D)} | {"step": 3}, path)
    if RANK == 0:
        with h5py.File(path, "r+") as f:
            for k in [*fulls, "step"]:
                del f[k].attrs["pieces"]
    WORLD.Barrier()
    for mesh, plc in ((mesh1d, [dt.Shard(0)]), (mesh2d, [dt.Shard(1), dt.Replicate()])):
        tgt: dict[str, Any] = {k: dt.zeros(SIZE + 2, 3, dtype=np.float64, device_mesh=mesh, placements=plc) for k in fulls}
        tgt["step"] = 0
        dt.load(path, tgt)
        check.true(tgt["step"] == 3, "the scalar slot")
        for k in fulls:
            check.equal(tgt[k].to_torch(), fulls[k], f"{k} -> {plc}")
        check.true(set(reader.VERIFIED.values()) == {"lin64"}, f"verified by {reader.VERIFIED}")
    check.done()


def test_a_table_over_the_limit_is_not_written(mesh1d: dt.DeviceMesh, shared_dir: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A table over pieces.MAX_TABLE_BYTES (here: under one 40-byte row) is left out: the fast
    check is then the sum of the pieces' seeded digests (``xxsum``), and without it lin64."""
    from dtorch_mpi.checkpoint import pieces

    monkeypatch.setattr(pieces, "MAX_TABLE_BYTES", 39)
    path = os.path.join(shared_dir, "limit.h5")
    full = full_value((SIZE + 1, 3), 4)
    dt.save({"w": sharded(full, mesh1d, [dt.Shard(0)])}, path)
    if RANK == 0:
        with h5py.File(path, "r") as f:
            assert "pieces" not in f["w"].attrs and "xxsum" in f["w"].attrs
    tgt = dt.zeros(SIZE + 1, 3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)])
    dt.load(path, {"w": tgt})
    assert list(reader.VERIFIED.items()) == [("w", "xxh3 sum")], reader.VERIFIED
    assert np.array_equal(tgt.to_torch(), full)
    WORLD.Barrier()
    if RANK == 0:
        with h5py.File(path, "r+") as f:
            del f["w"].attrs["xxsum"]  # as written before the sum check
    WORLD.Barrier()
    dt.load(path, {"w": tgt})
    assert list(reader.VERIFIED.items()) == [("w", "lin64")], reader.VERIFIED
    assert np.array_equal(tgt.to_torch(), full)


def test_kept_and_left_out_tables_in_one_save(mesh1d: dt.DeviceMesh, shared_dir: str, check: Checker,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """One save whose tables are kept for some datasets and left out for others (the limit at one
    2-d row): each kept table holds every writer's ``[offset, shape, xxh3]`` in rank order (the
    Allgatherv rows land in their own datasets), a left-out one is absent, and the same-layout
    load takes xxh3 exactly where a table was kept, and the sum of seeded digests where one was
    left out (lin64 for the empty dataset: nothing to sum)."""
    from dtorch_mpi.checkpoint import pieces

    monkeypatch.setattr(pieces, "MAX_TABLE_BYTES", 40)
    path = os.path.join(shared_dir, "mixed.h5")
    layouts = {"a": ((2 * SIZE + 1, 3), [dt.Shard(0)]), "b": ((5, 3), [dt.Replicate()]),
               "c": ((2, SIZE + 2, 2), [dt.Shard(1)]), "e": ((0, 3), [dt.Shard(0)]), "f": ((SIZE - 1, 2), [dt.Shard(0)])}
    fulls = {k: full_value(shape, i) for i, (k, (shape, _)) in enumerate(layouts.items())}
    saved = {k: sharded(fulls[k], mesh1d, plc) for k, (_, plc) in layouts.items()}
    whole = np.arange(4.0)
    dt.save({**saved, "n": whole}, path)
    written = {k: [r for r in WORLD.allgather(region(t, writer=True)) if r is not None] for k, t in saved.items()}
    written["n"] = [((0,), (4,))]
    values = {**fulls, "n": whole}
    if RANK == 0:
        with h5py.File(path, "r") as f:
            for k, rows in written.items():
                ndim = values[k].ndim
                keep = bool(rows) and len(rows) * (2 * ndim + 1) * 8 <= 40
                check.true(("pieces" in f[k].attrs) == keep, f"{k}: table kept {keep}")
                if keep:
                    want = np.array([[*o, *n, xxhash.xxh3_64_intdigest(np.ascontiguousarray(
                        values[k][tuple(slice(a, a + m) for a, m in zip(o, n))]).tobytes())] for o, n in rows],
                        dtype=np.uint64)
                    check.equal(f[k].attrs["pieces"], want, f"{k}: the table's rows")
    tgt = {k: dt.zeros(*shape, dtype=np.float64, device_mesh=mesh1d, placements=plc) for k, (shape, plc) in layouts.items()}
    dt.load(path, {**tgt, "n": np.zeros(4)})
    for k, t in tgt.items():
        check.equal(t.to_torch(), fulls[k], k)
        rows = written[k]
        want = "xxh3" if rows and len(rows) * (2 * t.ndim + 1) * 8 <= 40 else "xxh3 sum" if t.numel() else "lin64"
        check.true(reader.VERIFIED[k] == want, f"{k}: verified by {reader.VERIFIED[k]}, expected {want}")
    check.done()


def test_a_forged_overlapping_piece_never_tiles_a_region(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    """An extra row overlapping the written pieces: a replicated read (whose region the pieces
    would tile) falls back to lin64; a region that is exactly one recorded piece keeps its xxh3
    (that piece's digest covers every byte of it). Values are right either way."""
    shape = (2 * SIZE + 1, 3)
    full = full_value(shape, 5)
    path = os.path.join(shared_dir, "overlap.h5")
    dt.save({"w": sharded(full, mesh1d, [dt.Shard(0)])}, path)
    _tables(path, lambda t, ds: np.vstack([t, np.array([[0, 0, 1, 3, 0]], np.uint64)]))
    for plc, want in (([dt.Replicate()], "lin64" if SIZE > 1 else "xxh3"), ([dt.Shard(0)], "xxh3")):
        tgt = dt.zeros(*shape, dtype=np.float64, device_mesh=mesh1d, placements=plc)
        dt.load(path, {"w": tgt})
        assert list(reader.VERIFIED.items()) == [("w", want)], (plc, reader.VERIFIED)
        assert np.array_equal(tgt.to_torch(), full), plc


def _table(rows: list[list[int]]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64)


def test_tiling_takes_only_exact_tilings() -> None:
    """pieces.tiling: the pieces inside a region that cover it once (offsets relative to it);
    None for a piece reaching partly in, overlaps or gaps, and no table; () for an empty region."""
    from dtorch_mpi.checkpoint.pieces import tiling

    rows = _table([[0, 0, 2, 6, 11], [2, 0, 2, 6, 22]])  # a (4, 6) dataset in two row blocks
    assert tiling(rows, (0, 0), (4, 6)) == (((0, 0), (2, 6), 11), ((2, 0), (2, 6), 22))
    assert tiling(rows, (2, 0), (2, 6)) == (((0, 0), (2, 6), 22),)
    assert tiling(rows, (0, 0), (3, 6)) is None  # the second block reaches partly in
    assert tiling(rows, (0, 0), (4, 3)) is None  # both do
    assert tiling(rows, (1, 0), (0, 6)) == ()
    assert tiling(None, (0, 0), (4, 6)) is None
    overlap_and_gap = _table([[0, 0, 2, 4, 1], [0, 2, 2, 4, 2]])  # same volume as (2, 8), cols 2-4 twice, 6-8 never
    assert tiling(overlap_and_gap, (0, 0), (2, 8)) is None
    assert tiling(_table([[0, 0, 1, 8, 1]]), (0, 0), (2, 8)) is None  # a gap
    assert tiling(_table([[7]]), (), ()) == (((), (), 7),)  # 0-d


@pytest.mark.parametrize("slab", [1 << 20, 8], ids=["whole", "row-slabs"])
def test_tile_digests_match_each_pieces_digest_in_any_chunking(slab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row blocks and strided column blocks of a region, fed whole or in row chunks: each tile's
    digest is the xxh3 of its piece (as the save computed it); one changed element is caught."""
    from dtorch_mpi.checkpoint import pieces
    from dtorch_mpi.checkpoint.checksum import digest

    monkeypatch.setattr(pieces, "SLAB_BYTES", slab)
    full = full_value((5, 7), 2).astype(">f4")  # big-endian: hashed in canonical (little-endian) form
    for cuts in ([(0, 0, 2, 7), (2, 0, 3, 7)], [(0, 0, 5, 3), (0, 3, 5, 4)], [(0, 0, 5, 7)]):
        tiles = tuple(((o0, o1), (n0, n1), digest(full[o0 : o0 + n0, o1 : o1 + n1])) for o0, o1, n0, n1 in cuts)
        for chunk in (5, 2, 1):
            digests = pieces.TileDigests(tiles)
            for row in range(0, 5, chunk):
                digests.update(row, full[row : row + chunk])
            assert not digests.mismatched(), (cuts, chunk)
        damaged = full.copy()
        damaged[4, 6] += 1
        digests = pieces.TileDigests(tiles)
        digests.update(0, damaged)
        assert digests.mismatched(), cuts


def test_strided_tiles_are_hashed_in_small_slabs_in_any_dims(monkeypatch: pytest.MonkeyPatch) -> None:
    """A strided tile of a 3-d region (a Shard(2) piece inside a replicated read) is hashed in
    copies of at most SLAB_BYTES, also when one slice along its first dim is bigger, with the
    digest of the piece."""
    from dtorch_mpi.checkpoint import pieces
    from dtorch_mpi.checkpoint.checksum import digest

    monkeypatch.setattr(pieces, "SLAB_BYTES", 1024)
    full = full_value((2, 64, 64), 4).astype(np.float32)
    tile = full[:, :, 16:48]
    assert max(s.nbytes for s in pieces._slabs(tile)) <= 1024
    digests = pieces.TileDigests((((0, 0, 16), (2, 64, 32), digest(tile)),))
    digests.update(0, full)
    assert not digests.mismatched()


# ---- the sum check: no table (over the limit), the pieces' seeded digests summed over the ranks ----

@pytest.mark.rank_independent
def test_layout_tiling_finds_what_a_table_of_every_written_piece_would() -> None:
    """pieces.layout_tiling, from the written layout and the split rule alone, gives the tiles
    pieces.tiling finds in a table of every written piece (the oracle), for random shapes (0 to
    6 long), meshes of 1-3 dims, nested shards and regions; each tile's seed is its global offset's."""
    import itertools
    import random

    from dtorch_mpi.checkpoint import pieces
    from dtorch_mpi.split import local_shape_and_offset

    rng = random.Random(0)
    for _ in range(400):
        ndim = rng.randint(0, 3)
        shape = tuple(rng.randint(0, 6) for _ in range(ndim))
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        written = tuple(rng.randint(-1, ndim - 1) if ndim else -1 for _ in mesh)
        plc = tuple(dt.Shard(d) if d >= 0 else dt.Replicate() for d in written)
        rows = sorted({(*off, *sh) for coord in itertools.product(*(range(k) for k in mesh))
                       for sh, off in [local_shape_and_offset(shape, mesh, plc, coord)] if np.prod(sh, dtype=int)})
        table = np.array([[*r, 0] for r in rows], dtype=np.uint64).reshape(len(rows), 2 * ndim + 1) if rows else None
        for _ in range(8):
            lo = tuple(rng.randint(0, n) for n in shape)
            size = tuple(rng.randint(0, n - a) for n, a in zip(shape, lo))
            got = pieces.layout_tiling(pieces.Layout(mesh, written), shape, lo, size)
            want = pieces.tiling(table, lo, size) if np.prod(size, dtype=int) else ()
            assert (got is None) == (want is None), (shape, mesh, written, lo, size, got, want)
            if got is not None and want is not None:
                assert sorted(t[:2] for t in got) == sorted(t[:2] for t in want), (shape, mesh, written, lo, size)
                for offset, _, seed in got:
                    assert seed == pieces.seed(tuple(a + b for a, b in zip(offset, lo)))
    assert pieces.layout_tiling(pieces.Layout((4,), (0,)), (8,), (0,), (8,), limit=3) is None  # too many tiles


def _save_without_tables(path: str, value: dict[str, dt.DTensor], monkeypatch: pytest.MonkeyPatch) -> None:
    from dtorch_mpi.checkpoint import pieces

    with monkeypatch.context() as m:
        m.setattr(pieces, "MAX_TABLE_BYTES", 0)
        dt.save(value, path)


@pytest.mark.parametrize("damage", ["swapped", "flipped"])
@pytest.mark.parametrize("staging", STAGINGS)
def test_the_sum_check_catches_swapped_pieces_and_a_flipped_byte(damage: str, staging: str, mesh1d: dt.DeviceMesh,
                                                                 shared_dir: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each piece's digest is seeded with its offset, so two equal pieces' bytes swapped in the
    file change the sum as a flipped byte does: every rank raises, nothing changes."""
    rows = 2 * max(SIZE, 2)
    full = full_value((rows, 3), 6)
    path = os.path.join(shared_dir, "sums.h5")
    _save_without_tables(path, {"w": sharded(full, mesh1d, [dt.Shard(0)])}, monkeypatch)
    tgt = dt.zeros(rows, 3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)])
    dt.load(path, {"w": tgt}, staging=staging)
    assert reader.VERIFIED == {"w": "xxh3 sum"} and np.array_equal(tgt.to_torch(), full), reader.VERIFIED
    WORLD.Barrier()
    if RANK == 0:
        if damage == "swapped":  # rows 0-1 and 2-3: two ranks' pieces (one piece's halves at 1 rank)
            with h5py.File(path, "r+") as f:
                f["w"][:4] = np.concatenate([full[2:4], full[0:2]])
        else:
            _flip(path, "w", 8 * 3 * (rows - 1))
    WORLD.Barrier()
    fresh = dt.zeros(rows, 3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)])
    with pytest.raises(dt.CheckpointError, match="checksum mismatch"):
        dt.load(path, {"w": fresh}, staging=staging)
    assert not fresh.to_local().any(), "a failed load changed the target"


@pytest.mark.max_ranks(2)
@pytest.mark.parametrize("forged", ["xxsum-float", "mesh-float", "lengths", "written-out-of-range", "xxsum-wrong"])
def test_forged_sum_attributes_are_refused_or_fall_back(forged: str, mesh1d: dt.DeviceMesh, shared_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sum check's attributes are untrusted: a wrong type or length is refused by name, a
    written dim the dataset lacks falls back to lin64 (right values), a wrong sum is a mismatch."""
    full = full_value((2 * SIZE + 1, 3), 7)
    path = os.path.join(shared_dir, "forged.h5")
    _save_without_tables(path, {"w": sharded(full, mesh1d, [dt.Shard(0)])}, monkeypatch)
    WORLD.Barrier()
    if RANK == 0:
        with h5py.File(path, "r+") as f:
            attrs = f["w"].attrs
            if forged == "xxsum-float":
                attrs["xxsum"] = 1.5
            elif forged == "mesh-float":
                attrs["mesh_shape"] = np.array([1.0] * len(attrs["mesh_shape"]))
            elif forged == "lengths":  # a 1-d mesh's shape, two written dims
                attrs["written"] = np.array([0, 0], dtype=np.int64)
            elif forged == "written-out-of-range":
                attrs["written"] = np.array([5], dtype=np.int64)
            else:
                attrs["xxsum"] = np.uint64(int(attrs["xxsum"]) ^ 1)
    WORLD.Barrier()
    tgt = dt.zeros(2 * SIZE + 1, 3, dtype=np.float64, device_mesh=mesh1d, placements=[dt.Shard(0)])
    if forged == "written-out-of-range":
        dt.load(path, {"w": tgt})
        assert reader.VERIFIED == {"w": "lin64"} and np.array_equal(tgt.to_torch(), full), reader.VERIFIED
        return
    pattern = {"xxsum-float": "'xxsum' must be a uint64", "mesh-float": "must be an int64 vector",
               "lengths": "lengths", "xxsum-wrong": "checksum mismatch"}[forged]
    with pytest.raises(dt.CheckpointError, match=pattern):
        dt.load(path, {"w": tgt})
    assert not tgt.to_local().any(), "a failed load changed the target"
