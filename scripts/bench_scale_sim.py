"""Simulated scale tables (issue 27 items 4 and 7), metadata only, no communication.

Item 4: over every Shard/Replicate pair of a 2-D tensor on a mesh, the worst ratio of what a
rank receives to the lower bound (what its target piece lacks) and of its largest piece to
its target piece, for the per-dim plan alone ("before") and the plan the executor runs now.
Item 7: CPU per checked ``from_local`` at simulated ranks (stand-in communicator).

    PYTHONPATH=. python scripts/bench_scale_sim.py
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from math import prod

import numpy as np

import dtorch_mpi as dt
from dtorch_mpi.redistribute.traffic import lower_bound, received
from dtorch_mpi.split import local_shape_and_offset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def worst(mesh: tuple[int, ...], shape: tuple[int, ...], per_dim: bool, coords: list) -> tuple[float, float, int]:
    choices = [dt.Replicate(), dt.Shard(0), dt.Shard(1)]
    layouts = list(itertools.product(choices, repeat=len(mesh)))
    moved_ratio = peak_ratio = 0.0
    over = 0
    for src, dst in itertools.product(layouts, layouts):
        bad = False
        for c in coords:
            moved, peak = received(shape, mesh, src, dst, c, per_dim=per_dim)
            bound = lower_bound(shape, mesh, src, dst, c)
            target = prod(local_shape_and_offset(shape, mesh, dst, c)[0])
            moved_ratio = max(moved_ratio, moved / bound if bound else (float("inf") if moved else 0))
            peak_ratio = max(peak_ratio, peak / target if target else 0)
            bad |= moved > 2 * bound or peak > 2 * target
        over += bad
    return moved_ratio, peak_ratio, over


def item4() -> None:
    print("item 4: worst over all 3^d x 3^d Shard/Replicate pairs (received / lower bound, piece / target, "
          "pairs over 2x)")
    for mesh, shape in [((2, 2, 2), (16, 16)), ((2, 2, 4), (16, 16)), ((8, 16, 8), (4096, 4096))]:
        coords = list(itertools.product(*map(range, mesh)))
        if len(coords) > 16:
            coords = [(0, 0, 0), (7, 15, 7), (3, 9, 2), (0, 15, 4), (5, 0, 7)]
        for per_dim in (True, False):
            m, pk, over = worst(mesh, shape, per_dim, coords)
            print(f"  {mesh!s:12s} {shape!s:14s} {'before' if per_dim else 'after ':6s} "
                  f"received/bound {m:8.2f}  piece/target {pk:7.2f}  pairs over 2x: {over}")
    mesh, shape, src, dst = (8, 16, 8), (4096, 4096), (dt.Shard(0),) * 3, (dt.Shard(1),) * 3
    for per_dim in (True, False):
        moved, peak = received(shape, mesh, src, dst, (0, 0, 0), per_dim=per_dim)
        print(f"  [S0,S0,S0]->[S1,S1,S1] (8,16,8) float32 (4096,4096), rank 0, {'before' if per_dim else 'after '}: "
              f"received {moved * 4 / 1e6:.3f} MB, largest piece {peak * 4 / 1e6:.3f} MB "
              f"(target piece {prod(local_shape_and_offset(shape, mesh, dst, (0, 0, 0))[0]) * 4 / 1e6:.3f} MB)")


def item7() -> None:
    from standin_comm import StandInComm

    from dtorch_mpi.construction import _from_local_checked

    class Mesh:
        device_type, ndim, identity = "cpu", 1, (0,)

        def __init__(self, p: int) -> None:
            self.shape, self.comm = (p,), StandInComm(p, mirror=True)

        def get_coordinate(self) -> tuple[int, ...]:
            return (0,)

        def get_comm(self) -> StandInComm:
            return self.comm

        def _check_alive(self) -> None:
            return None

    print("item 7: CPU per checked from_local (shape given, run_check=True), rank 0 of a stand-in mesh")
    for p in (1024, 4096, 16384):
        mesh = Mesh(p)
        piece = np.zeros((2, 3))
        _from_local_checked(piece, mesh, [dt.Shard(0)], (2 * p, 3))  # type: ignore[arg-type]
        t0 = time.process_time()
        for _ in range(100):
            _from_local_checked(piece, mesh, [dt.Shard(0)], (2 * p, 3))  # type: ignore[arg-type]
        elements = sum(n for _, n in mesh.comm.sizes) // 101
        print(f"  {p:6d} ranks: {(time.process_time() - t0) * 10:.3f} ms, {elements * 8} bytes reduced per call")


if __name__ == "__main__":
    item4()
    item7()
