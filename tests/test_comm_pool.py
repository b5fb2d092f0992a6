"""The buffer pool (comm/pool.py): a buffer still referenced, or any view of it, is never handed
out again; idle ones are; the byte cap and ``DeviceMesh.free()`` bound what it keeps; and every
redistribute stays correct while pooled buffers are reused under it (all pairs, blocking and
async, every earlier result kept alive and checked at the end)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import SIZE, Checker, lengths_for
from helpers import P1, P2, integer_full, make_pieces

import dtorch_mpi as dt
from dtorch_mpi.comm import pool
from dtorch_mpi.mesh import live_caches


@pytest.fixture
def small_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pool every buffer, however small, so the small test shapes go through the pool. A
    compiled plan chooses its output allocator once, so the plans cached before (and those
    compiled here) are dropped on the way in and out."""
    monkeypatch.setattr(pool, "POOLED_FROM", 1)
    _forget_plans()
    yield
    _forget_plans()


def _forget_plans() -> None:
    pool.clear()
    for plans in live_caches("_plans"):
        plans.cache_clear()


def test_pooled_buffers_start_at_a_page_boundary_and_are_reused(small_pool: None) -> None:
    """Every pooled buffer starts at a page boundary (copies into it run at a speed independent
    of where the heap put it), and a dropped one is handed out again at the same address."""
    first = pool.empty(np, (3, 1000), np.float64)
    address = first.ctypes.data
    assert address % pool.PAGE == 0
    del first
    again = pool.empty(np, 3000, np.float64)
    assert again.ctypes.data == address
    other = pool.empty(np, 3000, np.float64)  # ``again`` still held: another owner, aligned too
    assert other.ctypes.data % pool.PAGE == 0 and other.ctypes.data != address


def test_a_live_slice_keeps_its_buffer_out_of_reuse(small_pool: None) -> None:
    a = pool.empty(np, (64, 32), np.float32)
    a[...] = 1.0
    kept = a[5:9, 3]  # only a view survives
    del a
    b = pool.empty(np, (64, 32), np.float32)
    assert not np.shares_memory(b, kept)
    b[...] = 2.0
    assert np.all(kept == 1.0)
    held = pool.held_bytes()
    del b
    c = pool.empty(np, (32, 64), np.float32)  # same bytes, another shape: an idle owner again
    assert pool.held_bytes() == held
    assert not np.shares_memory(c, kept)
    del kept
    d = pool.empty(np, 2048, np.float32)  # b's owner is idle again (c holds the other): no new one
    assert pool.held_bytes() == held
    assert d.shape == (2048,) and d.dtype == np.float32


def test_every_handed_out_buffer_is_distinct_while_held(small_pool: None) -> None:
    held = [pool.empty(np, (10, 7), dtype) for dtype in ("float64", "int64", "complex64") for _ in range(3)]
    for x, y in itertools.combinations(held, 2):
        assert not np.shares_memory(x, y)
    memory = [np.asarray(memoryview(h)) for h in held]  # exporters keep the owner referenced too
    del held
    again = [pool.empty(np, (10, 7), np.float64) for _ in range(3)]
    for x, y in itertools.product(again, memory):
        assert not np.shares_memory(x, y)


def test_the_byte_cap_bounds_the_pool(small_pool: None) -> None:
    cap = pool.pool_cap()
    try:
        pool.set_pool_cap(1000)
        a, b = pool.empty(np, 100, np.float64), pool.empty(np, 100, np.float64)  # 800 B each
        assert pool.held_bytes() <= 1000
        assert not np.shares_memory(a, b)
        big = pool.empty(np, 1000, np.float64)  # over the cap: not pooled at all
        assert big.shape == (1000,) and pool.held_bytes() <= 1000
        pool.set_pool_cap(0)
        assert pool.held_bytes() == 0
        with pytest.raises(ValueError, match="DTORCH_BUFFER_POOL_BYTES"):
            pool.set_pool_cap(-1)
    finally:
        pool.set_pool_cap(cap)


def test_a_kept_buffer_is_handed_out_again_only_when_idle(small_pool: None) -> None:
    """``pool.Kept`` (replicate's buckets): an idle buffer is handed out again at its address;
    one still viewed never is, nor written; two are kept (the alternation of gradients zeroed
    in place); another size gets a new one; and none counts against the pool's cap."""
    kept = pool.Kept()
    first = kept.empty(np, 1000, np.float64)
    a = first.ctypes.data
    assert a % pool.PAGE == 0
    del first
    held = kept.empty(np, 1000, np.float64)  # idle: the same buffer
    assert held.ctypes.data == a
    held[...] = 1.0
    other = kept.empty(np, 1000, np.float64)  # ``held`` is in use: a second one
    b = other.ctypes.data
    assert b != a and not np.shares_memory(other, held)
    del other
    again = kept.empty(np, 1000, np.float64)  # the second is idle again
    assert again.ctypes.data == b
    third = kept.empty(np, 1000, np.float64)  # both in use: a third replaces the older
    assert not np.shares_memory(third, held) and not np.shares_memory(third, again)
    third[...] = again[...] = 2.0
    assert np.all(held == 1.0)
    del held  # the first was forgotten: its memory goes with its last user
    del third
    assert kept.empty(np, 1000, np.float64).ctypes.data not in (a, b)  # the third, idle again
    wider = kept.empty(np, 2000, np.float64)  # another size: a new one, not ``again``'s
    assert wider.shape == (2000,) and not np.shares_memory(wider, again)
    assert np.all(again == 2.0)
    assert pool.held_bytes() == 0
    assert kept.empty(np, 3, object).dtype == object


def test_other_arrays_bypass_the_pool(small_pool: None) -> None:
    assert pool.empty(np, (3,), object).dtype == object
    assert pool.empty(np, (0, 4), np.float32).shape == (0, 4)
    assert pool.held_bytes() == 0


def test_mesh_free_empties_the_pool(small_pool: None) -> None:
    full = np.arange(40.0 * max(SIZE, 1)).reshape(-1, 4)
    with dt.init_device_mesh("cpu", (SIZE,)) as mesh:
        y = dt.distribute_tensor(full, mesh, [dt.Shard(0)]).redistribute(placements=[dt.Replicate()])
        pool.empty(np, 64, np.float64)  # at least one owner (dropped at once), whatever the rank count
        assert pool.held_bytes() > 0
        mesh.free()
        assert pool.held_bytes() == 0
    assert np.array_equal(y.to_local(), full)  # a result outlives the pool that made it


@pytest.mark.parametrize("async_op", [False, True])
def test_redistributes_stay_correct_while_buffers_are_reused(
    mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh, small_pool: None, check: Checker, async_op: bool,
) -> None:
    """Every pair twice over, on uneven shapes: each result is kept (async ones unwaited until
    all are started), so a buffer handed out twice would show in an earlier result."""
    cases = [(mesh1d, [a], [b], (n, 5)) for a, b in itertools.product(P1, P1) for n in lengths_for(SIZE)]
    cases += [(mesh2d, list(a), list(b), (7, 5)) for a, b in itertools.product(
        itertools.product(P2[:3], repeat=2), itertools.product(P2[:3], repeat=2))]
    results = []
    for _ in range(2):
        for mesh, src, dst, shape in cases:
            full = integer_full(shape, seed=sum(shape) + len(results))
            x = dt.DTensor.from_local(make_pieces(full, mesh, src), mesh, src, shape=shape)
            results.append((x.redistribute(mesh, dst, async_op=async_op), full, f"{shape} {src} -> {dst}"))
    check.true(pool.held_bytes() > 0, "the redistribute outputs went through the pool")
    for y, full, what in results:
        check.equal(y.to_torch(), full, what)
    check.done()


def test_a_dropped_async_result_keeps_its_buffers_from_the_next_call(
    mesh1d: dt.DeviceMesh, small_pool: None, check: Checker,
) -> None:
    """MPI may still be writing into a dropped async result's buffers: the next redistribute of
    the same sizes, started at once, must get other buffers (the in-flight registry holds them),
    and both transfers must deliver their own values."""
    shape = (4 * SIZE + 1, 3)
    first, second = integer_full(shape, seed=1), integer_full(shape, seed=2)
    for src, dst in [([dt.Shard(0)], [dt.Replicate()]), ([dt.Shard(0)], [dt.Shard(1)]),
                     ([dt.Partial("sum")], [dt.Shard(0)])]:
        x1 = dt.DTensor.from_local(make_pieces(first, mesh1d, src), mesh1d, src, shape=shape)
        x2 = dt.DTensor.from_local(make_pieces(second, mesh1d, src), mesh1d, src, shape=shape)
        x1.redistribute(mesh1d, dst, async_op=True)  # dropped unwaited
        x1.to_torch_async()  # dropped unwaited
        y = x2.redistribute(mesh1d, dst)
        check.true(pool.held_bytes() > 0 or SIZE == 1, f"{src} -> {dst}: the outputs went through the pool")
        check.equal(y.to_torch(), second, f"{src} -> {dst} after dropped async ones")
        check.equal(x1.redistribute(mesh1d, dst).to_torch(), first, f"{src} -> {dst} of the first")
    check.done()
