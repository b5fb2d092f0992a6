"""dtorch_mpi quickstart: `mpiexec -n 4 python examples/quickstart.py [CHECKPOINT]` (what `make demo` runs).

CHECKPOINT (default: quickstart.h5 in the working directory) must be a path every rank sees:
on a cluster, a shared file system (the working directory of a job usually is; /tmp is
node-local). A directory missing on some ranks is a CheckpointError naming those ranks.

Every rank runs this same program; rank 0 prints. An uncaught exception on any rank ends the
whole job at once (dtorch_mpi's abort-on-exception hook; DTORCH_ABORT_ON_EXCEPTION=0 opts out).
"""

import os
import sys

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
say = print if rank == 0 else (lambda *a, **k: None)
mesh = dt.init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))

# 1. The contract's example (docs/contract.md): [4, 11] sharded on dim 1 (uneven: 11 = 3+3+3+2 over 4 ranks).
full = np.arange(44, dtype=np.float32).reshape(4, 11)
x = dt.distribute_tensor(full, mesh, [dt.Shard(1)])
say(f"x = {x}")
say("local shapes by rank:", mesh.get_group("tp").allgather(x.to_local().shape))
dt.visualize_sharding(x)

# 2. Explicit redistribution, and a count of what moved.
with dt.CommCounter() as moved:
    r = x.redistribute(placements=[dt.Replicate()])  # all-gather
    s = r.redistribute(placements=[dt.Shard(0)])  # local slice: zero bytes
say("communication (rank 0):\n" + moved.table())

# 3. An operator and its placement signature: (Shard(-2), Replicate()) -> Shard(-2).
w = dt.distribute_tensor(np.ones((11, 2), np.float32), mesh, [dt.Replicate()])
y = s @ w
say("s @ w:", y.placements, "==", np.allclose(y.to_torch(), full @ np.ones((11, 2))))
say(dt.signature("matmul").table().splitlines()[1])

# 4. No data moves behind your back: a mismatch raises, naming the fix.
try:
    x @ w
except dt.PlacementError as err:
    fix = str(err).splitlines()[-1].strip()
    say("PlacementError, suggested fix:", fix)  # w = w.redistribute(placements=[Shard(dim=0)])
    w = w.redistribute(placements=[dt.Shard(0)])  # a local slice: zero bytes
    say("after the fix:", (x @ w).placements, "-> to_torch:", np.allclose((x @ w).to_torch(), full @ np.ones((11, 2))))

# 5. A module loads a complete state_dict and shards it itself; save/load is parallel HDF5.
lin = dt.parallelize_module(dt.nn.Linear(11, 2 * size + 1, device_mesh=mesh), mesh, dt.ColwiseParallel())
weights = {"weight": np.ones((2 * size + 1, 11), np.float32), "bias": np.zeros(2 * size + 1, np.float32)}
lin.load_state_dict(weights)
say("weight local piece:", lin.weight.to_local().shape, "of", lin.weight.shape)
path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.getcwd(), "quickstart.h5")  # seen by every rank
dt.save(lin.state_dict(), path)
again = dt.nn.Linear(11, 2 * size + 1, device_mesh=mesh)  # replicated: resharded on load
dt.load(path, again)
reloaded = {k: again.state_dict()[k].to_torch() for k in weights}
say("saved and reloaded:", all(np.array_equal(reloaded[k], v) for k, v in weights.items()))

# 6. Gather on read (also nonblocking) and sharding-invariant random numbers.
assert np.array_equal(s.to_torch_async().wait(), full)
dt.manual_seed(0)
a = dt.randn(5, 7, device_mesh=mesh, placements=[dt.Shard(1)]).to_torch()
dt.manual_seed(0)
b = dt.randn(5, 7, device_mesh=mesh).to_torch()
say("randn identical across placements:", np.array_equal(a, b))
say("quickstart done")
if os.environ.get("DTORCH_EXAMPLE_RESULTS"):  # what tests/test_examples.py checks itself
    results = {"full": full, "matmul": y.to_torch(), "fixed": (x @ w).to_torch(), "randn_sharded": a,
               "randn_replicated": b, **{"weights." + k: v for k, v in weights.items()},
               **{"reloaded." + k: v for k, v in reloaded.items()}}  # gathered on every rank
    if rank == 0:
        np.savez(os.environ["DTORCH_EXAMPLE_RESULTS"], **results)
mesh.free()
