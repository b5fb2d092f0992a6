"""Placements and the balanced split rule (pure: no communication)."""

from __future__ import annotations

import itertools

import pytest
from conftest import RUN_ONCE
from hypothesis import given
from hypothesis import strategies as st

import dtorch_mpi as dt
from dtorch_mpi.placement import normalize_placements
from dtorch_mpi.split import local_shape_and_offset, split_offsets, split_range, split_sizes

# pure functions of the rank count they are given: the same at every world size and path
pytestmark = RUN_ONCE


def test_placements_are_values_with_readable_reprs() -> None:
    assert dt.Shard(1) == dt.Shard(1) and dt.Shard(1) != dt.Shard(0)
    assert hash(dt.Partial("sum")) == hash(dt.Partial())
    assert len({dt.Replicate(), dt.Replicate(), dt.Shard(0)}) == 2
    assert repr(dt.Shard(1)) == "Shard(dim=1)"
    assert repr(dt.Replicate()) == "Replicate()"
    assert repr(dt.Partial("max")) == 'Partial("max")'
    with pytest.raises(AttributeError):
        dt.Shard(0).dim = 1  # type: ignore[misc]


def test_invalid_placements_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="use one of sum, avg, max, min"):
        dt.Partial("prod")
    with pytest.raises(TypeError, match="int tensor dim"):
        dt.Shard("0")  # type: ignore[arg-type]
    with pytest.raises(dt.PlacementError, match="one placement per mesh dim"):
        normalize_placements([dt.Shard(0), dt.Shard(1)], 1, 2)
    with pytest.raises(dt.PlacementError, match=r"out of range for a 2-D tensor; use a dim in \[-2, 1\]"):
        normalize_placements([dt.Shard(2)], 1, 2)
    with pytest.raises(dt.PlacementError, match="0-D tensor cannot be sharded"):
        normalize_placements([dt.Shard(0)], 1, 0)
    with pytest.raises(dt.PlacementError, match="not a Shard, Replicate or Partial"):
        normalize_placements(["S0"], 1, 1)  # type: ignore[list-item]


def test_negative_dims_are_normalised() -> None:
    assert normalize_placements([dt.Shard(-1), dt.Replicate()], 2, 3) == (dt.Shard(2), dt.Replicate())


def test_spec_example_4_by_11_over_4() -> None:
    shapes = [local_shape_and_offset((4, 11), (4,), (dt.Shard(1),), (i,)) for i in range(4)]
    assert [s for s, _ in shapes] == [(4, 3), (4, 3), (4, 3), (4, 2)]
    assert [o for _, o in shapes] == [(0, 0), (0, 3), (0, 6), (0, 9)]


@pytest.mark.parametrize("n,m,sizes", [
    (0, 3, (0, 0, 0)), (1, 4, (1, 0, 0, 0)), (3, 4, (1, 1, 1, 0)), (4, 4, (1, 1, 1, 1)),
    (5, 4, (2, 1, 1, 1)), (11, 4, (3, 3, 3, 2)), (7, 1, (7,)),
])
def test_split_sizes_table(n: int, m: int, sizes: tuple[int, ...]) -> None:
    assert split_sizes(n, m) == sizes
    assert [split_range(n, m, i) for i in range(m)] == list(zip(sizes, split_offsets(n, m)))


@given(st.integers(0, 200), st.integers(1, 17))
def test_split_rule_partitions_the_range(n: int, m: int) -> None:
    sizes, offs = split_sizes(n, m), split_offsets(n, m)
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert all(a >= b for a, b in itertools.pairwise(sizes))
    assert list(offs) == [sum(sizes[:i]) for i in range(m)]


@given(st.integers(0, 60), st.integers(1, 4), st.integers(1, 4))
def test_nested_sharding_splits_the_chunk_again(n: int, m0: int, m1: int) -> None:
    covered = []
    for i in range(m0):
        outer_size, outer_off = split_range(n, m0, i)
        for j in range(m1):
            (size,), (off,) = local_shape_and_offset((n,), (m0, m1), (dt.Shard(0), dt.Shard(0)), (i, j))
            inner_size, inner_off = split_range(outer_size, m1, j)
            assert (size, off) == (inner_size, outer_off + inner_off)
            covered.extend(range(off, off + size))
    assert covered == list(range(n))


def test_compute_local_shape_and_offset_public(mesh2d: dt.DeviceMesh) -> None:
    m0, m1 = mesh2d.shape
    for c0 in range(m0):
        for c1 in range(m1):
            shape, off = dt.compute_local_shape_and_offset(
                (9, 5), mesh2d, [dt.Shard(0), dt.Shard(1)], coordinate=(c0, c1))
            assert shape == (split_sizes(9, m0)[c0], split_sizes(5, m1)[c1])
            assert off == (split_offsets(9, m0)[c0], split_offsets(5, m1)[c1])
    mine = dt.compute_local_shape_and_offset((9, 5), mesh2d, [dt.Replicate(), dt.Shard(-1)])
    c = mesh2d.get_coordinate()
    assert mine == ((9, split_sizes(5, m1)[c[1]]), (0, split_offsets(5, m1)[c[1]]))
    with pytest.raises(ValueError, match="not a coordinate"):
        dt.compute_local_shape_and_offset((9, 5), mesh2d, [dt.Shard(0), dt.Shard(1)], coordinate=(9, 9))
