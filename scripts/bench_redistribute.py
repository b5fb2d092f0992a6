#!/usr/bin/env python3
"""redistribute vs raw mpi4py collectives moving the same bytes, side by side in one run.

Run under mpiexec (2 or 4 ranks). For each transition, size (1 KB - 64 MB of float32), even
and uneven shapes, and both comm paths, prints the median time (slowest rank) of dtorch and
of the best raw collective, their ratio, and dtorch's peak extra memory as a multiple of the
output piece (tracemalloc). Each raw collective allocates its receive buffer per call, as
dtorch must (it returns a new array): with MPICH, a collective into a freshly allocated
buffer costs up to 2.5x one into a reused buffer at 4-16 MB, so ``raw-pre ms`` (reused
receive buffer, the unreachable floor) is shown too. Baselines:
  S(0)->R, S(1)->R: Allgather of contiguous equal blocks and Allgatherv (best of the two)
  S(0)->S(1): Alltoall of contiguous blocks of the same bytes
  P->R: Allreduce;  P->S(0): Reduce_scatter_block (and Reduce_scatter when uneven)
"""

from __future__ import annotations

import argparse
import json
import os
import tracemalloc
from collections.abc import Callable

import numpy as np
from benchtools import timed
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.comm import set_comm_path
from dtorch_mpi.split import split_sizes

WORLD = MPI.COMM_WORLD


def peak_extra(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak


def shapes_for(nbytes: int, m: int) -> dict[str, tuple[int, int]]:
    elems = max(nbytes // 4, m * m)
    cols = 1024 if elems >= 1024 * m * 4 else max(m * 4, int(np.sqrt(elems)) // m * m)
    rows = max(m, (elems // cols) // m * m)
    return {"even": (rows, cols), "uneven": (rows + 1, cols - 1)}


def raw_cases(kind: str, shape: tuple[int, int], m: int, comm: MPI.Intracomm, fresh: bool):
    """The raw collectives moving the same bytes as ``kind`` on ``shape``; with ``fresh`` the
    receive buffer is allocated per call."""
    total = shape[0] * shape[1]
    axis = 1 if kind == "S1->R" else 0
    sizes = [n * (shape[1] if axis == 0 else shape[0]) for n in split_sizes(shape[axis], m)]
    me = comm.Get_rank()
    mx = max(sizes)

    def buf(n: int, keep: dict = {}) -> np.ndarray:
        if fresh:
            return np.empty(n, np.float32)
        if keep.get("n") != n:
            keep["n"], keep["a"] = n, np.empty(n, np.float32)
        return keep["a"]

    if kind in ("S0->R", "S1->R"):
        mine = np.ones(sizes[me], np.float32)
        padded_in = np.ones(mx, np.float32)
        displs = list(np.cumsum([0] + sizes[:-1]))
        return {
            "Allgather": lambda: comm.Allgather(padded_in, buf(mx * m)),
            "Allgatherv": lambda: comm.Allgatherv(mine, [buf(total), (sizes, displs), MPI.FLOAT]),
        }
    if kind == "S0->S1":
        blk = max(1, (total // m) // m)
        a = np.ones(blk * m, np.float32)
        return {"Alltoall": lambda: comm.Alltoall(a, buf(blk * m))}
    if kind == "P->R":
        a = np.ones(total, np.float32)
        return {"Allreduce": lambda: comm.Allreduce(a, buf(total))}
    a = np.ones(mx * m, np.float32)
    cases = {"Reduce_scatter_block": lambda: comm.Reduce_scatter_block(a, buf(mx))}
    if len(set(sizes)) > 1:
        b = np.ones(total, np.float32)
        cases["Reduce_scatter"] = lambda: comm.Reduce_scatter(b, buf(sizes[me]), sizes)
    return cases


TRANSITIONS = {
    "S0->R": ([dt.Shard(0)], [dt.Replicate()]),
    "S1->R": ([dt.Shard(1)], [dt.Replicate()]),
    "S0->S1": ([dt.Shard(0)], [dt.Shard(1)]),
    "P->R": ([dt.Partial()], [dt.Replicate()]),
    "P->S0": ([dt.Partial()], [dt.Shard(0)]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1K,64K,1M,4M,16M,64M")
    ap.add_argument("--paths", default="variable,padded")
    ap.add_argument("--json", default=None, help="write the rows here (rank 0)")
    args = ap.parse_args()
    m = WORLD.Get_size()
    mesh = dt.init_device_mesh("cpu", (m,))
    comm = mesh.get_group(0)
    units = {"K": 1 << 10, "M": 1 << 20}
    rows = []
    if WORLD.Get_rank() == 0:
        print(f"ranks={m}  (times: median over reps of the slowest rank)")
        print(f"{'transition':<8} {'path':<8} {'size':>5} {'shape':>13} {'dtorch ms':>10} "
              f"{'raw ms':>9} {'raw-pre ms':>9} {'raw op':<21} {'ratio':>6} {'peak/out':>8}")
    for size in args.sizes.split(","):
        nbytes = int(size[:-1]) * units[size[-1]]
        reps = 20 if nbytes <= (1 << 20) else 7 if nbytes <= (16 << 20) else 4
        for evenness, shape in shapes_for(nbytes, m).items():
            full = np.ones(shape, np.float32)
            for kind, (src, dst) in TRANSITIONS.items():
                raws = {name: timed(fn, reps, comm)
                        for name, fn in raw_cases(kind, shape, m, comm, True).items()}
                best_name = min(raws, key=raws.__getitem__)
                pre = min(timed(fn, reps, comm)
                          for fn in raw_cases(kind, shape, m, comm, False).values())
                x = dt.distribute_tensor(full, mesh, src, src_data_rank=None)
                out_bytes = x.redistribute(placements=dst).to_local().nbytes
                for path in args.paths.split(","):
                    set_comm_path(path)
                    t = timed(lambda: x.redistribute(placements=dst), reps, comm)
                    peak = WORLD.allreduce(peak_extra(lambda: x.redistribute(placements=dst)), op=MPI.MAX)
                    ratio = t / raws[best_name]
                    row = dict(ranks=m, transition=kind, path=path, bytes=nbytes, evenness=evenness,
                               shape=shape, dtorch_ms=t * 1e3, raw_ms=raws[best_name] * 1e3,
                               raw_prealloc_ms=pre * 1e3, raw_op=best_name, ratio=ratio,
                               peak_over_out=peak / max(out_bytes, 1))
                    rows.append(row)
                    if WORLD.Get_rank() == 0:
                        print(f"{kind:<8} {path:<8} {size:>5} {shape!s:>13} {t * 1e3:>10.3f} "
                              f"{raws[best_name] * 1e3:>9.3f} {pre * 1e3:>9.3f} {best_name:<21} {ratio:>6.2f} "
                              f"{peak / max(out_bytes, 1):>8.2f}", flush=True)
    if args.json and WORLD.Get_rank() == 0:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    mesh.free()


if __name__ == "__main__":
    main()
