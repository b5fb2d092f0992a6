"""The MPI backend's six collectives, called directly, blocking and nonblocking, on the run's
collective path (scripts/run_tests.py runs every path), with uneven and empty pieces."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import RANK, SIZE, Checker

import dtorch_mpi as dt
from dtorch_mpi.comm import Group
from dtorch_mpi.split import split_offsets, split_sizes

BACKEND = dt.comm.backend_named("mpi")  # with the shared prologue, as the library uses it


def pieces(full: np.ndarray, axis: int) -> tuple[list[int], np.ndarray]:
    sizes = list(split_sizes(full.shape[axis], SIZE))
    off = split_offsets(full.shape[axis], SIZE)[RANK]
    return sizes, np.ascontiguousarray(np.take(full, range(off, off + sizes[RANK]), axis=axis))


@pytest.mark.parametrize("async_op", [False, True])
def test_collectives_against_numpy(mesh1d: dt.DeviceMesh, async_op: bool, check: Checker) -> None:
    group = Group(mesh1d.get_group(0), 0)
    for rows in (0, 1, SIZE + 1, 2 * SIZE + 1):
        full = np.arange(rows * 6, dtype=np.float64).reshape(rows, 3, 2)
        for axis in (0, 1, 2):
            if full.shape[axis] == 0 and axis:
                continue
            sizes, mine = pieces(full, axis)
            got = BACKEND.all_gather(group, mine, np.empty_like(full), axis, sizes, async_op).wait()
            check.equal(got, full, f"all_gather rows={rows} axis={axis}")
            root = SIZE - 1
            out = np.empty_like(mine)
            got = BACKEND.scatter(group, full if root == RANK else None, out, axis, sizes, root, async_op).wait()
            check.equal(got, mine, f"scatter rows={rows} axis={axis}")
            red = BACKEND.reduce_scatter(group, full, np.empty_like(mine), axis, sizes, "sum", async_op).wait()
            check.equal(red, mine * SIZE, f"reduce_scatter rows={rows} axis={axis}")
        buf = full.copy() if RANK == 0 else np.zeros_like(full)
        check.equal(BACKEND.broadcast(group, buf, 0, async_op).wait(), full, f"broadcast rows={rows}")
        mx = BACKEND.all_reduce(group, full + RANK, np.empty_like(full), "max", async_op).wait()
        check.equal(mx, full + SIZE - 1, f"all_reduce max rows={rows}")
        for dtype in (np.float64, np.float16):  # in place (MPI_IN_PLACE), and widened (a copy)
            buf = (full + RANK).astype(dtype)
            got = BACKEND.all_reduce(group, buf, buf, "sum", async_op).wait()
            check.true(got is buf, f"all_reduce in place returns its buffer rows={rows} {dtype.__name__}")
            check.equal(buf, (full * SIZE + SIZE * (SIZE - 1) // 2).astype(dtype),
                        f"all_reduce in place rows={rows} {dtype.__name__}")
        # all-to-all: Shard(0) -> Shard(1) of a [rows, 2*SIZE+1] array
        wide = np.arange(rows * (2 * SIZE + 1), dtype=np.float32).reshape(rows, 2 * SIZE + 1)
        rsizes, mine_rows = pieces(wide, 0)
        csizes, mine_cols = pieces(wide, 1)
        got = BACKEND.all_to_all(group, mine_rows, np.empty_like(mine_cols), 1, csizes, 0, rsizes, async_op).wait()
        check.equal(got, mine_cols, f"all_to_all rows={rows}")
    check.done()


def test_route_choice_is_a_function_of_group_wide_sizes() -> None:
    """Issue 18: the rank moving nothing in a (1, 2) Shard(0) -> Shard(1) at 3 ranks has equal
    (zero) counts of its own; the route must still be the group's Alltoallv."""
    from dtorch_mpi.comm.routes import Route, all_to_all_route, gather_route

    big = 1 << 30
    assert all_to_all_route("auto", (1, 2), 1, (1, 1, 0), 0, (1, 0, 0), 4, big) is Route.A2A_V
    assert all_to_all_route("auto", (0, 2), 1, (1, 1, 0), 0, (1, 0, 0), 4, big) is Route.A2A_V  # the empty rank
    assert all_to_all_route("auto", (2, 6), 1, (2, 2, 2), 0, (2, 2, 2), 4, big) is Route.A2A_EQUAL
    assert all_to_all_route("variable", (2, 6), 1, (2, 2, 2), 0, (2, 2, 2), 4, big) is Route.A2A_EQUAL
    assert all_to_all_route("padded", (2, 6), 1, (2, 2, 2), 0, (2, 2, 2), 4, big) is Route.A2A_PADDED
    assert all_to_all_route("auto", (1, 0, 2), 2, (1, 1, 0), 0, (1, 0, 0), 4, big) is Route.NOTHING
    assert all_to_all_route("auto", (3, 0), 1, (0, 0, 0), 0, (1, 1, 1), 4, big) is Route.NOTHING
    # from the size threshold (whole tensor: 6 x 6 x 4 bytes) equal blocks take Alltoallv too
    assert all_to_all_route("auto", (2, 6), 1, (2, 2, 2), 0, (2, 2, 2), 4, 144) is Route.A2A_V
    assert all_to_all_route("auto", (2, 6), 1, (2, 2, 2), 0, (2, 2, 2), 4, 145) is Route.A2A_EQUAL
    assert gather_route("auto", (2, 2), 1, 64) is Route.GATHER_EQUAL
    assert gather_route("auto", (2, 2), 3, 64) is Route.GATHER_W
    assert gather_route("auto", (2, 1), 1, 64) is Route.GATHER_V
    assert gather_route("auto", (2, 1), 1, 1 << 30) is Route.GATHER_V  # at every size
    assert gather_route("variable", (2, 1), 1, 64) is Route.GATHER_V
    assert gather_route("padded", (2, 1), 1, 64) is Route.GATHER_PADDED_COMPACT
    assert gather_route("padded", (2, 1), 3, 64) is Route.GATHER_PADDED_STRIDED
    assert gather_route("auto", (2, 1), 3, 64) is Route.GATHER_W
    assert gather_route("variable", (2, 1), 3, 64) is Route.GATHER_W
    assert gather_route("padded", (0, 0), 1, 0) is Route.NOTHING
    assert [r.padded for r in (Route.GATHER_PADDED_COMPACT, Route.A2A_PADDED, Route.A2A_EQUAL)] == [
        True, True, False]


@pytest.mark.rank_independent
@pytest.mark.path_independent
def test_layout_arithmetic_against_numpy() -> None:
    """comm/layout.py's pure plans for simulated groups of 1-4 ranks and lengths 0, below, equal
    to and not divisible by the rank count: v-counts, the padded path's kept rows, the pack by
    destination (mpi_backend's NumPy copies over ``destination_runs``), and an all-to-all's
    counts matching between every sender and receiver on every path."""
    from dtorch_mpi.comm import layout, mpi_backend

    for m in (1, 2, 3, 4):
        for n in sorted({0, m - 1, m, m + 1, 2 * m + 1}):
            sizes = tuple(split_sizes(n, m))
            starts = np.cumsum((0,) + sizes)[:-1].tolist()
            assert layout.gather_v_spec(sizes, 3) == ([k * 3 for k in sizes], [o * 3 for o in starts])
            width = max(sizes)
            want_rows = [r * width + i for r, k in enumerate(sizes) for i in range(k)]
            assert layout.padded_rows(sizes, width).tolist() == want_rows
            runs_rows = [at + b * width + i for at, k, rows, _ in layout.padded_runs(sizes, width)
                         for b in range(k) for i in range(rows)]
            assert runs_rows == want_rows and [to for *_, to in layout.padded_runs(sizes, width)] == [
                starts[r] for r in range(m) if sizes[r] and (r == 0 or sizes[r] != sizes[r - 1] or not sizes[r - 1])]
            for dtype, inner in ((np.float32, 1), (np.int16, 2), (np.uint8, 4), (np.float64, 1)):  # runs of 2-8
                src = np.arange(2 * n * inner).astype(dtype).reshape(2, n, inner)  # bytes: one wider int each
                want = np.concatenate([src[:, o : o + k].reshape(-1) for o, k in zip(starts, sizes)])
                got = mpi_backend._pack_by_destination(src, sizes, None, src.dtype)
                assert np.array_equal(got, want), (m, n, dtype)
                back = np.zeros_like(src)
                mpi_backend._copy_runs(layout.destination_runs(sizes, 2 * inner, None)[0], got, back, False)
                assert np.array_equal(back, src), (m, n, dtype)
                if dtype is np.float32:  # into a buffer of another dtype (a widened reduction's): cast per element
                    wider = mpi_backend._pack_by_destination(src, sizes, None, np.float64)
                    assert wider.dtype == np.float64 and np.array_equal(wider, want), (m, n)
            src3 = np.arange(2 * n * 3, dtype=np.float64).reshape(2, n, 3)
            for pad in (None, width):
                blocks = []
                for o, k in zip(starts, sizes):
                    block = np.zeros((2, pad if pad is not None else k, 3))
                    block[:, :k] = src3[:, o : o + k]
                    blocks.append(block.reshape(-1))
                got = mpi_backend._pack_by_destination(src3, sizes, pad, src3.dtype)
                assert np.array_equal(got, np.concatenate(blocks)), (m, n, pad)
            # Shard(0) -> Shard(1) of an (n, 2m+1) array: what rank j sends rank i, i receives from j
            csizes = tuple(split_sizes(2 * m + 1, m))
            for path in ("auto", "variable", "padded"):
                lays = [layout.a2a_layout(path, (sizes[me], 2 * m + 1), (n, csizes[me]), 1, csizes, 0, sizes, 8,
                                          mpi_backend.ALLTOALLV_FROM, 0, m, me) for me in range(m)]
                assert len({lay.route for lay in lays}) == 1, (path, m, n)
                if lays[0].route is layout.Route.A2A_V:
                    for i in range(m):
                        for j in range(m):
                            assert lays[j].send_spec[0][i] == lays[i].recv_spec[0][j], (path, m, n, i, j)


@pytest.mark.rank_independent
@pytest.mark.path_independent
def test_by_identity_keys_long_tuples_by_identity() -> None:
    """A list argument is keyed by value; a tuple over 16 items by identity (an equal tuple is a
    miss that computes the same value again)."""
    from dtorch_mpi.comm.layout import by_identity

    calls = []

    @by_identity(maxsize=4)
    def total(sizes: tuple[int, ...]) -> int:
        calls.append(sizes)
        return sum(sizes)

    long = tuple(range(20))
    assert total(long) == total(long) == 190 and len(calls) == 1
    assert total(tuple(range(20))) == 190 and len(calls) == 2
    assert total([1, 2]) == total([1, 2]) == total((1, 2)) == 3 and len(calls) == 3


@pytest.mark.skipif(SIZE == 1, reason="a divergence needs two ranks")
def test_spmd_debug_compares_the_mpi_level_call(mesh1d: dt.DeviceMesh) -> None:
    """Same library call on every rank, different MPI call: debug mode names it."""
    from dtorch_mpi.comm import config

    group = Group(mesh1d.get_group(0), 0)
    sizes = [2] * SIZE if RANK == 0 else [3, 1] + [2] * (SIZE - 2)
    send = np.zeros((sizes[RANK], 3))
    config.set_spmd_debug(True)
    try:
        with pytest.raises(dt.SPMDDivergenceError, match="different collective calls") as err:
            BACKEND.all_gather(group, send, np.empty((2 * SIZE, 3)), 0, sizes)
    finally:
        config.set_spmd_debug(False)
    text = str(err.value)  # the MPI call kind and its counts (the group-wide sizes) are compared
    assert "mpi=Allgather" in text and "sizes=(2, 2" in text and "sizes=(3, 1" in text, text


def test_one_registry_selects_the_backends() -> None:
    """Backends come from one registry: ``mpi`` for cpu meshes, the cuda ones by name (the
    values DTORCH_GPU_BACKEND accepts); an unknown name is a clear error."""
    from dtorch_mpi.comm import backend, gpu

    assert dt.comm.backend_for("cpu") is dt.comm.backend_named("mpi")
    assert isinstance(dt.comm.backend_for("cpu").inner, dt.comm.MPIBackend)  # type: ignore[attr-defined]
    assert backend.backends_for("cuda") == ("nccl", "cuda-aware-mpi", "host-staging")
    assert gpu.gpu_backend_names() == ("auto", "nccl", "cuda-aware-mpi", "host-staging")
    with pytest.raises(ValueError, match="no communication backend named 'ucc'"):
        dt.comm.backend_named("ucc")
    with pytest.raises(ValueError, match="DTORCH_GPU_BACKEND='ucc' is not one of auto, nccl"):
        gpu.choose_backend("ucc", True, 1, 1, False)


def test_freeing_a_mesh_frees_the_cached_datatypes(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """Strided all-to-all blocks move through cached committed datatypes; DeviceMesh.free()
    frees them, and a live mesh's next call makes them again."""
    from dtorch_mpi.comm import mpi_backend

    full = np.arange(4.0 * SIZE * SIZE).reshape(2 * SIZE, 2 * SIZE)
    mesh = dt.init_device_mesh("cpu", (SIZE,))
    x = dt.distribute_tensor(full, mesh, [dt.Shard(0)], src_data_rank=None)
    check.equal(x.redistribute(placements=[dt.Shard(1)]).to_torch(), full, "S(0) -> S(1)")
    typed = SIZE > 1 and dt.comm.comm_path() != "padded"
    check.true(not typed or bool(mpi_backend._TYPE_CACHE), "no cached datatype")
    mesh.free()
    check.true(not mpi_backend._TYPE_CACHE, f"left after free: {list(mpi_backend._TYPE_CACHE)}")
    y = dt.distribute_tensor(full, mesh1d, [dt.Shard(0)], src_data_rank=None)
    check.equal(y.redistribute(placements=[dt.Shard(1)]).to_torch(), full, "S(0) -> S(1) on a live mesh")
    check.true(not typed or bool(mpi_backend._TYPE_CACHE), "not made again")
    check.done()
