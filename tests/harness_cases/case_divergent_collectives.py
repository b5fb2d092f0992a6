"""A planted SPMD divergence: rank 0 gathers while the others reduce (DTORCH_SPMD_DEBUG=1)."""

import numpy as np
import pytest
from mpi4py import MPI

import dtorch_mpi as dt


def test_divergent_collectives_are_caught() -> None:
    mesh = dt.init_device_mesh("cpu", (MPI.COMM_WORLD.Get_size(),))
    x = dt.distribute_tensor(np.arange(12.0).reshape(4, 3), mesh, [dt.Shard(0)])
    with pytest.raises(dt.SPMDDivergenceError, match="different collective calls") as err:
        if MPI.COMM_WORLD.Get_rank() == 0:
            x.redistribute(placements=[dt.Replicate()])
        else:
            x.redistribute(placements=[dt.Shard(1)])
    print(err.value)
    mesh.free()
