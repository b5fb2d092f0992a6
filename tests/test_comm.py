"""The MPI backend's six collectives, called directly, blocking and nonblocking, on the run's
collective path (scripts/run_tests.py runs every path), with uneven and empty pieces."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import RANK, SIZE, Checker

import dtorch_mpi as dt
from dtorch_mpi.comm import Group, MPIBackend
from dtorch_mpi.split import split_offsets, split_sizes

BACKEND = MPIBackend()


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
        # all-to-all: Shard(0) -> Shard(1) of a [rows, 2*SIZE+1] array
        wide = np.arange(rows * (2 * SIZE + 1), dtype=np.float32).reshape(rows, 2 * SIZE + 1)
        rsizes, mine_rows = pieces(wide, 0)
        csizes, mine_cols = pieces(wide, 1)
        got = BACKEND.all_to_all(group, mine_rows, np.empty_like(mine_cols), 1, csizes, 0, rsizes, async_op).wait()
        check.equal(got, mine_cols, f"all_to_all rows={rows}")
    check.done()
