#!/usr/bin/env python3
"""The default divergence check's cost (SPEC 5: at most 3 % of a 1 MiB redistribute; nothing
below 64 KiB): redistributes of 1 KiB, 64 KiB and 1 MiB (float32, even and uneven rows) with the
check on and off (``set_spmd_check``), interleaved in one run so a load change hits both alike.

Run under mpiexec (2-4 ranks). Each sample is ``--inner`` back-to-back calls of one case (the
slowest rank's time, ranks starting together); the medians of ``--reps`` samples give
  off us / on us   per redistribute, check off / on
  check us         on - off: what the check adds per call (a 64 KiB-or-more call carries one
                   2-int64 persistent all-reduce on the communicator's check twin, overlapping
                   a blocking call's data on MPICH, plus its fingerprint)
  cost %           (on - off) / off
Below 64 KiB no check runs: the on/off difference there is the noise floor of the measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.comm.config import set_spmd_check

WORLD = MPI.COMM_WORLD
SIZES = {"1K": 1 << 10, "64K": 64 << 10, "1M": 1 << 20}
TRANSITIONS = {"S0->R": ([dt.Shard(0)], [dt.Replicate()]), "S0->S1": ([dt.Shard(0)], [dt.Shard(1)]),
               "P->R": ([dt.Partial()], [dt.Replicate()])}


def _shape(nbytes: int, m: int, uneven: bool) -> tuple[int, int]:
    cols = 64
    rows = nbytes // 4 // cols
    return (rows + (1 if uneven and rows % m == 0 else 0), cols)


def _sample(fn: object, inner: int) -> float:
    WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(inner):
        fn()  # type: ignore[operator]
    return float(WORLD.allreduce((time.perf_counter() - start) / inner, op=MPI.MAX))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--kinds", default=",".join(TRANSITIONS))
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m = WORLD.Get_size()
    mesh = dt.init_device_mesh("cpu", (m,))
    rows = []
    for kind in args.kinds.split(","):
        src, dst = TRANSITIONS[kind]
        for label in args.sizes.split(","):
            for uneven in (False, True):
                shape = _shape(SIZES[label], m, uneven)
                full = np.ones(shape, dtype=np.float32)
                if src[0].is_partial():
                    x = dt.DTensor.from_local(full, mesh, src, shape=shape)
                else:
                    x = dt.distribute_tensor(full, mesh, src)

                def call(on: bool, x: dt.DTensor = x, dst: list[dt.Placement] = dst) -> None:
                    set_spmd_check(on)
                    x.redistribute(placements=dst)

                times: dict[bool, list[float]] = {True: [], False: []}
                for on in (True, False):
                    _sample(lambda on=on: call(on), args.inner)  # warm-up
                for rep in range(args.reps):
                    for on in ((True, False) if rep % 2 else (False, True)):
                        times[on].append(_sample(lambda on=on: call(on), args.inner))
                on_us, off_us = (statistics.median(times[k]) * 1e6 for k in (True, False))
                rows.append({"kind": kind, "size": label, "shape": shape, "uneven": uneven, "ranks": m,
                             "off_us": off_us, "on_us": on_us, "check_us": on_us - off_us,
                             "cost_pct": 100 * (on_us - off_us) / off_us})
    set_spmd_check(True)
    if WORLD.Get_rank() == 0:
        print(f"{'kind':7} {'size':4} {'shape':12} {'even':6} {'off us':>9} {'on us':>9} {'check us':>9} {'cost %':>7}")
        for r in rows:
            print(f"{r['kind']:7} {r['size']:4} {r['shape']!s:12} {'uneven' if r['uneven'] else 'even':6} "
                  f"{r['off_us']:9.1f} {r['on_us']:9.1f} {r['check_us']:9.2f} {r['cost_pct']:7.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    mesh.free()


if __name__ == "__main__":
    main()
