#!/usr/bin/env python3
"""What autograd costs: forward dispatch with and without recording, and the peak memory of a
forward + backward of a 10-op chain relative to its input.

Run under mpiexec (2 ranks is the reference case): `mpiexec -n 2 python scripts/bench_autograd.py`.
Dispatch: microseconds per call on cached signatures (median of interleaved rounds on rank 0)
for NumPy alone, dtorch on tensors that do not require grad, the same under ``no_grad()``, and
on tensors that require grad (recording a node). Memory: tracemalloc peak over the input's
local bytes for an elementwise chain (forward + backward), on rank 0.
"""

from __future__ import annotations

import statistics
import timeit
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt

WORLD = MPI.COMM_WORLD


def interleaved_us(cases: dict[str, Callable[[], Any]], number: int = 2000, rounds: int = 9) -> dict[str, float]:
    """Median microseconds per call, the cases timed in turn within every round."""
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            samples[name].append(timeit.timeit(fn, number=number) / number * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def chain(x: dt.DTensor) -> dt.DTensor:
    """Ten elementwise ops of the kinds a model uses (some save their input or output)."""
    y = x * 2.0
    y = y + 1.0
    y = y.tanh()
    y = y * x
    y = y.exp()
    y = y - 1.0
    y = y.relu()
    y = y / 3.0
    y = y.sigmoid()
    return y.sum()


def main() -> None:
    mesh = dt.init_device_mesh("cpu", (WORLD.Get_size(),))
    full = np.ones((64, 64), np.float32)
    a = dt.distribute_tensor(full, mesh, [dt.Shard(0)])
    b = dt.distribute_tensor(full, mesh, [dt.Shard(0)])
    ga = dt.distribute_tensor(full, mesh, [dt.Shard(0)]).requires_grad_()
    la, lb = a.to_local(), b.to_local()

    def no_grad_add() -> Any:
        with dt.no_grad():
            return ga + b

    times = interleaved_us({
        "numpy add": lambda: la + lb,
        "dtorch add (no tensor requires grad)": lambda: a + b,
        "dtorch add (requires grad, under no_grad)": no_grad_add,
        "dtorch add (requires grad: records a node)": lambda: ga + b,
    })

    n = 1 << 20
    x = dt.distribute_tensor(np.random.default_rng(0).standard_normal(n), mesh, [dt.Shard(0)]).requires_grad_()
    input_bytes = x.to_local().nbytes
    tracemalloc.start()
    chain(x).backward()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    tracemalloc.start()
    with dt.no_grad():
        chain(x)
    peak_forward = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()

    if WORLD.Get_rank() == 0:
        base = times["dtorch add (no tensor requires grad)"]
        print(f"dispatch at {WORLD.Get_size()} ranks, [64,64] float32 Shard(0) + Shard(0):")
        for name, us in times.items():
            print(f"  {name:45s} {us:7.2f} us  ({us / base:4.2f}x the no-grad dtorch call)")
        print(f"10-op chain over {input_bytes / 2**20:.1f} MiB per rank: peak forward+backward "
              f"{peak / input_bytes:.1f}x the input piece (forward alone under no_grad "
              f"{peak_forward / input_bytes:.1f}x)")
    mesh.free()


if __name__ == "__main__":
    main()
