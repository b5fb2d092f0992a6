"""dtorch_mpi quickstart: run with `mpiexec -n 4 python examples/quickstart.py` (or `make demo`).

Every rank runs this same program; rank 0 prints.
"""

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def say(*args: object) -> None:
    if rank == 0:
        print(*args, flush=True)


mesh = dt.init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))

# The SPEC's example: a [4, 11] tensor sharded along dim 1 over the ranks (uneven: 11 = 3+3+3+2).
full = np.arange(44, dtype=np.float32).reshape(4, 11)
x = dt.distribute_tensor(full, mesh, [dt.Shard(1)])
shapes = mesh.get_group("tp").allgather(x.to_local().shape)
say(f"x = {x}")
say(f"local shapes by rank: {shapes}")
say("split rule:", [dt.compute_local_shape_and_offset((4, 11), mesh, [dt.Shard(1)], coordinate=(i,))
                    for i in range(size)])

# Explicit redistribution, with a count of what moved.
with dt.CommCounter() as moved:
    y = x.redistribute(placements=[dt.Shard(0)])  # all-to-all
    r = y.redistribute(placements=[dt.Replicate()])  # all-gather
    s = r.redistribute(placements=[dt.Shard(1)])  # local slice: zero bytes
say("plan S(1) -> R:", list(dt.plan_redistribute((dt.Shard(1),), (dt.Replicate(),))))
say("communication on rank 0:\n" + moved.table())

# Partial values: each rank holds a term; the value is their sum.
p = dt.DTensor.from_local(np.full((2, 3), float(rank)), mesh, [dt.Partial("sum")])
say("Partial sum of ranks:", p.to_torch()[0, 0], "=", sum(range(size)))

# Sharding-invariant random numbers: the same values whatever the placements.
dt.manual_seed(0)
a = dt.randn(5, 7, device_mesh=mesh, placements=[dt.Shard(1)]).to_torch()
dt.manual_seed(0)
b = dt.randn(5, 7, device_mesh=mesh, placements=[dt.Replicate()]).to_torch()
say("randn identical across placements:", bool(np.array_equal(a, b)))

# Gather on read, also asynchronously.
handle = s.to_torch_async()
assert np.array_equal(handle.wait(), full) and np.array_equal(x.to_torch(), full)
say("to_torch() equals the original: True")

mesh.free()
