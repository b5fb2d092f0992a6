#!/usr/bin/env python3
"""Per-op dispatch overhead on cached signatures, side by side with the plain NumPy op.

Run under mpiexec (2 ranks is the reference case): `mpiexec -n 2 python scripts/bench_ops.py`.
Reports microseconds per call (median of several timing rounds on rank 0) for dtorch and for
NumPy on the same local piece, and the difference (the dispatch overhead). When torch is
installed, PyTorch DTensor on gloo runs the same ops in the same run.
"""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt

WORLD = MPI.COMM_WORLD


def per_call_us(fn: Callable[[], Any], number: int = 2000, rounds: int = 7) -> float:
    fn()
    return statistics.median(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e6


def torch_cases(size: int) -> dict[str, float]:
    try:
        import os

        import torch
        import torch.distributed as tdist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:
        return {}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    tdist.init_process_group("gloo", rank=WORLD.Get_rank(), world_size=WORLD.Get_size())
    mesh = init_device_mesh("cpu", (WORLD.Get_size(),))
    a = distribute_tensor(torch.ones(size, size), mesh, [Shard(0)])
    b = distribute_tensor(torch.ones(size, size), mesh, [Shard(0)])
    w = distribute_tensor(torch.ones(size, size), mesh, [Replicate()])
    out = {"add [64,64] S0+S0": per_call_us(lambda: a + b, 500),
           "matmul [64,64] S0@R": per_call_us(lambda: a @ w, 500)}
    tdist.destroy_process_group()
    return out


def main() -> None:
    mesh = dt.init_device_mesh("cpu", (WORLD.Get_size(),))
    size = 64
    full = np.ones((size, size), np.float32)
    a = dt.distribute_tensor(full, mesh, [dt.Shard(0)])
    b = dt.distribute_tensor(full, mesh, [dt.Shard(0)])
    w = dt.distribute_tensor(full, mesh, [dt.Replicate()])
    bias = dt.distribute_tensor(full[0], mesh, [dt.Replicate()])
    la, lb, lw, lbias = a.to_local(), b.to_local(), w.to_local(), bias.to_local()
    cases = [
        ("add [64,64] S0+S0", lambda: a + b, lambda: la + lb),
        ("add [64,64] S0+R[64] (broadcast)", lambda: a + bias, lambda: la + lbias),
        ("mul by scalar", lambda: a * 2.0, lambda: la * 2.0),
        ("exp", lambda: a.exp(), lambda: np.exp(la)),
        ("sum(dim=1)", lambda: a.sum(1), lambda: la.sum(1)),
        ("matmul [64,64] S0@R", lambda: a @ w, lambda: la @ lw),
        ("transpose", lambda: a.T, lambda: la.T),
    ]
    rows = []
    for name, ours, ref in cases:
        t_ours, t_ref = per_call_us(ours), per_call_us(ref)
        rows.append((name, t_ours, t_ref))
    torch_times = torch_cases(size)
    if WORLD.Get_rank() == 0:
        print(f"ranks={WORLD.Get_size()}  microseconds per call")
        print(f"{'case':<34} {'dtorch':>8} {'numpy':>8} {'overhead':>9} {'torch':>8}")
        for name, t_ours, t_ref in rows:
            t_t = torch_times.get(name)
            torch_text = f"{t_t:>8.2f}" if t_t is not None else f"{'-':>8}"
            print(f"{name:<34} {t_ours:>8.2f} {t_ref:>8.2f} {t_ours - t_ref:>9.2f} {torch_text}")
    mesh.free()


if __name__ == "__main__":
    main()
