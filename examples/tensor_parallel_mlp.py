"""A two-layer MLP, tensor parallel: Colwise then Rowwise, loaded from a complete state_dict.

Run: mpiexec -n 4 python examples/tensor_parallel_mlp.py
The output equals the single-process NumPy reference; rank 0 prints what moved.
"""

import os

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
mesh = dt.init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))

d_in, d_hidden, d_out, batch = 16, 4 * size + 3, 8, 5  # hidden size uneven on purpose
model = dt.nn.Sequential(
    dt.nn.Linear(d_in, d_hidden, device_mesh=mesh, dtype=np.float64),
    dt.nn.ReLU(),
    dt.nn.Linear(d_hidden, d_out, device_mesh=mesh, dtype=np.float64),
)
dt.parallelize_module(model, mesh, {"0": dt.ColwiseParallel(), "2": dt.RowwiseParallel()})

# A complete state_dict, as a single-process program would have it: each rank keeps its slice.
rng = np.random.default_rng(0)
state = {
    "0.weight": rng.standard_normal((d_hidden, d_in)), "0.bias": rng.standard_normal(d_hidden),
    "2.weight": rng.standard_normal((d_out, d_hidden)), "2.bias": rng.standard_normal(d_out),
}
model.load_state_dict(state)

x = rng.standard_normal((batch, d_in))
with dt.CommCounter() as moved:
    y = model(x)

reference = np.maximum(x @ state["0.weight"].T + state["0.bias"], 0) @ state["2.weight"].T + state["2.bias"]
assert np.allclose(y.to_torch(), reference), "tensor-parallel output differs from NumPy"  # y: a Replicate DTensor
gathered = {k: v.to_torch() for k, v in model.state_dict().items()}
assert all(np.array_equal(gathered[k], state[k]) for k in state)

if rank == 0:
    print(model)
    for name, p in model.named_parameters():
        print(f"  {name:10s} global {p.shape}  {list(p.placements)}  local {p.to_local().shape}")
    print(f"output {y.shape} equals the NumPy reference: True")
    print("communication of one forward (rank 0):")
    print(moved.table())
if os.environ.get("DTORCH_EXAMPLE_RESULTS"):  # what tests/test_examples.py checks itself
    out = y.to_torch() if isinstance(y, dt.DTensor) else np.asarray(y)  # gathered on every rank
    if rank == 0:
        np.savez(os.environ["DTORCH_EXAMPLE_RESULTS"], x=x, y=out, **state,
                 **{"gathered." + k: v for k, v in gathered.items()})
mesh.free()
