#!/usr/bin/env python3
"""A fully-sharded training step against the data-parallel one where compute dominates.

Under mpiexec (2 ranks is the goal's case). ``--layers`` float64 ``Linear(H, H)`` layers
(H = ``--hidden``, default 1024: 8 MB of weight each), GELU between them, a batch of
``--batch`` rows per rank, MSE loss, AdamW. One step = zero the gradients, forward, backward,
optimizer step. Cases, interleaved repeat by repeat, medians of the slowest rank:

  dp        ``dtorch.replicate`` (DDP: the whole model on every rank, gradients all-reduced
            in buckets during backward)
  fsdp      ``fully_shard`` per layer and on the root (ZeRO-3: parameters gathered per unit,
            gradients reduce-scattered, AdamW on the shards)
  fsdp_keep the same with ``reshard_after_forward=False`` (ZeRO-2-like: no re-gather in
            backward)
  fsdp_lean ``backward_prefetch=False``: no prefetch in backward, each reduce-scatter
            finished before the next unit's backward (the least memory)

and, where torch is installed (``PYTHONPATH`` may point at it), the same model in PyTorch on
gloo over the same ranks: ``torch dp`` (DistributedDataParallel) and ``torch fsdp2``
(``torch.distributed.fsdp.fully_shard``); a case that fails prints how. Prints each case's
median, its ratio to dp, and the process environment (``GLIBC_TUNABLES``, ``LD_PRELOAD``:
glibc hands large freed blocks back to the system, so every fresh MB-sized array faults its
pages again, docs/performance.md, "Page faults"; and UCX's rendezvous threshold,
dtorch_mpi/ucx.py).
"""

from __future__ import annotations

# ruff: noqa: E402  (the BLAS thread count must be set before NumPy is imported)
import argparse
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one core per rank
    os.environ.setdefault(_var, "1")
from collections.abc import Callable
from typing import Any

import numpy as np
from benchtools import process_environment, timed_interleaved
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.nn import functional as F

WORLD = MPI.COMM_WORLD
S0 = dt.Shard(0)
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


class Stack(nn.Module):
    def __init__(self, layers: int, width: int, mesh: dt.DeviceMesh) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width, device_mesh=mesh, dtype=np.float64)
                                      for _ in range(layers)])

    def forward(self, x: dt.DTensor) -> dt.DTensor:
        for layer in self.layers:
            x = F.gelu(layer(x), "tanh")
        return x


def dtorch_step(plan: str, mesh: dt.DeviceMesh, layers: int, width: int, batch: int) -> Callable[[], object]:
    dt.manual_seed(0)
    model = Stack(layers, width, mesh)
    if plan == "dp":
        dt.replicate(model, mesh=mesh)
    else:
        keep, prefetch = plan == "fsdp_keep", plan != "fsdp_lean"
        for layer in model.layers:
            dt.fully_shard(layer, mesh=mesh, reshard_after_forward=not keep, backward_prefetch=prefetch)
        dt.fully_shard(model, mesh=mesh, reshard_after_forward=not keep, backward_prefetch=prefetch)
    opt = dt.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    rng = np.random.default_rng(1)
    x = dt.distribute_tensor(rng.standard_normal((batch * WORLD.size, width)), mesh, [S0])
    y = dt.distribute_tensor(rng.standard_normal((batch * WORLD.size, width)), mesh, [S0])

    def step() -> object:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def torch_steps(layers: int, width: int, batch: int) -> tuple[dict[str, Callable[[], object]], str]:
    """PyTorch's DDP and FSDP2 steps of the same model on gloo ({} and why when unavailable)."""
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        return {}, "torch is not installed"
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29549")
    tdist.init_process_group("gloo", rank=WORLD.rank, world_size=WORLD.size)
    rng = np.random.default_rng(1)
    full_x = rng.standard_normal((batch * WORLD.size, width))
    full_y = rng.standard_normal((batch * WORLD.size, width))
    rows = slice(WORLD.rank * batch, (WORLD.rank + 1) * batch)
    x, y = torch.from_numpy(full_x[rows].copy()), torch.from_numpy(full_y[rows].copy())

    def model() -> Any:
        torch.manual_seed(0)
        mods: list[Any] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width, dtype=torch.float64), torch.nn.GELU("tanh")]
        return torch.nn.Sequential(*mods)

    def stepper(m: Any) -> Callable[[], object]:
        opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

        def step() -> object:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            return loss

        return step

    steps: dict[str, Callable[[], object]] = {}
    notes = [f"torch {torch.__version__}"]
    steps["torch dp"] = stepper(torch.nn.parallel.DistributedDataParallel(model()))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD.size,))
        m = model()
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        fsdp2 = stepper(m)
        fsdp2()  # fails here if gloo lacks a collective FSDP2 needs
        steps["torch fsdp2"] = fsdp2
    except Exception as exc:  # report how it fails (pytorch#132471: gloo lacks reduce_scatter)
        notes.append(f"torch fsdp2 failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    return steps, "; ".join(notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512, help="rows per rank")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    mesh = dt.init_device_mesh("cpu", (WORLD.size,))
    cases = {plan: dtorch_step(plan, mesh, args.layers, args.hidden, args.batch)
             for plan in ("dp", "fsdp", "fsdp_keep", "fsdp_lean")}
    note = "torch skipped (--no-torch)"
    if not args.no_torch:
        more, note = torch_steps(args.layers, args.hidden, args.batch)
        cases.update(more)
    if WORLD.rank == 0:
        print(f"{WORLD.size} ranks, {os.cpu_count()} cores, load before {os.getloadavg()[0]:.2f}; {args.layers} x "
              f"Linear({args.hidden}, {args.hidden}) float64, {args.batch} rows per rank, AdamW, {args.reps} reps; "
              f"environment: {process_environment()}; {note}")
    med = timed_interleaved(cases, args.reps, WORLD)
    if WORLD.rank == 0:
        for name, t in med.items():
            print(f"  {name:>12} {t * 1e3:8.2f} ms   {t / med['dp']:5.2f}x dp")
        print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
