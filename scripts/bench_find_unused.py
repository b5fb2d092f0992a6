#!/usr/bin/env python3
"""What ``replicate(..., find_unused_parameters=True)`` costs a program that uses every parameter.

Under mpiexec. ``--layers`` float64 ``Linear(H, H)`` layers (H = ``--hidden``) under
``dtorch.replicate`` with ``bucket_bytes=--bucket-mb`` twice, without and with the flag (the
same initial parameters), a batch of ``--batch`` rows per rank sharded over the ranks. One
case = zero the gradients, forward, MSE loss, backward (the all-reduces included). Cases run
in rotation within every repeat; medians of the slowest rank. With the flag every bucket is
reduced at the end of backward (no overlap with it), after one more all-reduce (two int64 per
parameter: which parameters no rank used, and the least rank holding a ``Replicate`` gradient;
docs/training.md). BLAS runs one thread per rank (set before NumPy loads).
"""

from __future__ import annotations

# ruff: noqa: E402  (the BLAS thread count must be set before NumPy is imported)
import argparse
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np
from benchtools import process_environment, timed_interleaved
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.nn import functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16, help="rows per rank")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--reps", type=int, default=41)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    mesh = dt.init_device_mesh("cpu", (world.Get_size(),))
    bucket = int(args.bucket_mb * (1 << 20))

    def model(flag: bool) -> nn.Module:
        dt.manual_seed(0)
        layers = [nn.Linear(args.hidden, args.hidden, device_mesh=mesh, dtype=np.float64) for _ in range(args.layers)]
        return dt.replicate(nn.Sequential(*layers), mesh=mesh, bucket_bytes=bucket, find_unused_parameters=flag)

    models = {"replicate": model(False), "find_unused": model(True)}
    x = dt.distribute_tensor(np.random.default_rng(0).standard_normal((args.batch * mesh.size(), args.hidden)),
                             mesh, [dt.Shard(0)])

    def step(m: nn.Module) -> None:
        for p in m.parameters():
            p.grad = None
        F.mse_loss(m(x), x).backward()

    load = os.getloadavg()[0]
    medians = timed_interleaved({name: (lambda m=m: step(m)) for name, m in models.items()}, args.reps)
    if world.Get_rank() == 0:
        print(f"{world.Get_size()} ranks, load before {load:.2f}; {args.layers} x Linear({args.hidden}, "
              f"{args.hidden}) float64, {args.batch} rows per rank, bucket {args.bucket_mb} MB, {args.reps} reps; "
              f"environment: {process_environment()}")
        base = medians["replicate"]
        for name, t in medians.items():
            print(f"{name:>12}  {t * 1e3:8.3f} ms  {t / base:5.3f}x replicate")
        print(f"load after {os.getloadavg()[0]:.2f}")
    mesh.free()


if __name__ == "__main__":
    main()
