#!/usr/bin/env python3
"""reduce_gradients: packed buckets vs one collective per gradient.

A model of 100 parameters of 1-64 KB each (float32), replicated (Partial gradients ->
all-reduce) or row-sharded (Partial gradients -> reduce-scatter). Each repeat runs both
variants back to back in alternating order (interleaved, so drift hits both alike); the
table shows the median of the slowest rank's time and the collective count per call.
Run: ``mpiexec -n 2 python scripts/bench_reduce_gradients.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.nn import Parameter
from dtorch_mpi.nn.utils import reduce_gradients

COMM = MPI.COMM_WORLD


def model(mesh: dt.DeviceMesh, placement: dt.Placement, n: int, seed: int) -> tuple[list[Parameter], list[dt.DTensor]]:
    """``n`` parameters of 1-64 KB (log-uniform) and a Partial gradient for each."""
    rng = np.random.default_rng(seed)
    params, grads = [], []
    for kb in np.exp(rng.uniform(np.log(1), np.log(64), n)):
        rows = max(1, int(kb * 1024 / 4 / 64))
        p = Parameter(dt.zeros(rows, 64, dtype=np.float32, device_mesh=mesh, placements=[placement]))
        local = rng.standard_normal((rows, 64)).astype(np.float32)
        grads.append(dt.DTensor.from_local(local, mesh, [dt.Partial("sum")], shape=(rows, 64)))
        params.append(p)
    return params, grads


def one_call(params: list[Parameter], grads: list[dt.DTensor], bucket_bytes: int) -> float:
    for p, g in zip(params, grads):
        p.grad = g
    COMM.Barrier()
    start = time.perf_counter()
    reduce_gradients(params, bucket_bytes=bucket_bytes)
    return COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=100)
    ap.add_argument("--reps", type=int, default=41)
    args = ap.parse_args()
    mesh = dt.init_device_mesh("cpu", (COMM.Get_size(),))
    variants = {"packed": 25 << 20, "per tensor": 0}
    rows = []
    for label, placement in (("Replicate (all-reduce)", dt.Replicate()), ("Shard(0) (reduce-scatter)", dt.Shard(0))):
        params, grads = model(mesh, placement, args.params, seed=1)
        total_kb = sum(g.to_local().nbytes for g in grads) / 1024
        counts = {}
        for name, cap in variants.items():
            for p, g in zip(params, grads):
                p.grad = g
            with dt.CommCounter() as c:
                reduce_gradients(params, bucket_bytes=cap)
            counts[name] = c.count
            one_call(params, grads, cap)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(args.reps):
            order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
            for name in order:
                times[name].append(one_call(params, grads, variants[name]))
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rows.append((label, total_kb, counts, med))
    if COMM.Get_rank() == 0:
        print(f"{COMM.Get_size()} ranks, {args.params} float32 parameters of 1-64 KB, median of {args.reps} "
              f"interleaved repeats (slowest rank)")
        print(f"{'parameters':<26} {'KB':>7} {'packed: colls':>13} {'ms':>7} {'per tensor: colls':>17} "
              f"{'ms':>7} {'speed-up':>8}")
        for label, kb, counts, med in rows:
            print(f"{label:<26} {kb:>7.0f} {counts['packed']:>13} {med['packed']:>7.3f} "
                  f"{counts['per tensor']:>17} {med['per tensor']:>7.3f} {med['per tensor'] / med['packed']:>7.2f}x")
    mesh.free()


if __name__ == "__main__":
    main()
