#!/usr/bin/env python3
"""Save time against the rank count (issue 27 item 3): ``dt.save`` of 8 small ``Shard(0)``
tensors, median of ``--reps`` (slowest rank), beside the time of one empty world ``Allreduce``
(interleaved), so the save can be read as a number of collectives at this process count, and
the CPU time a save takes on the busiest rank and on all ranks together divided by the cores: with
more ranks than cores (32 on 2 here) the wall time cannot fall below that, however few the
collectives; on a cluster, one rank per core, the CPU per rank is what grows or not with ranks.

  .venv/bin/mpiexec -n 4  .venv/bin/python scripts/bench_save_ranks.py
  .venv/bin/mpiexec -n 32 .venv/bin/python scripts/bench_save_ranks.py   # oversubscribed here

The pip stack's h5py has no MPI: the nodes write in turn (checkpoint/funnel.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt


def slowest(comm: MPI.Intracomm, seconds: float) -> float:
    return comm.allreduce(seconds, op=MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--shape", default="256,64")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    warnings.simplefilter("ignore")
    mesh = dt.init_device_mesh("cpu", (world.Get_size(),))
    shape = tuple(int(n) for n in args.shape.split(","))
    state = {f"layer{i}.w": dt.randn(*shape, device_mesh=mesh, placements=[dt.Shard(0)], dtype=np.float64)
             for i in range(args.tensors)}
    directory = tempfile.mkdtemp(prefix="bench_save_") if world.Get_rank() == 0 else None
    directory = world.bcast(directory)
    path = os.path.join(directory, "ck.h5")
    dt.save(state, path)  # warm: imports, node layout, hashers
    one = np.zeros(1, dtype=np.int64)
    saves, reduces, cpus, cpu_sums = [], [], [], []
    for _ in range(args.reps):
        world.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        dt.save(state, path)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        saves.append(slowest(world, wall))
        cpus.append(slowest(world, cpu))
        cpu_sums.append(world.allreduce(cpu, op=MPI.SUM))
        world.Barrier()
        t0 = time.perf_counter()
        world.Allreduce(MPI.IN_PLACE, one, op=MPI.MAX)
        reduces.append(slowest(world, time.perf_counter() - t0))
    if world.Get_rank() == 0:
        save, reduce = statistics.median(saves), statistics.median(reduces)
        cores = len(os.sched_getaffinity(0))
        cpu, floor = statistics.median(cpus), statistics.median(cpu_sums) / min(cores, world.Get_size())
        print(f"ranks={world.Get_size()}  {args.tensors} x {shape} float64 Shard(0)  median of {args.reps}, slowest rank  "
              f"load average {os.getloadavg()[0]:.2f}")
        print(f"  save {save * 1e3:8.1f} ms   empty Allreduce {reduce * 1e3:6.2f} ms   save / Allreduce {save / reduce:6.1f}"
              f"   CPU per rank {cpu * 1e3:6.1f} ms   all ranks' CPU / {min(cores, world.Get_size())} cores "
              f"{floor * 1e3:7.1f} ms")
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
