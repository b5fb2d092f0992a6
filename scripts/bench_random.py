#!/usr/bin/env python3
"""RNG speed: dtorch's sharding-invariant generator vs NumPy's own, same local element count.

Single process (the generator makes only the local piece; no communication). Reports the
median time of each and their ratio; the target is within 2x of NumPy.
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args()
    gen = np.random.default_rng(0)
    print(f"{'elements':>10} {'dtype':>8} {'kind':>6} {'dtorch ms':>10} {'numpy ms':>9} {'ratio':>6}")
    for n in (1 << 12, 1 << 16, 1 << 17, 1 << 20, 1 << 22):
        for dtype in (np.float32, np.float64):
            for kind in ("rand", "randn"):
                dt_ = np.dtype(dtype)
                shape = (n // 256, 256)
                local = (n // 512, 256)  # half the rows: a Shard(0) piece on 2 ranks
                offset = (n // 512, 0)
                count = local[0] * local[1]
                make = rnd.uniform if kind == "rand" else rnd.normal
                ours = median_time(lambda: make(rnd.next_key(), shape, local, offset, dt_, np), args.reps)
                if kind == "rand":
                    ref = median_time(lambda: gen.random(count, dtype=dtype), args.reps)
                else:
                    ref = median_time(lambda: gen.standard_normal(count, dtype=dtype), args.reps)
                print(f"{count:>10} {dt_.name:>8} {kind:>6} {ours * 1e3:>10.3f} {ref * 1e3:>9.3f} "
                      f"{ours / ref:>6.2f}")


if __name__ == "__main__":
    main()
