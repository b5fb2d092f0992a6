"""Save a tensor-parallel model at 4 ranks, load it at 2 (resharding on load).

Run: python examples/checkpoint_reshard.py [DIR]   -- it launches both phases itself:
  mpiexec -n 4 python examples/checkpoint_reshard.py DIR save
  mpiexec -n 2 python examples/checkpoint_reshard.py DIR load
DIR (default: the working directory) holds mlp.h5 and must be a directory every rank sees (on
a cluster, a shared file system; /tmp is node-local).
"""

import os
import subprocess
import sys

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt


def model(mesh: dt.DeviceMesh) -> dt.nn.Module:
    m = dt.nn.Sequential(dt.nn.Linear(8, 13, device_mesh=mesh, dtype=np.float64), dt.nn.ReLU(),
                         dt.nn.Linear(13, 5, device_mesh=mesh, dtype=np.float64))
    return dt.parallelize_module(m, mesh, {"0": dt.ColwiseParallel(), "2": dt.RowwiseParallel()})


def reference() -> dict:
    rng = np.random.default_rng(42)
    return {"0.weight": rng.standard_normal((13, 8)), "0.bias": rng.standard_normal(13),
            "2.weight": rng.standard_normal((5, 13)), "2.bias": rng.standard_normal(5)}


def main() -> None:
    directory = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()
    if len(sys.argv) <= 2:  # the driver: both phases under mpiexec
        mpiexec = os.environ.get("MPIEXEC", os.path.join(os.path.dirname(sys.executable), "mpiexec"))
        for n, phase in ((4, "save"), (2, "load")):
            # env= explicitly: os.environ is the environment Python started with, while importing
            # mpi4py above may have added Open MPI's singleton variables to the C environment,
            # which a child mpiexec must not inherit (see docs/portability.md)
            subprocess.run([*mpiexec.split(), "-n", str(n), sys.executable, __file__, directory, phase], check=True,
                           env=dict(os.environ))
        return
    phase = sys.argv[2]
    size = MPI.COMM_WORLD.Get_size()
    mesh = dt.init_device_mesh("cpu", (size,))
    m = model(mesh)
    path = os.path.join(directory, "mlp.h5")
    if phase == "save":
        m.load_state_dict(reference())
        dt.save(m.state_dict(), path)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"saved at {size} ranks: " + ", ".join(
                f"{k} {list(v.placements)} local {v.to_local().shape}" for k, v in m.state_dict().items()))
    else:
        dt.load(path, m)
        ok = all(np.array_equal(v.to_torch(), reference()[k]) for k, v in m.state_dict().items())
        x = np.ones((3, 8))
        y = m(x).to_torch()  # the plan returns a DTensor (Replicate): its complete value
        want = np.maximum(x @ reference()["0.weight"].T + reference()["0.bias"], 0) @ reference()["2.weight"].T + reference()["2.bias"]
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"loaded at {size} ranks: weights equal {ok}, forward equals NumPy {np.allclose(y, want)}")
        assert ok and np.allclose(y, want)
    mesh.free()


if __name__ == "__main__":
    main()
