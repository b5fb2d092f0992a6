"""redistribute, to_torch and to_torch_async against NumPy on the complete arrays.

The tests taking ``xp_mesh1d``/``xp_mesh2d`` run once per array backend (NumPy, and CuPy
where every rank has a GPU; skipped with one reason elsewhere: conftest.ARRAY_BACKENDS).

Partial sources are built from pieces whose terms really differ between ranks (exact in
integers-valued floats), so every reduction is exercised. Runs under both comm paths
(DTORCH_COMM_PATH=variable|padded) via scripts/run_tests.py.
"""

from __future__ import annotations

import gc
import itertools

import numpy as np
import pytest
from conftest import RANK, SIZE, Checker, lengths_for
from helpers import P1, P2, integer_full, local_of, make_pieces

import dtorch_mpi as dt
from dtorch_mpi.split import split_sizes


def run_pairs(mesh: dt.DeviceMesh, pairs: list[tuple[list, list]], shapes: list[tuple[int, ...]],
              check: Checker, async_op: bool = False) -> None:
    for shape in shapes:
        full = integer_full(shape, seed=sum(shape))
        for src, dst in pairs:
            x = dt.DTensor.from_local(make_pieces(full, mesh, src), mesh, src, shape=shape)
            y = x.redistribute(mesh, dst, async_op=async_op)
            what = f"{shape} {src} -> {dst}"
            check.true(y.placements == tuple(dst), f"{what}: placements {y.placements}")
            want_local = dt.compute_local_shape_and_offset(shape, mesh, dst)[0]
            check.equal(np.array(y.to_local().shape), np.array(want_local), f"{what} local shape")
            if not any(isinstance(p, dt.Partial) for p in dst):
                check.equal(y.to_local(), local_of(full, mesh, dst), f"{what} local piece")
            check.equal(y.to_torch(), full, what)


def test_every_pair_on_a_1d_mesh(xp_mesh1d: dt.DeviceMesh, check: Checker) -> None:
    pairs = [([a], [b]) for a, b in itertools.product(P1, P1)]
    shapes = [(n, 3) for n in lengths_for(SIZE)] + [(3, n) for n in lengths_for(SIZE)]
    run_pairs(xp_mesh1d, pairs, shapes, check)
    check.done()


def test_every_pair_on_a_2d_mesh(xp_mesh2d: dt.DeviceMesh, check: Checker) -> None:
    layouts = [list(p) for p in itertools.product(P2, repeat=2)]
    pairs = [(a, b) for a in layouts for b in layouts]
    run_pairs(xp_mesh2d, pairs, [(5, 3), (1, 2)], check)
    check.done()


def test_nested_and_uneven_2d_cases(xp_mesh2d: dt.DeviceMesh, check: Checker) -> None:
    S0, S1, R, P = dt.Shard(0), dt.Shard(1), dt.Replicate(), dt.Partial()
    layouts = [[S0, S0], [S1, S1], [S0, S1], [S1, S0], [R, S0], [S0, R], [P, S0], [S0, P], [P, P],
               [dt.Partial("max"), P], [P, dt.Partial("min")]]
    pairs = [(a, b) for a in layouts for b in layouts]
    run_pairs(xp_mesh2d, pairs, [(0, 4), (3, 1), (7, 5), (2, 9)], check)
    check.done()


def test_3d_tensors_and_a_3d_mesh(check: Checker) -> None:
    shape = {1: (1, 1, 1), 2: (2, 1, 1), 3: (1, 3, 1), 4: (2, 1, 2)}.get(SIZE, (SIZE, 1, 1))
    with dt.init_device_mesh("cpu", shape) as mesh:
        S0, S1, S2, R = dt.Shard(0), dt.Shard(1), dt.Shard(2), dt.Replicate()
        layouts = [[S0, S1, S2], [S2, S2, S2], [R, S1, S1], [dt.Partial(), S0, R], [S1, R, S0]]
        run_pairs(mesh, [(a, b) for a in layouts for b in layouts], [(3, 4, 5), (1, 0, 2)], check)
    check.done()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "int16", "int32",
                                   "int64", "uint8", "bool", "complex64", "complex128"])
def test_dtypes_move_and_reduce(dtype: str, xp_mesh1d: dt.DeviceMesh, check: Checker) -> None:
    dt_ = np.dtype(dtype)
    n = 2 * SIZE + 1
    if dt_ == np.bool_:
        full = np.random.default_rng(1).random((n, 3)) < 0.5
        sources = [[dt.Shard(0)], [dt.Replicate()], [dt.Partial("sum")], [dt.Partial("max")]]
    else:
        full = (np.abs(integer_full((n, 3), seed=1)) + 10).astype(dt_) if dt_.kind == "u" else integer_full((n, 3), dt_, 1)
        sources = [[dt.Shard(0)], [dt.Shard(1)], [dt.Replicate()], [dt.Partial("sum")]]
        if dt_.kind != "c":
            sources += [[dt.Partial("max")], [dt.Partial("min")]]
    targets = [[dt.Shard(0)], [dt.Shard(1)], [dt.Replicate()]]
    for src in sources:
        if dt_ == np.bool_ and isinstance(src[0], dt.Partial):
            x = dt.distribute_tensor(full, xp_mesh1d, src)  # the value at coordinate 0, identity elsewhere
        else:
            x = dt.DTensor.from_local(make_pieces(full, xp_mesh1d, src), xp_mesh1d, src, shape=full.shape)
        for dst in targets:
            y = x.redistribute(placements=dst)
            check.equal(y.to_torch(), full, f"{dtype} {src} -> {dst}")
    check.done()


def test_float16_sums_are_real_sums(mesh1d: dt.DeviceMesh) -> None:
    piece = np.full((4,), 0.25, dtype=np.float16)
    x = dt.DTensor.from_local(piece, mesh1d, [dt.Partial("sum")], shape=(4,))
    got = x.to_torch()
    assert got.dtype == np.float16 and np.array_equal(got, np.full(4, 0.25 * SIZE, np.float16))


def test_avg_partial(mesh1d: dt.DeviceMesh) -> None:
    piece = np.full((3,), float(RANK), dtype=np.float64)
    x = dt.DTensor.from_local(piece, mesh1d, [dt.Partial("avg")], shape=(3,))
    assert np.allclose(x.to_torch(), np.full(3, (SIZE - 1) / 2))
    y = dt.distribute_tensor(np.arange(3.0), mesh1d, [dt.Partial("avg")])
    assert np.array_equal(y.to_local(), np.arange(3.0))
    assert np.allclose(y.redistribute(placements=[dt.Shard(0)]).to_torch(), np.arange(3.0))


def test_comm_counter_bytes(mesh1d: dt.DeviceMesh) -> None:
    full = np.arange(4 * 11, dtype=np.float32).reshape(4, 11)
    x = dt.distribute_tensor(full, mesh1d, [dt.Replicate()])
    with dt.CommCounter() as c:
        s = x.redistribute(placements=[dt.Shard(1)])
    assert c.count == 0 and c.bytes_sent == 0 and c.bytes_recv == 0
    mine = s.to_local().nbytes
    with dt.CommCounter() as c:
        r = s.redistribute(placements=[dt.Replicate()])
    if SIZE == 1:
        assert c.count == 0
    else:
        assert c.kinds() == ["all_gather"]
        assert (c.bytes_sent, c.bytes_recv) == (mine, full.nbytes - mine)
        assert c.records[0].mesh_dim == 0
    assert np.array_equal(r.to_local(), full)
    with dt.CommCounter() as c:
        dt.DTensor.from_local(np.ones((4, 11), np.float32), mesh1d, [dt.Partial()], shape=(4, 11)).to_torch()
    assert c.kinds() == ([] if SIZE == 1 else ["all_reduce"])
    if SIZE > 1:
        assert "all_reduce  0             1" in c.table(), c.table()


def test_plans_move_the_least(mesh2d: dt.DeviceMesh) -> None:
    S0, S1, R, P = dt.Shard(0), dt.Shard(1), dt.Replicate(), dt.Partial()
    kinds = lambda a, b: [s.kind for s in dt.plan_redistribute(a, b)]
    assert kinds((S0,), (R,)) == ["all_gather"]
    assert kinds((R,), (S1,)) == ["slice"]
    assert kinds((S0,), (S1,)) == ["all_to_all"]
    assert kinds((P,), (S0,)) == ["reduce_scatter"]
    assert kinds((P,), (dt.Partial("max"),)) == ["all_reduce", "to_partial"]
    # swapping two shards: neither all-to-all order keeps nested splits valid, so one gathers
    assert kinds((S0, S1), (S1, S0)) == ["all_gather", "all_to_all", "slice"]
    # undoing a nested shard gathers the inner mesh dim first
    assert [(s.mesh_dim, s.kind) for s in dt.plan_redistribute((S0, S0), (R, R))] == [
        (1, "all_gather"), (0, "all_gather")]


def test_different_mesh_is_a_clear_error(mesh1d: dt.DeviceMesh) -> None:
    x = dt.zeros(4, device_mesh=mesh1d, placements=[dt.Shard(0)])
    with dt.init_device_mesh("cpu", (SIZE, 1)) as other, pytest.raises(dt.MeshMismatchError, match="another mesh"):
        x.redistribute(other, [dt.Replicate(), dt.Replicate()])
    with pytest.raises(dt.PlacementError, match="one placement per mesh dim"):
        x.redistribute(placements=[dt.Replicate(), dt.Replicate()])


def test_async_redistribute_and_gather(xp_mesh1d: dt.DeviceMesh, xp_mesh2d: dt.DeviceMesh, check: Checker) -> None:
    layouts = [[dt.Shard(0), dt.Shard(1)], [dt.Partial(), dt.Shard(0)], [dt.Shard(0), dt.Shard(0)]]
    run_pairs(xp_mesh2d, [(a, b) for a in layouts for b in layouts], [(6, 5)], check, async_op=True)
    full = integer_full((64, 33))
    x = dt.DTensor.from_local(make_pieces(full, xp_mesh1d, [dt.Partial()]), xp_mesh1d, [dt.Partial()],
                              shape=full.shape)
    handle = x.to_torch_async()
    del x
    gc.collect()  # the handle alone keeps its buffers alive
    busy = sum(i * i for i in range(1000))  # local work while the collective runs
    polls = 0
    while not handle.done():
        polls += 1
    check.equal(handle.wait(), full, "to_torch_async")
    check.true(handle.done() and busy > 0, "done() after wait()")
    pending = dt.distribute_tensor(full, xp_mesh1d, [dt.Shard(1)]).redistribute(
        placements=[dt.Shard(0)], async_op=True)
    check.equal(pending.to_local(), local_of(full, xp_mesh1d, [dt.Shard(0)]), "async S1->S0 piece")
    check.done()


def test_to_torch_of_replicate_is_the_local_piece(mesh1d: dt.DeviceMesh) -> None:
    x = dt.ones(3, device_mesh=mesh1d)
    with dt.CommCounter() as c:
        full = x.to_torch()
    assert full is x.to_local() and c.count == 0


def test_uneven_gather_sizes_follow_the_split_rule(mesh1d: dt.DeviceMesh) -> None:
    n = 2 * SIZE + 1
    x = dt.arange(n, device_mesh=mesh1d, placements=[dt.Shard(0)])
    sizes = mesh1d.get_group(0).allgather(x.to_local().shape[0])
    assert tuple(sizes) == split_sizes(n, SIZE)
    assert np.array_equal(x.to_torch(), np.arange(n))


@pytest.mark.parametrize("strided_below", [0, 1 << 30], ids=["packed", "datatypes"])
def test_equal_block_all_to_all_with_and_without_strided_datatypes(
    mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, monkeypatch: pytest.MonkeyPatch, check: Checker,
    strided_below: int,
) -> None:
    """Below STRIDED_A2A_BELOW an equal-block all-to-all reads and writes its strided sides
    through vector datatypes, from it through a NumPy pack and unpack: both are right for every
    shard pair (the uneven shapes take the other routes), and the layout says which is taken."""
    from dtorch_mpi.comm import layout, mpi_backend

    monkeypatch.setattr(mpi_backend, "STRIDED_A2A_BELOW", strided_below)
    shards = [dt.Shard(0), dt.Shard(1), dt.Shard(2)]
    pairs = [([a], [b]) for a, b in itertools.product(shards, shards) if a != b]
    shapes = [(2 * SIZE, 2 * SIZE, 3), (3, SIZE, 2 * SIZE), (SIZE, 5, 2 * SIZE)] + \
        [(n, 2 * SIZE, 3) for n in lengths_for(SIZE)]
    run_pairs(mesh1d, pairs, shapes, check)
    run_pairs(mesh1d, pairs, shapes, check, async_op=True)
    layouts = [[dt.Shard(0), dt.Shard(1)], [dt.Shard(1), dt.Shard(0)], [dt.Shard(2), dt.Shard(1)]]
    run_pairs(mesh2d, [(a, b) for a in layouts for b in layouts], [(4, 4, 4), (2, 6, 4)], check)
    # S(0) -> S(1) of (2m, 2m, 3): the send side splits dim 1 (strided), the output is contiguous;
    # S(1) -> S(0): contiguous send side, strided output
    m, me = SIZE, RANK
    s01 = layout.a2a_layout(dt.comm.comm_path(), (2, 2 * m, 3), (2 * m, 2, 3), 1, (2,) * m, 0, (2,) * m, 8,
                            mpi_backend.ALLTOALLV_FROM, strided_below, m, me)
    s10 = layout.a2a_layout(dt.comm.comm_path(), (2 * m, 2, 3), (2, 2 * m, 3), 0, (2,) * m, 1, (2,) * m, 8,
                            mpi_backend.ALLTOALLV_FROM, strided_below, m, me)
    typed = strided_below > 0 and dt.comm.comm_path() != "padded"
    check.true((s01.send_vector == (2, 6, 6 * m)) == typed and s01.recv_vector is None, f"{s01}")
    check.true((s10.recv_vector == (2, 6, 6 * m)) == typed and s10.send_vector is None, f"{s10}")
    check.true(not typed or (s01.pack_len is None and s10.unpack_len is None), "a typed side is not packed")
    check.done()


def test_large_all_to_all_keeps_the_own_block_local(
    mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, monkeypatch: pytest.MonkeyPatch, check: Checker,
) -> None:
    """From ALLTOALLV_FROM an all-to-all (equal blocks too) is an Alltoallv with the own block
    copied locally and only the moved blocks packed: every shard pair, even and uneven."""
    from dtorch_mpi.comm import mpi_backend

    monkeypatch.setattr(mpi_backend, "ALLTOALLV_FROM", 0)
    shards = [dt.Shard(0), dt.Shard(1), dt.Shard(2)]
    pairs = [([a], [b]) for a, b in itertools.product(shards, shards) if a != b]
    shapes = [(n, 2 * SIZE, 3) for n in lengths_for(SIZE)] + [(2 * SIZE, 3, n) for n in lengths_for(SIZE)]
    run_pairs(mesh1d, pairs, shapes, check)
    run_pairs(mesh1d, pairs, shapes, check, async_op=True)
    layouts = [[dt.Shard(0), dt.Shard(1)], [dt.Shard(1), dt.Shard(0)], [dt.Shard(2), dt.Shard(1)]]
    run_pairs(mesh2d, [(a, b) for a in layouts for b in layouts], [(7, 5, 3), (4, 4, 4)], check)
    check.done()


def test_dropping_async_results_before_waiting_is_safe(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """Issue 12 item 1: MPI keeps writing into a dropped async result's buffers; the in-flight
    registry keeps them alive (this loop corrupted the heap at 2 and 3 ranks)."""
    from dtorch_mpi.comm import work

    full = np.arange(64000.0).reshape(1000, 64)
    x = dt.distribute_tensor(full, mesh1d, [dt.Shard(0)])
    for _ in range(50):
        y = x.redistribute(placements=[dt.Replicate()], async_op=True)
        del y
        x.to_torch_async()  # a gather handle dropped unwaited
        z = x.redistribute(placements=[dt.Shard(1)])
    gc.collect()
    work.drain()
    check.true(work.in_flight() == 0, f"{work.in_flight()} requests still in flight after drain()")
    check.equal(z.to_torch(), full, "blocking redistribute after dropped async ones")
    check.done()


def test_max_and_min_propagate_nan_like_numpy(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, check: Checker) -> None:
    """Issue 12 item 4: MPI MAX/MIN are not NaN-aware; every rank must get NumPy's answer."""
    from mpi4py import MPI

    nan = np.nan
    for op, fn in (("max", np.max), ("min", np.min)):
        for n in lengths_for(SIZE):
            for where in {0, n // 2, n - 1} if n else set():
                full = np.arange(float(n))
                full[where] = nan
                x = dt.distribute_tensor(full, mesh1d, [dt.Shard(0)])
                got = getattr(x, op)().to_torch()
                check.true(np.isnan(got), f"{op} of {full} over Shard(0) gave {got}")
        for dtype in (np.float16, np.float32, np.float64):
            piece = np.array([nan, 2.0], dtype) if RANK == 0 else np.array([5.0, nan], dtype)
            got = dt.DTensor.from_local(piece, mesh1d, [dt.Partial(op)], shape=(2,)).to_torch()
            want = np.array([nan, 2.0 if SIZE == 1 else nan], dtype)
            check.equal(got, want, f"Partial({op}) {dtype.__name__}")
            # every rank holds the same bits (the reduced value is really replicated)
            same = MPI.COMM_WORLD.allgather(got.tobytes())
            check.true(len(set(same)) == 1, f"Partial({op}) differs between ranks")
            rs = dt.DTensor.from_local(piece, mesh1d, [dt.Partial(op)], shape=(2,)).redistribute(
                placements=[dt.Shard(0)])
            check.equal(rs.to_torch(), want, f"Partial({op}) -> Shard(0) {dtype.__name__}")
        full = integer_full((5, 3))
        full[1, 2] = full[4, 0] = nan
        for plc in ([dt.Shard(0), dt.Shard(1)], [dt.Shard(1), dt.Shard(0)], [dt.Replicate(), dt.Shard(0)]):
            x = dt.distribute_tensor(full, mesh2d, plc)
            for dim in (0, 1):
                got = getattr(x, op)(dim=dim).to_torch()
                check.equal(got, fn(full, axis=dim), f"{op}(dim={dim}) over {plc}")
    check.done()


def test_nested_shard_exchange_receives_the_lower_bound(check: Checker) -> None:
    """Pairs the per-dim plan would gather and slice again (issue 27 item 4) run as one
    whole-mesh exchange: correct values, and each rank receives exactly what its target piece
    lacks (redistribute/traffic.py's lower bound, the simulated-scale tests' number)."""
    from dtorch_mpi.redistribute.planner import exchanges_directly
    from dtorch_mpi.redistribute.traffic import lower_bound

    shape = {1: (1, 1, 1), 2: (1, 1, 2), 3: (1, 3, 1), 4: (2, 1, 2)}.get(SIZE, (SIZE, 1, 1))
    S0, S1, R = dt.Shard(0), dt.Shard(1), dt.Replicate()
    pairs = [((S0, S0, S0), (S1, S1, S1)), ((R, S0, S0), (S0, R, S0)), ((S0, S1, S1), (S1, S0, S0)),
             ((S1, S1, R), (R, S0, S1))]
    with dt.init_device_mesh("cpu", shape) as mesh:
        for tshape in [(6, 5), (3, 8), (0, 4)]:
            full = integer_full(tshape, seed=sum(tshape))
            for src, dst in pairs:
                x = dt.DTensor.from_local(make_pieces(full, mesh, list(src)), mesh, list(src), shape=tshape)
                with dt.CommCounter() as c:
                    y = x.redistribute(mesh, list(dst))
                what = f"{tshape} {src} -> {dst}"
                check.equal(y.to_local(), local_of(full, mesh, list(dst)), what)
                got = sum(r.bytes_recv for r in c.records if r.kind == "exchange")
                direct = mesh.ndim > 1 and 0 not in tshape and exchanges_directly(src, dst) and SIZE > 1
                want = lower_bound(tshape, mesh.shape, src, dst, mesh.get_coordinate()) * 8 if direct else 0
                check.true(got == want, f"{what}: received {got} bytes, lower bound {want}")
    check.done()
