"""A planted skipped collective: rank 0 gathers, the others never do (DTORCH_COLLECTIVE_TIMEOUT=3)."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import dtorch_mpi as dt


def test_a_skipped_collective_times_out() -> None:
    mesh = dt.init_device_mesh("cpu", (MPI.COMM_WORLD.Get_size(),))
    x = dt.distribute_tensor(np.arange(12.0).reshape(4, 3), mesh, [dt.Shard(0)])
    if MPI.COMM_WORLD.Get_rank() == 0:
        start = time.monotonic()
        with pytest.raises(dt.CollectiveTimeoutError, match="all_gather along mesh dim 0") as err:
            x.redistribute(placements=[dt.Replicate()])
        elapsed = time.monotonic() - start
        print(f"raised after {elapsed:.1f}s: {err.value}")
        assert 3 <= elapsed < 20
        assert "case_collective_timeout.py" in str(err.value)  # the call site


def test_a_skipped_metadata_collective_times_out() -> None:
    """The library's own small collectives (from_local's metadata check, an Allreduce) have the deadline too."""
    mesh = dt.init_device_mesh("cpu", (MPI.COMM_WORLD.Get_size(),))
    if MPI.COMM_WORLD.Get_rank() == 0:
        start = time.monotonic()
        with pytest.raises(dt.CollectiveTimeoutError, match="metadata check") as err:
            dt.DTensor.from_local(np.zeros((2, 3)), mesh, [dt.Shard(0)])
        elapsed = time.monotonic() - start
        print(f"raised after {elapsed:.1f}s: {err.value}")
        assert 3 <= elapsed < 20
