#!/usr/bin/env python3
"""dtorch_mpi vs PyTorch DTensor (gloo), the same cases side by side in one run.

Run in an environment with torch: `mpiexec -n 2 python scripts/bench_vs_torch.py`
(torch 2.13.0 CPU: `pip install torch==2.13.0`). Times are medians of the slowest rank;
ratio < 1 means dtorch_mpi is faster.
"""

from __future__ import annotations

import os

import numpy as np
from benchtools import timed
from mpi4py import MPI

import dtorch_mpi as dt

WORLD = MPI.COMM_WORLD


def main() -> None:
    import torch
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh as t_mesh
    from torch.distributed.tensor import DTensor as TDTensor
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor as t_distribute

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    m, rank = WORLD.Get_size(), WORLD.Get_rank()
    tdist.init_process_group("gloo", rank=rank, world_size=m)
    tm = t_mesh("cpu", (m,))
    dm = dt.init_device_mesh("cpu", (m,))
    ours_p = {"S0": [dt.Shard(0)], "S1": [dt.Shard(1)], "R": [dt.Replicate()], "P": [dt.Partial()]}
    theirs_p = {"S0": [TShard(0)], "S1": [TShard(1)], "R": [TReplicate()], "P": [TPartial()]}
    rows = []
    for shape in ((1024, 1024), (4096, 4096), (4099, 1023)):
        full = np.ones(shape, np.float32)
        tfull = torch.ones(shape)
        reps = 10 if shape[0] * shape[1] <= 1 << 22 else 4
        for src, dst in (("S0", "R"), ("S1", "R"), ("S0", "S1"), ("P", "R"), ("P", "S0")):
            if src == "P":
                x = dt.DTensor.from_local(full.copy(), dm, ours_p["P"], shape=shape)
                tx = TDTensor.from_local(tfull.clone(), tm, theirs_p["P"], run_check=False)
            else:
                x = dt.distribute_tensor(full, dm, ours_p[src], src_data_rank=None)
                tx = t_distribute(tfull, tm, theirs_p[src])
            ours = timed(lambda: x.redistribute(placements=ours_p[dst]), reps)
            theirs = timed(lambda: tx.redistribute(tm, theirs_p[dst]).to_local(), reps)
            rows.append((f"redistribute {src}->{dst} {shape[0]}x{shape[1]}", ours, theirs))
    a = dt.distribute_tensor(np.ones((64, 64), np.float32), dm, [dt.Shard(0)], src_data_rank=None)
    ta = t_distribute(torch.ones(64, 64), tm, [TShard(0)])
    rows.append(("add [64,64] S0+S0", timed(lambda: a + a, 2000), timed(lambda: ta + ta, 2000)))
    w = dt.distribute_tensor(np.ones((1024, 1024), np.float32), dm, [dt.Replicate()], src_data_rank=None)
    x = dt.distribute_tensor(np.ones((1024, 1024), np.float32), dm, [dt.Shard(0)], src_data_rank=None)
    tw = t_distribute(torch.ones(1024, 1024), tm, [TReplicate()])
    tx = t_distribute(torch.ones(1024, 1024), tm, [TShard(0)])
    rows.append(("matmul S0@R 1024x1024", timed(lambda: x @ w, 10), timed(lambda: tx @ tw, 10)))
    if rank == 0:
        print(f"ranks={m}  torch {torch.__version__} (gloo, 1 thread)  times in ms, median of the slowest rank")
        print(f"{'case':<36} {'dtorch':>9} {'torch':>9} {'ratio':>6}")
        for name, ours, theirs in rows:
            print(f"{name:<36} {ours * 1e3:>9.3f} {theirs * 1e3:>9.3f} {ours / theirs:>6.2f}")
    dm.free()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
