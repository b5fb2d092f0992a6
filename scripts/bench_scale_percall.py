"""CPU per collective call at simulated group sizes (issue 27 item 1): the MPI backend, through
its prologue, on a stand-in communicator (tests/standin_comm.py: completed requests, no data
moved), after a first call of each shape. Prints one row per route and group size.

    PYTHONPATH=. python scripts/bench_scale_percall.py [1024 4096 16384]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import numpy as np
from standin_comm import StandInComm

from dtorch_mpi.comm import Group, backend_named
from dtorch_mpi.comm.config import set_comm_path
from dtorch_mpi.split import split_sizes


def cases(p: int) -> dict[str, tuple[str, tuple, dict]]:
    """route label -> (method, args after the group, kwargs); pieces of rank 0, 2 rows each."""
    f = np.float32
    even, uneven = 2 * p, 2 * p + 3
    return {
        "Allgather (S0->R, even)": ("all_gather", (np.ones((2, 3), f), np.empty((even, 3), f), 0, split_sizes(even, p)), {}),
        "Allgatherv (S0->R, uneven)": ("all_gather", (np.ones((3, 3), f), np.empty((uneven, 3), f), 0, split_sizes(uneven, p)), {}),
        "Alltoallw (S-1->R)": ("all_gather", (np.ones((3, 2), f), np.empty((3, even), f), 1, split_sizes(even, p)), {}),
        "Alltoall (S0->S1, small)": ("all_to_all", (np.ones((1, p), f), np.empty((p, 1), f), 1, split_sizes(p, p), 0, split_sizes(p, p)), {}),
        "Alltoallv (S0->S1)": ("all_to_all", (np.ones((2, even), f), np.empty((even, 2), f), 1, split_sizes(even, p), 0, split_sizes(even, p)), {}),
        "Reduce_scatter (P->S0)": ("reduce_scatter", (np.ones((even, 3), f), np.empty((2, 3), f), 0, split_sizes(even, p), "sum"), {}),
        "Reduce_scatter (P->S1)": ("reduce_scatter", (np.ones((3, even), f), np.empty((3, 2), f), 1, split_sizes(even, p), "sum"), {}),
        "Allreduce (P->R)": ("all_reduce", (np.ones((4, 3), f), np.empty((4, 3), f), "sum"), {}),
        "Scatterv (root)": ("scatter", (np.ones((uneven, 3), f), np.empty((3, 3), f), 0, split_sizes(uneven, p), 0), {}),
    }


def per_call_us(backend, group, method: str, args: tuple, repeat: int) -> float:
    call = getattr(backend, method)
    call(group, *args)  # the first call of a shape computes and caches its layout
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(repeat):
            call(group, *args)
        best = min(best, (time.process_time() - t0) / repeat)
    return best * 1e6


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1024, 4096, 16384]
    backend = backend_named("mpi")
    for path in ("variable", "padded"):
        set_comm_path(path)
        print(f"comm path {path}: CPU per call (us), rank 0 of a stand-in group")
        print(f"{'route':30s}" + "".join(f"{p:>10d}" for p in sizes))
        rows: dict[str, list[float]] = {}
        for p in sizes:
            group = Group(StandInComm(p), 0)  # type: ignore[arg-type]
            for label, (method, args, _) in cases(p).items():
                rows.setdefault(label, []).append(per_call_us(backend, group, method, args, 200))
        for label, us in rows.items():
            print(f"{label:30s}" + "".join(f"{u:10.1f}" for u in us))
    set_comm_path("auto")


if __name__ == "__main__":
    main()
