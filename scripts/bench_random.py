#!/usr/bin/env python3
"""RNG speed: dtorch's sharding-invariant generator vs NumPy's own, same local element count.

The generator makes only the local piece (no communication), so each process times its own;
under ``mpiexec -n 2`` two run side by side, as two ranks would, and rank 0 prints. Reports the
median time of each and their ratio, and the load average: the targets are within 2x of NumPy
from 64 K elements and at most 30 us a call on small pieces.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from dtorch_mpi import random as rnd


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 7, 1 << 9, 1 << 12, 1 << 16, 1 << 17, 1 << 20, 1 << 22],
                    help="global element counts (each process makes half: a Shard(0) piece on 2 ranks)")
    args = ap.parse_args()
    try:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    except ImportError:
        rank = 0
    say = print if rank == 0 else (lambda *a, **k: None)
    gen = np.random.default_rng(0)
    say(f"load before {os.getloadavg()[0]:.2f}")
    say(f"{'elements':>10} {'dtype':>8} {'kind':>6} {'dtorch ms':>10} {'numpy ms':>9} {'ratio':>6}")
    for n in args.sizes:
        for dtype in (np.float32, np.float64):
            for kind in ("rand", "randn"):
                dt_ = np.dtype(dtype)
                width = min(256, n // 2)
                shape = (n // width, width)
                local = (n // width // 2, width)  # half the rows: a Shard(0) piece on 2 ranks
                offset = (n // width // 2, 0)
                count = local[0] * local[1]
                reps = max(args.reps, min(1000, (1 << 18) // count))  # small pieces: more repeats
                make = rnd.uniform if kind == "rand" else rnd.normal
                ours = median_time(lambda: make(rnd.next_key(), shape, local, offset, dt_, np), reps)
                if kind == "rand":
                    ref = median_time(lambda: gen.random(count, dtype=dtype), reps)
                else:
                    ref = median_time(lambda: gen.standard_normal(count, dtype=dtype), reps)
                say(f"{count:>10} {dt_.name:>8} {kind:>6} {ours * 1e3:>10.3f} {ref * 1e3:>9.3f} "
                    f"{ours / ref:>6.2f}")
    say(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
