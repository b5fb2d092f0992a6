#!/usr/bin/env python3
"""The default divergence check's cost (SPEC 5: at most 3 % of a 1 MiB redistribute; nothing
below 64 KiB): redistributes of 1 KiB, 64 KiB and 1 MiB (float32, even and uneven rows) with the
check on and off (``set_spmd_check``), interleaved in one run so a load change hits both alike.

Run under mpiexec (2-4 ranks). Each sample is ``--inner`` back-to-back calls of one case (the
slowest rank's time, ranks starting together); the medians of ``--reps`` samples give
  off us / on us   per redistribute, check off / on (the default form: on one node, the
                   shared-memory board)
  check us         on - off: what the check adds per call (a 64 KiB-or-more call posts its
                   fingerprint and reads the others' after its data, which moves meanwhile on
                   MPICH)
  cost %           (on - off) / off
  allreduce %      the same with DTORCH_SPMD_CHECK_FORM=allreduce (a second mesh: the form of
                   groups across nodes, one 2-int64 persistent all-reduce per check),
                   interleaved with the others
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
from dtorch_mpi.comm.config import set_check_form, set_spmd_check

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
    set_check_form("allreduce")
    mesh_allreduce = dt.init_device_mesh("cpu", (m,))
    set_check_form("auto")
    rows = []
    for kind in args.kinds.split(","):
        src, dst = TRANSITIONS[kind]
        for label in args.sizes.split(","):
            for uneven in (False, True):
                shape = _shape(SIZES[label], m, uneven)
                full = np.ones(shape, dtype=np.float32)
                tensors = {}
                for form, on_mesh in (("board", mesh), ("allreduce", mesh_allreduce)):
                    if src[0].is_partial():
                        tensors[form] = dt.DTensor.from_local(full, on_mesh, src, shape=shape)
                    else:
                        tensors[form] = dt.distribute_tensor(full, on_mesh, src)

                def call(case: str, dst: list[dt.Placement] = dst) -> None:
                    set_spmd_check(case != "off")
                    tensors["allreduce" if case == "allreduce" else "board"].redistribute(placements=dst)

                cases = ("off", "on", "allreduce")
                times: dict[str, list[float]] = {c: [] for c in cases}
                for case in cases:
                    _sample(lambda case=case: call(case), args.inner)  # warm-up
                for rep in range(args.reps):
                    for case in cases[rep % 3:] + cases[:rep % 3]:  # each case first in turn
                        times[case].append(_sample(lambda case=case: call(case), args.inner))
                off_us, on_us, allreduce_us = (statistics.median(times[c]) * 1e6 for c in cases)
                rows.append({"kind": kind, "size": label, "shape": shape, "uneven": uneven, "ranks": m,
                             "off_us": off_us, "on_us": on_us, "check_us": on_us - off_us,
                             "cost_pct": 100 * (on_us - off_us) / off_us,
                             "allreduce_us": allreduce_us,
                             "allreduce_pct": 100 * (allreduce_us - off_us) / off_us})
    set_spmd_check(True)
    if WORLD.Get_rank() == 0:
        print(f"{'kind':7} {'size':4} {'shape':12} {'even':6} {'off us':>9} {'on us':>9} {'check us':>9} "
              f"{'cost %':>7} {'allreduce %':>11}")
        for r in rows:
            print(f"{r['kind']:7} {r['size']:4} {r['shape']!s:12} {'uneven' if r['uneven'] else 'even':6} "
                  f"{r['off_us']:9.1f} {r['on_us']:9.1f} {r['check_us']:9.2f} {r['cost_pct']:7.2f} "
                  f"{r['allreduce_pct']:11.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    mesh.free()
    mesh_allreduce.free()


if __name__ == "__main__":
    main()
