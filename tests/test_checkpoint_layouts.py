"""Checkpoints across layouts on sub-meshes: every (save layout, load layout) pair, where the
layouts are placements on a whole mesh and on each of its 1-D sub-meshes (``mesh["tp"]`` on
each dp row: disjoint copies of one tensor), on 2x2 and 2x1x2 meshes at 4 ranks (their
analogues at 1-3). The copies write each element once and read it once each, on both
checks (xxh3 where written pieces tile the regions read, by their table or, without one, by the
sum of their seeded digests; lin64 elsewhere) and both stagings."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import SIZE, Checker

import dtorch_mpi as dt
from dtorch_mpi.checkpoint import pieces, reader

# as test_checkpoint: the save's and load's own exchanges are plain MPI Allreduce/Allgather(v);
# the path-dependent calls here are a Partial's reduce-scatter before saving and the checks'
# full_tensor() gathers along each mesh dim, redistributes tested on every path by
# test_redistribute (every pair, uneven, on 1-D and 2-D meshes) and test_mpi_trace
pytestmark = pytest.mark.path_independent

ONE_D = [[dt.Shard(0)], [dt.Shard(1)], [dt.Replicate()], [dt.Partial("sum")]]
MESH_SHAPES = {4: [(2, 2), (2, 1, 2)], 3: [(3, 1), (1, 1, 3)], 2: [(2, 1), (1, 2, 1)], 1: [(1, 1)]}
SHAPES = [(3, 5), (0, 2)]  # uneven over 2 and 3 ranks (and 1 row for some), and empty


def layouts(mesh: dt.DeviceMesh) -> list[tuple[str, dt.DeviceMesh, list[dt.Placement]]]:
    """(name, mesh, placements): each 1-D layout on each sub-mesh, and a few on the whole mesh."""
    names = mesh.mesh_dim_names or ()
    out = [(f"{name}:{plc[0]}", mesh[name], plc) for name in names for plc in ONE_D]
    whole = [dt.Shard(0), *[dt.Replicate()] * (mesh.ndim - 2), dt.Shard(1)]
    mixed = [dt.Partial("sum"), *[dt.Shard(1)] * (mesh.ndim - 2), dt.Shard(0)]
    return out + [(f"mesh:{plc}", mesh, plc) for plc in (whole, mixed)]


def make_pieces(full: np.ndarray, mesh: dt.DeviceMesh, placements: list[dt.Placement]) -> np.ndarray:
    """This rank's piece; a Partial("sum") dim holds terms that differ per coordinate and add up."""
    shape, off = dt.compute_local_shape_and_offset(full.shape, mesh, placements)
    piece = full[tuple(slice(o, o + n) for o, n in zip(off, shape))].copy()
    coord = mesh.get_coordinate()
    for k, p in enumerate(placements):
        if isinstance(p, dt.Partial):  # only "sum" here
            piece = piece - sum(range(1, mesh.shape[k])) if coord[k] == 0 else np.full_like(piece, coord[k])
    return piece


def value(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-9, 9, size=shape).astype(np.float64)


CASES = [(staging, shape, "tables") for staging in ("all", "chunks") for shape in SHAPES] + [
    (staging, SHAPES[0], "sums") for staging in ("all", "chunks")]


@pytest.mark.parametrize("staging, shape, fast", CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_every_layout_pair_on_sub_meshes(staging: str, shape: tuple[int, ...], fast: str, shared_dir: str,
                                         check: Checker, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fast="sums"``: no piece table is kept (as above ~800 pieces), so the fast check is the
    sum of the pieces' seeded digests over the ranks (pieces.py), which counts every copy read."""
    if fast == "sums":
        monkeypatch.setattr(pieces, "MAX_TABLE_BYTES", 0)
    world = dt.init_device_mesh("cpu", (SIZE,))
    seen: set[str] = set()
    for mesh_shape in MESH_SHAPES[SIZE]:
        names = ("dp", "tp") if len(mesh_shape) == 2 else ("dp", "pp", "tp")
        with dt.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names) as mesh:
            cases = [*layouts(mesh), ("world:Shard(0)", world, [dt.Shard(0)])]
            fulls = {f"k{i}": value(shape, i) for i in range(len(cases))}
            saved = {f"k{i}": dt.DTensor.from_local(make_pieces(fulls[f"k{i}"], m, plc), m, plc, shape=shape)
                     for i, (_, m, plc) in enumerate(cases)}
            path = os.path.join(shared_dir, f"{'x'.join(map(str, mesh_shape))}.h5")
            dt.save(saved, path)  # every save layout at once: one key each
            for name, m, plc in cases:  # loaded into every layout
                target = {k: dt.zeros(*shape, dtype=np.float64, device_mesh=m, placements=plc) for k in fulls}
                try:
                    dt.load(path, target, staging=staging)
                except dt.CheckpointError as exc:
                    check.true(False, f"{mesh_shape} load into {name}: {exc}")
                    continue
                seen.update(reader.VERIFIED.values())
                for k, t in target.items():
                    check.equal(t.full_tensor(), fulls[k], f"{mesh_shape} {cases[int(k[1:])][0]} -> {name}")
    world.free()
    if shape[0] and SIZE > 1:
        want = {"xxh3" if fast == "tables" else "xxh3 sum", "lin64"}
        check.true(seen == want, f"both checks ran (saw {sorted(seen)})")
    check.done()


@pytest.mark.mpi(min_size=4)
def test_the_issue_reproducer_loads(shared_dir: str, check: Checker) -> None:
    """Issue 23 item 1: Shard(0) on the 1-D world mesh, loaded as Shard(1) on mesh2["tp"] and
    mesh2["dp"] (regions no written piece tiles: lin64 over two disjoint sub-meshes)."""
    path = os.path.join(shared_dir, "w.h5")
    full = value((3, 16), 0)
    with dt.init_device_mesh("cpu", (SIZE,)) as world:
        dt.save({"w": dt.distribute_tensor(full, world, [dt.Shard(0)])}, path)
    with dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")) as mesh2:
        for name in ("tp", "dp"):
            t = dt.zeros(3, 16, device_mesh=mesh2[name], placements=[dt.Shard(1)], dtype=np.float64)
            dt.load(path, {"w": t})
            check.true(reader.VERIFIED == {"w": "lin64"}, f"{name}: verified by {reader.VERIFIED}")
            check.equal(t.full_tensor(), full, f"Shard(1) on mesh2[{name!r}]")
    check.done()
