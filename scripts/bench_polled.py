#!/usr/bin/env python3
"""How long does a nonblocking MPI call take when it is only polled now and then? (raw mpi4py)

Under mpiexec, 2 ranks (one per host to measure a network). Each case starts one call, then a
thread tests it every ``--intervals`` microseconds (0: without pause) while the main thread
sleeps 30 ms, as the progress thread (dtorch_mpi/comm/progress.py) polls collectives that run
beside compute; the time is from the start until the thread sees it complete. ``blocking`` is the
same call made blocking. Ops: ``allreduce`` (in place of a float64 vector), ``exchange`` (a
send and a receive with the other rank). Medians over ``--reps`` runs; rank 0 prints.

A transport that moves data only when a call polls it shows here: over TCP, UCX sends messages
below its rendezvous threshold as 64 KiB fragments that each wait for the receiver's poll
(dtorch_mpi/ucx.py; compare ``DTORCH_UCX_RNDV_THRESH=off``). The library is imported first, so
its choice of ``UCX_RNDV_THRESH`` applies, and the header says what it was.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable

import dtorch_mpi  # noqa: F401  (before mpi4py starts MPI: the import sets UCX_RNDV_THRESH)

# isort: split
import numpy as np
from mpi4py import MPI

from dtorch_mpi import ucx

comm = MPI.COMM_WORLD


def starter(op: str, a: np.ndarray, b: np.ndarray) -> tuple[Callable[[], Callable[[], bool]], Callable[[], None]]:
    """(start the nonblocking call, returning its test; make the blocking call)."""
    peer = (comm.rank + 1) % comm.size
    source = (comm.rank - 1) % comm.size
    if op == "allreduce":
        def start() -> Callable[[], bool]:
            request = comm.Iallreduce(MPI.IN_PLACE, a)
            return request.Test

        return start, lambda: comm.Allreduce(MPI.IN_PLACE, a)

    def start_exchange() -> Callable[[], bool]:
        requests = [comm.Irecv(b, source=source, tag=7), comm.Isend(a, dest=peer, tag=7)]
        return lambda: MPI.Request.Testall(requests)

    return start_exchange, lambda: comm.Sendrecv(a, peer, 7, b, source, 7)


def polled(start: Callable[[], Callable[[], bool]], interval_us: float) -> float:
    comm.Barrier()
    began = time.perf_counter()
    test = start()
    finished: list[float] = []

    def poll() -> None:
        while not test():
            if interval_us:
                time.sleep(interval_us * 1e-6)
        finished.append(time.perf_counter() - began)

    thread = threading.Thread(target=poll)
    thread.start()
    time.sleep(0.030)  # the compute that leaves the core free
    thread.join()
    return comm.allreduce(finished[0], op=MPI.MAX)


def blocking(call: Callable[[], None]) -> float:
    comm.Barrier()
    began = time.perf_counter()
    call()
    return comm.allreduce(time.perf_counter() - began, op=MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", default="0.5,2,8,24", help="message sizes in MB (float64 vectors)")
    ap.add_argument("--ops", default="exchange,allreduce")
    ap.add_argument("--intervals", default="0,50,200", help="poll intervals in microseconds")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    intervals = [float(x) for x in args.intervals.split(",")]
    if comm.rank == 0:
        hosts = len(set(comm.allgather(MPI.Get_processor_name())))
        print(f"{comm.size} ranks on {hosts} host(s); UCX_RNDV_THRESH="
              f"{os.environ.get(ucx.VARIABLE, 'UCX own')} ({ucx.state}); load {os.getloadavg()[0]:.2f}")
        print(f"{'op':>10} {'MB':>6} {'blocking':>9} " + " ".join(f"{f'poll {x:g}us':>11}" for x in intervals))
    else:
        comm.allgather(MPI.Get_processor_name())
    for op in args.ops.split(","):
        for mb in (float(x) for x in args.mb.split(",")):
            a = np.ones(int(mb * 2**20) // 8)
            b = np.empty_like(a)
            start, call = starter(op, a, b)
            blocking(call), polled(start, 0)  # warm up: connections, registrations
            times: dict[str, list[float]] = {"blocking": []} | {str(x): [] for x in intervals}
            for _ in range(args.reps):  # interleaved
                times["blocking"].append(blocking(call))
                for x in intervals:
                    times[str(x)].append(polled(start, x))
            if comm.rank == 0:
                row = " ".join(f"{statistics.median(times[str(x)]) * 1e3:11.2f}" for x in intervals)
                print(f"{op:>10} {mb:6g} {statistics.median(times['blocking']) * 1e3:9.2f} {row}", flush=True)


if __name__ == "__main__":
    main()
