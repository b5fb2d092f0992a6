#!/usr/bin/env python3
"""Per-call cost of small (1 KB) redistributes against the raw mpi4py call, in microseconds.

Run under mpiexec (1-4 ranks). ``bench_redistribute.py --sizes 1K`` times 20 calls in ms; at
a few microseconds per call that is too coarse and too noisy on a shared machine. Here each
case runs ``--reps`` barrier-aligned calls, dtorch and raw interleaved call by call; a
call's time is the slowest rank's, and the median is shown with the load average.

Raw baselines (the same bytes, receive buffer allocated per call as dtorch must):
  S0->R: Allgather; P->R: Allreduce; S0->S1: Alltoall; R->S0: NumPy slice copy (local).
Two more columns show the raw call in the form the library makes it (every collective is
started nonblocking and polled to completion, ``deadline.wait_request``, whatever the deadline),
and made nonblocking and waited with a plain ``Wait``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.comm.deadline import wait_request

WORLD = MPI.COMM_WORLD
N = 256  # float32 elements: 1 KB

TRANSITIONS = {
    "S0->R": ([dt.Shard(0)], [dt.Replicate()]),
    "P->R": ([dt.Partial()], [dt.Replicate()]),
    "S0->S1": ([dt.Shard(0)], [dt.Shard(1)]),
    "R->S0": ([dt.Replicate()], [dt.Shard(0)]),
}


def raw_cases(kind: str, comm: MPI.Intracomm) -> dict[str, Callable[[], object]]:
    """The blocking raw call, then (for collectives) nonblocking + the library's poll, and
    nonblocking + Wait."""
    m = comm.Get_size()
    if kind == "R->S0":
        a = np.ones((16, 16), np.float32)
        return {"raw": lambda: a[: 16 // m].copy()}
    send, count = (np.ones(N, np.float32), N) if kind == "P->R" else (np.ones(N // m, np.float32), N // m)
    out_n = N if kind in ("P->R", "S0->R") else count
    blocking, nonblocking = {
        "S0->R": (comm.Allgather, comm.Iallgather),
        "P->R": (comm.Allreduce, comm.Iallreduce),
        "S0->S1": (comm.Alltoall, comm.Ialltoall),
    }[kind]

    def polled() -> None:
        out = np.empty(out_n, np.float32)
        wait_request(nonblocking(send, out), "raw")

    def waited() -> None:
        out = np.empty(out_n, np.float32)
        nonblocking(send, out).Wait()

    return {"raw": lambda: blocking(send, np.empty(out_n, np.float32)), "raw nb+poll": polled,
            "raw nb+Wait": waited}


def timed_together(fns: dict[str, Callable[[], object]], reps: int, comm: MPI.Intracomm) -> dict[str, float]:
    """Median microseconds (slowest rank) of each function, calls interleaved."""
    for fn in fns.values():
        for _ in range(50):
            fn()
    times = {name: np.empty(reps) for name in fns}
    for i in range(reps):
        for name, fn in fns.items():
            comm.Barrier()
            start = time.perf_counter_ns()
            fn()
            times[name][i] = time.perf_counter_ns() - start
    for t in times.values():
        comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
    return {name: float(np.median(t)) / 1e3 for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=1000)
    args = ap.parse_args()
    m = WORLD.Get_size()
    mesh = dt.init_device_mesh("cpu", (m,))
    comm = mesh.get_group(0)
    full = np.ones((16, 16), np.float32)
    if WORLD.Get_rank() == 0:
        print(f"ranks={m}  1 KB float32 [16, 16]; microseconds per call, median of {args.reps} (slowest rank)")
        print(f"{'transition':<10} {'dtorch':>7} {'raw':>7} {'ratio':>6} {'above':>7} "
              f"{'raw nb+poll':>11} {'raw nb+Wait':>11}  load")
    for kind, (src, dst) in TRANSITIONS.items():
        x = dt.distribute_tensor(full, mesh, src, src_data_rank=None)
        t = timed_together({"dtorch": lambda: x.redistribute(placements=dst), **raw_cases(kind, comm)},
                           args.reps, comm)
        if WORLD.Get_rank() == 0:
            extra = " ".join(f"{t[k]:>11.2f}" if k in t else f"{'-':>11}" for k in ("raw nb+poll", "raw nb+Wait"))
            print(f"{kind:<10} {t['dtorch']:>7.2f} {t['raw']:>7.2f} {t['dtorch'] / t['raw']:>6.2f} "
                  f"{t['dtorch'] - t['raw']:>7.2f} {extra}  {os.getloadavg()[0]:.2f}", flush=True)
    mesh.free()


if __name__ == "__main__":
    main()
