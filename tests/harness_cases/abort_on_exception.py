"""A planted crash (run as a plain script by tests/test_harness.py, not by pytest): rank 1 raises
while rank 0 waits in a collective. The abort-on-exception hook must end the whole job."""

import sys
import time

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt

mesh = dt.init_device_mesh("cpu", (MPI.COMM_WORLD.Get_size(),))
x = dt.distribute_tensor(np.arange(8.0), mesh, [dt.Shard(0)])
if MPI.COMM_WORLD.Get_rank() == 1:
    print(f"RAISING AT {time.time():.6f}", flush=True)
    raise RuntimeError("planted failure on rank 1")
x.to_torch()  # rank 0 waits here for rank 1, which never comes
print("rank 0 was not stopped", flush=True)
sys.exit(3)
