"""Simulated scale (issue 27 items 4 and 9): redistribute plans on mesh shapes far larger than
the job, by metadata alone. No communication: each rank's received bytes and largest
intermediate piece are counted from the plan the executor runs (redistribute/traffic.py),
against the lower bound (what the rank's target piece lacks from its source piece)."""

from __future__ import annotations

import itertools
from math import prod
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import RUN_ONCE

import dtorch_mpi as dt
from dtorch_mpi.ops.cost import redistribute_cost
from dtorch_mpi.redistribute.planner import exchanges_directly
from dtorch_mpi.redistribute.traffic import exchange_layout, lower_bound, received
from dtorch_mpi.spec import DTensorSpec
from dtorch_mpi.split import local_shape_and_offset

pytestmark = RUN_ONCE  # pure simulations (planner arithmetic, a stand-in communicator): no rank count or path changes them

R, S0, S1, S2 = dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Shard(2)


def layouts(ndim_mesh: int, ndim_tensor: int) -> list[tuple[dt.Placement, ...]]:
    choices = [R] + [dt.Shard(d) for d in range(ndim_tensor)]
    return list(itertools.product(choices, repeat=ndim_mesh))


def assert_within_bounds(shape: tuple[int, ...], mesh: tuple[int, ...], src: tuple, dst: tuple,
                         coords: list[tuple[int, ...]]) -> None:
    for c in coords:
        moved, peak = received(shape, mesh, src, dst, c)
        bound = lower_bound(shape, mesh, src, dst, c)
        target = prod(local_shape_and_offset(shape, mesh, dst, c)[0])
        assert moved <= 2 * bound, (shape, mesh, src, dst, c, moved, bound)
        assert peak <= 2 * target, (shape, mesh, src, dst, c, peak, target)


@pytest.mark.parametrize("mesh", [(2, 2, 2), (2, 2, 4)])
@pytest.mark.parametrize("shape", [(16, 16), (5, 7), (3, 17), (0, 5), (4, 4, 4)])
def test_every_shard_replicate_pair_moves_at_most_twice_the_lower_bound(mesh: tuple[int, ...],
                                                                        shape: tuple[int, ...]) -> None:
    coords = list(itertools.product(*map(range, mesh)))
    every = layouts(len(mesh), len(shape))
    for src, dst in itertools.product(every, every):
        assert_within_bounds(shape, mesh, src, dst, coords)


def test_the_per_dim_plan_alone_was_far_above_the_bound() -> None:
    """The regression the exchange fixes: [S0,S0,S0] -> [S1,S1,S1] on (8,16,8), float32
    (4096, 4096): 64 KiB target pieces. The per-dim plan gathered 1/8 of the tensor (8 MiB
    intermediates, ~15.7 MB received); the plan run now receives under the 64 KiB piece."""
    mesh, shape, src, dst = (8, 16, 8), (4096, 4096), (S0, S0, S0), (S1, S1, S1)
    assert exchanges_directly(src, dst)
    for c in [(0, 0, 0), (7, 15, 7), (3, 9, 2)]:
        moved, peak = received(shape, mesh, src, dst, c)
        assert moved * 4 < 64 * 1024 and peak * 4 == 64 * 1024
        assert moved == lower_bound(shape, mesh, src, dst, c)
        old_moved, old_peak = received(shape, mesh, src, dst, c, per_dim=True)
        assert old_moved > 50 * moved and old_peak == 128 * peak  # what the per-dim plan did


def test_a_large_3d_mesh_sampled() -> None:
    """(8,16,8) = 1,024 simulated ranks: every pair of all-shard and half-replicated layouts of
    a 2-D tensor, at corner and interior coordinates, within 2x the bound."""
    mesh, shape = (8, 16, 8), (1000, 777)
    coords = [(0, 0, 0), (7, 15, 7), (3, 9, 2), (0, 15, 4), (5, 0, 7)]
    every = layouts(3, 2)
    for src, dst in itertools.product(every, every):
        assert_within_bounds(shape, mesh, src, dst, coords)


@pytest.mark.parametrize("mesh", [(2, 2, 2), (2, 3, 2)])
def test_exchange_blocks_tile_every_target_piece_once(mesh: tuple[int, ...]) -> None:
    """The exchange's block table (what the MPI backend moves): on every rank, the own block
    and the received blocks cover the target piece exactly once, and every block a rank
    expects from a peer is the block that peer sends it."""
    shape = (5, 7, 3)
    coords = list(itertools.product(*map(range, mesh)))
    flat = {c: i for i, c in enumerate(coords)}
    pairs = [(src, dst) for src, dst in itertools.product(layouts(3, 3), layouts(3, 3))
             if exchanges_directly(src, dst)][::17]
    assert pairs
    for src, dst in pairs:
        tables = {c: exchange_layout(shape, mesh, src, dst, c) for c in coords}
        for c, lay in tables.items():
            target = local_shape_and_offset(shape, mesh, dst, c)[0]
            cover = np.zeros(target, dtype=np.int64)
            blocks = list(lay.recvs) + ([(flat[c], lay.own[1])] if lay.own else [])
            for peer, ranges in blocks:
                cover[tuple(slice(a, b) for a, b in ranges)] += 1
                if peer != flat[c]:
                    sent = dict(tables[coords[peer]].sends)[flat[c]]
                    assert [b - a for a, b in sent] == [b - a for a, b in ranges]
            assert (cover == 1).all(), (src, dst, c)


def test_cost_model_all_to_all_is_exact_on_1024_ranks() -> None:
    """The fix-it cost of S0 <-> S1 on a (1024,) mesh with a (1000, 37) float64 tensor equals
    what rank 0 receives (was 0.037x and 27.75x)."""
    mesh = SimpleNamespace(shape=(1024,), ndim=1, size=lambda dim=None: 1024)
    for src, dst in [((S0,), (S1,)), ((S1,), (S0,))]:
        spec = DTensorSpec(mesh, src, (1000, 37), np.dtype(np.float64))  # type: ignore[arg-type]
        want = lower_bound((1000, 37), (1024,), src, dst, (0,)) * 8
        assert redistribute_cost(spec, dst).moved == want
    assert lower_bound((1000, 37), (1024,), (S0,), (S1,), (0,)) == 999
    assert lower_bound((1000, 37), (1024,), (S1,), (S0,), (0,)) == 36


def test_cost_model_matches_the_plan_on_a_3d_mesh() -> None:
    mesh = SimpleNamespace(shape=(8, 16, 8), ndim=3, size=lambda dim=None: 1024)
    spec = DTensorSpec(mesh, (S0, S0, S0), (4096, 4096), np.dtype(np.float32))  # type: ignore[arg-type]
    cost = redistribute_cost(spec, (S1, S1, S1))
    assert cost.moved == received((4096, 4096), (8, 16, 8), (S0, S0, S0), (S1, S1, S1), (0, 0, 0))[0] * 4
    assert cost.resident == 64 * 1024


class _FakeMesh:
    """A 1-D mesh of ``p`` simulated ranks seen from coordinate 0 (a stand-in communicator)."""

    device_type = "cpu"
    ndim = 1
    identity = (0,)

    def __init__(self, p: int) -> None:
        from standin_comm import StandInComm

        self.shape = (p,)
        self.comm = StandInComm(p, mirror=True)

    def get_coordinate(self) -> tuple[int, ...]:
        return (0,)

    def get_comm(self) -> object:
        return self.comm

    def _check_alive(self) -> None:
        return None


def test_from_local_metadata_does_not_grow_with_the_ranks() -> None:
    """from_local's checked path (issue 27 item 7) at 64 and 16,384 simulated ranks: the same
    fixed-size reductions and no gather of a ranks-long table (was ranks x 69 int64: 9 MB at
    16,384; scripts/bench_scale_sim.py times it)."""
    from dtorch_mpi.construction import _from_local_checked

    seen = {}
    for p in (64, 16384):
        mesh = _FakeMesh(p)
        _, spec = _from_local_checked(np.zeros((2, 3)), mesh, [S0], (2 * p, 3))  # type: ignore[arg-type]
        assert spec.shape == (2 * p, 3)
        assert set(mesh.comm.calls) == {"Iallreduce"}
        seen[p] = mesh.comm.sizes
    assert seen[64] == seen[16384] and sum(n for _, n in seen[64]) < 100
