"""fully_shard's per-rank footprint and traffic against ZeRO-3's formulas (no timing).

Run: mpiexec -n N python scripts/bench_fsdp.py [--layers 8] [--width 256]

A stack of ``layers`` equal float64 ``Linear(width, width)`` layers, one ``fully_shard``
unit each, AdamW, batch ``Shard(0)``. Per rank it prints:
  state   bytes held between steps: parameter + gradient + optimizer-state pieces (formula
          (2 + 2) Psi / N for float64 AdamW: parameters, gradients, two moments)
  step    the resident-memory peak of one step above the resident memory before it
          (``/proc/self/clear_refs`` resets ``VmHWM``): gathered units, the gradients in
          flight and activations (formula about two units' parameters and gradients)
  comm    all-gather bytes received and reduce-scatter bytes sent (2 (N-1)/N Psi, (N-1)/N Psi)
"""

from __future__ import annotations

import argparse
import gc

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.nn import functional as F


class Stack(nn.Module):
    def __init__(self, layers: int, width: int, mesh: dt.DeviceMesh) -> None:
        super().__init__()
        for i in range(layers):
            setattr(self, f"l{i}", nn.Linear(width, width, device_mesh=mesh, dtype=np.float64))

    def forward(self, x: dt.DTensor) -> dt.DTensor:
        for layer in self._modules.values():
            x = F.gelu(layer(x), "tanh")
        return x


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    n = world.Get_size()
    mesh = dt.init_device_mesh("cpu", (n,))
    dt.manual_seed(0)
    model = Stack(args.layers, args.width, mesh)
    psi = sum(p.size * p.dtype.itemsize for p in model.parameters())
    for layer in model._modules.values():
        dt.fully_shard(layer, mesh=mesh)
    dt.fully_shard(model, mesh=mesh)
    opt = dt.optim.AdamW(list(model.parameters()), lr=1e-3)
    rng = np.random.default_rng(0)
    x = dt.distribute_tensor(rng.standard_normal((args.batch, args.width)), mesh, [dt.Shard(0)])
    y = dt.distribute_tensor(rng.standard_normal((args.batch, args.width)), mesh, [dt.Shard(0)])
    rows = []
    for step in range(3):
        opt.zero_grad()
        gc.collect()
        before = _status("VmRSS")
        _reset_peak()
        with dt.CommCounter() as moved:
            F.mse_loss(model(x), y).backward()
            opt.step()
        peak = _status("VmHWM") - before
        state = sum(p.to_local().nbytes + p.grad.to_local().nbytes for p in model.parameters())
        state += sum(v.to_local().nbytes for s in opt.state.values() for v in s.values() if isinstance(v, dt.DTensor))
        ag = sum(r.bytes_recv for r in moved.records if r.kind == "all_gather")
        rs = sum(r.bytes_sent for r in moved.records if r.kind == "reduce_scatter")
        rows.append((step, state, peak, ag, rs))
    everyone = world.gather(rows)
    if world.Get_rank() == 0:
        unit = psi // args.layers
        print(f"{args.layers} x Linear({args.width}, {args.width}) float64, Psi = {psi / 2**20:.2f} MiB, "
              f"one unit {unit / 2**20:.2f} MiB, N = {n}")
        print(f"formulas per rank: state 4 Psi/N = {4 * psi / n / 2**20:.2f} MiB; all-gather "
              f"2(N-1)/N Psi = {2 * (n - 1) * psi / n / 2**20:.2f} MiB; reduce-scatter "
              f"{(n - 1) * psi / n / 2**20:.2f} MiB")
        for rank, per in enumerate(everyone):
            step, state, peak, ag, rs = per[-1]
            print(f"rank {rank}: state {state / 2**20:.2f} MiB, step peak +{peak / 2**20:.2f} MiB "
                  f"({peak / unit:.1f} units), all-gather recv {ag / 2**20:.2f} MiB, "
                  f"reduce-scatter sent {rs / 2**20:.2f} MiB")
    mesh.free()


if __name__ == "__main__":
    main()
