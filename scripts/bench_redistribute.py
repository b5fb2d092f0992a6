#!/usr/bin/env python3
"""redistribute vs raw mpi4py collectives moving the same bytes, interleaved in one run.

Run under mpiexec (2, 3 or 4 ranks). For each transition, size (1 KB - 64 MB of float32), even
and uneven shapes, and comm path, each repeat runs the raw collectives and the redistribute in
rotation (a load change hits all alike); the medians (slowest rank) give:
  raw ms        the best raw collective into a receive buffer allocated per call
  raw-reuse ms  the best raw collective into one reused receive buffer: the floor (with MPICH a
                collective into fresh memory costs up to 2.5x one into a reused buffer)
  ratio         dtorch / raw;  /reuse  dtorch / raw-reuse;  /block  dtorch / the best blocking
                raw call into a fresh buffer (the baseline before polled forms were timed too,
                kept for comparison with earlier figures). Each ratio comes from its own
                rotation of dtorch and that one baseline (dtorch ms: the run beside the best raw).
                The redistribute is the same compiled plan called in a loop, so its buffers come
                back from comm/pool.py.
  peak/out      dtorch's peak extra memory of one call with the buffer pool emptied first
                (tracemalloc), as a multiple of the output piece: the footprint the pool keeps.
All buffers, dtorch's input and the baselines', start at a page boundary, as the library's
pooled outputs do (where the heap put them used to decide whether a copy hit this machine's
1.75x 4K-aliasing penalty). Every timed call follows an untimed call of the same case
(--caches primed): each case's own buffers and code are as warm as in a loop repeating it
(--caches shared or cold give the other conditions). With every case in one rotation, which
buffers stayed in cache moved the ratios 1.0 <-> 2.0 at 4-16 MB (the raw baselines' shared send
buffer stayed warm, dtorch's input did not), hence one rotation per pair.
Baselines (each as MPI's blocking call and as its nonblocking form polled to completion, as
the library waits; the best of them is the column's figure):
  S(0)->R, S(1)->R: Allgather of contiguous equal (padded when uneven) blocks and Allgatherv
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
from benchtools import aligned_copy, aligned_empty, timed_interleaved
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.comm import pool, set_comm_path
from dtorch_mpi.comm.deadline import wait_request
from dtorch_mpi.split import split_sizes

WORLD = MPI.COMM_WORLD


def peak_extra(fn: Callable[[], object]) -> int:
    pool.clear()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak


def shapes_for(nbytes: int, m: int, square: bool = False) -> dict[str, tuple[int, int]]:
    elems = max(nbytes // 4, m * m)
    if square:  # 64M -> 4096 x 4096, the training-loop figure
        side = max(m, int(np.sqrt(elems)) // m * m)
        return {"even": (side, side), "uneven": (side + 1, side - 1)}
    cols = 1024 if elems >= 1024 * m * 4 else max(m * 4, int(np.sqrt(elems)) // m * m)
    rows = max(m, (elems // cols) // m * m)
    return {"even": (rows, cols), "uneven": (rows + 1, cols - 1)}


def raw_cases(kind: str, shape: tuple[int, int], m: int, comm: MPI.Intracomm, fresh: bool):
    """The raw collectives moving the same bytes as ``kind`` on ``shape``, each as MPI's blocking
    call and as its nonblocking form polled to completion (what the library does; with MPICH it
    is often the faster of the two); with ``fresh`` the receive buffer is allocated per call."""
    total = shape[0] * shape[1]
    axis = 1 if kind == "S1->R" else 0
    sizes = [n * (shape[1] if axis == 0 else shape[0]) for n in split_sizes(shape[axis], m)]
    me = comm.Get_rank()
    mx = max(sizes)

    kept: dict[int, np.ndarray] = {}

    def new(n: int) -> np.ndarray:  # as the library allocates: page-aligned where it pools
        return aligned_empty(n, np.float32) if n * 4 >= pool.POOLED_FROM else np.empty(n, np.float32)

    def buf(n: int) -> np.ndarray:
        if fresh:
            return new(n)
        return kept.setdefault(n, new(n)) if n not in kept else kept[n]

    def ones(n: int) -> np.ndarray:
        return aligned_copy(np.ones(n, np.float32))

    def both(name: str, args: Callable[[], tuple[object, ...]]) -> dict[str, Callable[[], object]]:
        blocking, start = getattr(comm, name), getattr(comm, "I" + name[0].lower() + name[1:])

        def polled() -> None:
            a = args()  # held until the request completes
            wait_request(start(*a), name)

        return {name: lambda: blocking(*args()), f"I{name[0].lower()}{name[1:]}+poll": polled}

    if kind in ("S0->R", "S1->R"):
        mine = ones(sizes[me])
        padded_in = ones(mx)
        displs = list(np.cumsum([0] + sizes[:-1]))
        return both("Allgather", lambda: (padded_in, buf(mx * m))) | both(
            "Allgatherv", lambda: (mine, [buf(total), (sizes, displs), MPI.FLOAT]))
    if kind == "S0->S1":
        blk = max(1, (total // m) // m)
        a = ones(blk * m)
        return both("Alltoall", lambda: (a, buf(blk * m)))
    if kind == "P->R":
        a = ones(total)
        return both("Allreduce", lambda: (a, buf(total)))
    a = ones(mx * m)
    cases = both("Reduce_scatter_block", lambda: (a, buf(mx)))
    if len(set(sizes)) > 1:
        b = ones(total)
        cases |= both("Reduce_scatter", lambda: (b, buf(sizes[me]), sizes))
    return cases


TRANSITIONS = {
    "S0->R": ([dt.Shard(0)], [dt.Replicate()]),
    "S1->R": ([dt.Shard(1)], [dt.Replicate()]),
    "S0->S1": ([dt.Shard(0)], [dt.Shard(1)]),
    "P->R": ([dt.Partial()], [dt.Replicate()]),
    "P->S0": ([dt.Partial()], [dt.Shard(0)]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1K,64K,1M,4M,16M,64M")
    ap.add_argument("--paths", default="auto")
    ap.add_argument("--kinds", default=",".join(TRANSITIONS), help="transitions to run")
    ap.add_argument("--evenness", default="even,uneven")
    ap.add_argument("--square", action="store_true", help="square global shapes (64M: 4096 x 4096)")
    ap.add_argument("--json", default=None, help="write the rows here (rank 0)")
    ap.add_argument("--caches", default="primed", choices=("primed", "shared", "cold"),
                    help="before each timed call: an untimed call of the same case (default), nothing, or a cache flush")
    args = ap.parse_args()
    m = WORLD.Get_size()
    mesh = dt.init_device_mesh("cpu", (m,))
    comm = mesh.get_group(0)
    units = {"K": 1 << 10, "M": 1 << 20}
    rows = []
    if WORLD.Get_rank() == 0:
        print(f"ranks={m}  load average at start {os.getloadavg()[0]:.2f}  (medians over interleaved reps "
              "of the slowest rank)")
        print(f"{'transition':<10} {'path':<8} {'size':>5} {'shape':>13} {'dtorch ms':>10} {'raw ms':>9} "
              f"{'raw-reuse':>9} {'raw op':<27} {'ratio':>6} {'/reuse':>6} {'/block':>6} {'peak/out':>8}")
    for size in args.sizes.split(","):
        nbytes = int(size[:-1]) * units[size[-1]]
        reps = 21 if nbytes <= (1 << 20) else 15 if nbytes <= (16 << 20) else 7
        for evenness, shape in shapes_for(nbytes, m, args.square).items():
            if evenness not in args.evenness.split(","):
                continue
            full = np.ones(shape, np.float32)
            for kind in args.kinds.split(","):
                src, dst = TRANSITIONS[kind]
                x = dt.distribute_tensor(full, mesh, src, src_data_rank=None)
                x = dt.DTensor.from_local(aligned_copy(x.to_local()), mesh, src, shape=shape)  # as the baselines
                out_bytes = x.redistribute(placements=dst).to_local().nbytes
                raws = {f"fresh {n}": fn for n, fn in raw_cases(kind, shape, m, comm, True).items()}
                raws |= {f"reuse {n}": fn for n, fn in raw_cases(kind, shape, m, comm, False).items()}
                for path in args.paths.split(","):
                    set_comm_path(path)
                    mine = lambda: x.redistribute(placements=dst)
                    # one rotation per baseline, dtorch and that call alone: a rotation of all of
                    # them moved the ratios 1.0 <-> 2.0 at 4-16 MB by which buffers stayed in cache
                    pair = {n: timed_interleaved({"dtorch": mine, n: fn}, reps, comm, caches=args.caches)
                            for n, fn in raws.items()}

                    def quickest(keep: Callable[[str], bool]) -> str:
                        return min((n for n in pair if keep(n)), key=lambda n: pair[n][n])

                    best = quickest(lambda n: n.startswith("fresh "))
                    floor = quickest(lambda n: n.startswith("reuse "))
                    blocking = quickest(lambda n: n.startswith("fresh ") and not n.endswith("+poll"))
                    peak = WORLD.allreduce(peak_extra(mine), op=MPI.MAX) / max(out_bytes, 1)
                    row = dict(ranks=m, transition=kind, path=path, bytes=nbytes, evenness=evenness,
                               shape=shape, dtorch_ms=pair[best]["dtorch"] * 1e3, raw_ms=pair[best][best] * 1e3,
                               raw_reused_ms=pair[floor][floor] * 1e3, raw_op=best[6:],
                               ratio=pair[best]["dtorch"] / pair[best][best],
                               ratio_reused=pair[floor]["dtorch"] / pair[floor][floor],
                               ratio_blocking=pair[blocking]["dtorch"] / pair[blocking][blocking],
                               peak_over_out=peak, load=os.getloadavg()[0])
                    rows.append(row)
                    if WORLD.Get_rank() == 0:
                        print(f"{kind:<10} {path:<8} {size:>5} {shape!s:>13} {row['dtorch_ms']:>10.3f} "
                              f"{row['raw_ms']:>9.3f} {row['raw_reused_ms']:>9.3f} {best[6:]:<27} {row['ratio']:>6.2f} "
                              f"{row['ratio_reused']:>6.2f} {row['ratio_blocking']:>6.2f} {peak:>8.2f}", flush=True)
    if WORLD.Get_rank() == 0:
        print(f"load average at end {os.getloadavg()[0]:.2f}")
    if args.json and WORLD.Get_rank() == 0:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    mesh.free()


if __name__ == "__main__":
    main()
