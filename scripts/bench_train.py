#!/usr/bin/env python3
"""One training step (forward, backward, ``reduce_gradients``, AdamW) of the tensor-parallel MLP
and of the transformer block, dtorch_mpi side by side with PyTorch DTensor (gloo) and with a
single-process NumPy floor, interleaved repeat by repeat in one run.

Run (2 ranks is the reference case), from the checkout root:
    PYTHONPATH=$PWD mpiexec -n 2 python scripts/bench_train.py [--reps 15] [--check]
Models, the same on all three sides (same initial weights, same plan):
  mlp          x @ W1.T + b1 -> GELU(tanh) -> @ W2.T + b2, hidden h, ffn 4h, float32;
               Colwise (W1, b1 Shard(0)) then Rowwise (W2 Shard(1), b2 Replicate), both with
               ``use_local_output=False``; loss mean((out - y)^2); batch 64.
  transformer  examples/train_transformer_block.py's ``Block`` (imported, its size constants
               set per case): d = h, h/64 heads of 64, ffn 4h, vocabulary 1024, 4 x 16 tokens,
               float64 (as the example builds it), vocab-parallel cross_entropy.
Columns: ``dtorch``; ``torch`` (PyTorch DTensor 2.x on gloo: ``parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel`` for the MLP, the same placements through
``distribute_tensor`` and ``loss_parallel`` for the block, ``torch.optim.AdamW``); ``numpy``
(the floor: the same math by hand on ONE rank's pieces, per-rank shapes, no communication,
in-place AdamW). Each time is the median over repeats of the slowest rank, one step per
repeat, the three sides taking turns (order rotated every repeat) so load drift hits all.
Memory: tracemalloc peak of the bytes allocated during one step (after warm-up, so the
optimizer state exists), relative to this rank's parameters + the floor's saved activations.
torch's allocations are invisible to tracemalloc, so it has no memory column.
``--check`` first compares 3 steps of all three sides on the complete model (the floor then
has the whole model, so its numbers are exact) and prints the largest loss difference.

torch is a dev-only dependency that never goes into the project venv: make a separate one,
    python3 -m venv .venv-torch && .venv-torch/bin/pip install numpy mpi4py mpich torch
(a CPU-only torch wheel is enough) and run the script with ``.venv-torch/bin/python`` and
``.venv-torch/bin/mpiexec``. Without torch the torch column reads ``-``. BLAS and OpenMP
run one thread per rank (set below unless the environment says otherwise).

The sides live beside it, one module each: bench_train_setup.py (hyperparameters, weights, data),
bench_train_floor.py, bench_train_dtorch.py, bench_train_torch.py; this file builds the cases,
times and checks them, and prints the table.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tracemalloc  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from bench_train_dtorch import dtorch_block, dtorch_mlp  # noqa: E402
from bench_train_floor import block_floor, floor_step, mlp_floor  # noqa: E402
from bench_train_setup import WORLD, Step, block_setup, configure_block, mlp_data, mlp_weights  # noqa: E402
from bench_train_torch import Torch, try_torch  # noqa: E402
from benchtools import timed  # noqa: E402
from mpi4py import MPI  # noqa: E402

import dtorch_mpi as dt  # noqa: E402

# --- cases -----------------------------------------------------------------------------------
SIDES = ("dtorch", "torch", "numpy")


def build(kind: str, h: int, mesh: dt.DeviceMesh, torch_side: Torch | None,
          whole: bool = False) -> tuple[dict[str, Step], Callable[[], int], int]:
    """Every side's step for one case (all from the same initial weights), the floor's
    saved-activation bytes and this rank's parameter bytes. ``whole``: the floor gets the
    complete model instead of this rank's pieces (exact math, for --check)."""
    steps: dict[str, Step] = {}
    floor_fn: Callable[..., tuple[float, dict[str, np.ndarray], int]]
    args: tuple[Any, ...]
    if kind == "mlp":
        weights, (x, y) = mlp_weights(h, np.float32), mlp_data(h, 64, np.float32)
        steps["dtorch"], model = dtorch_mlp(mesh, weights, x, y)
        if torch_side is not None:
            steps["torch"] = torch_side.mlp(weights, x, y)
        floor_fn, args = mlp_floor, (x, y)
    else:
        configure_block(h, 1024, 4, 16)
        model, tokens, targets = block_setup(mesh)
        if torch_side is not None:
            steps["torch"] = torch_side.block(model, tokens, targets)
        steps["dtorch"] = dtorch_block(model, tokens, targets)
        vocab0 = 0 if whole else model.embed.spec.local_shape_and_offset[1][0]
        floor_fn, args = block_floor, (tokens, targets, vocab0, np.array(model.causal.to_local()))
    named = dict(model.named_parameters())
    pieces = {k: np.array(p.to_torch() if whole else p.to_local()) for k, p in named.items()}
    steps["numpy"], saved = floor_step(floor_fn, pieces, *args)
    local_bytes = sum(p.to_local().nbytes for p in named.values())
    return {s: steps[s] for s in SIDES if s in steps}, saved, local_bytes


def peak_bytes(step: Step) -> int:
    """tracemalloc peak of the bytes allocated during one step, largest rank."""
    tracemalloc.start()
    step()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return int(WORLD.allreduce(peak, op=MPI.MAX))


def measure(kind: str, h: int, mesh: dt.DeviceMesh, torch_side: Torch | None, reps: int) -> dict[str, Any]:
    steps, saved, param_bytes = build(kind, h, mesh, torch_side)
    for step in steps.values():  # warm-up: optimizer state, caches, BLAS
        step()
        step()
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(timed(steps[name], 1, warmup=False))
    row: dict[str, Any] = {n: statistics.median(t) for n, t in times.items()}
    row["spread"] = {n: (min(t), max(t)) for n, t in times.items()}
    row["peak"] = {n: peak_bytes(steps[n]) for n in ("dtorch", "numpy")}
    row["base"] = int(WORLD.allreduce(param_bytes + saved(), op=MPI.MAX))
    row["params"] = int(WORLD.allreduce(param_bytes, op=MPI.MAX))
    return row


def check(mesh: dt.DeviceMesh, torch_side: Torch | None, h: int = 128, steps: int = 3) -> list[str]:
    """Three steps of every side on the complete model: the largest loss difference from dtorch."""
    lines = []
    for kind in ("mlp", "transformer"):
        sides, _, _ = build(kind, h, mesh, torch_side, whole=True)
        losses = {name: [step() for _ in range(steps)] for name, step in sides.items()}
        worst = {n: max(abs(a - b) for a, b in zip(losses[n], losses["dtorch"])) for n in losses if n != "dtorch"}
        lines.append(f"check {kind} h={h}: dtorch losses {' '.join(f'{v:.6f}' for v in losses['dtorch'])}; max |loss - dtorch| "
                     + ", ".join(f"{n} {w:.1e}" for n, w in worst.items()))
    return lines


def profile(kind: str, h: int, mesh: dt.DeviceMesh, steps: int = 10) -> None:
    """cProfile of ``steps`` dtorch steps; rank 0 prints the top costs."""
    import cProfile
    import pstats

    step = build(kind, h, mesh, None)[0]["dtorch"]
    step()
    step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    if WORLD.Get_rank() == 0:
        print(f"cProfile, rank 0, {steps} dtorch steps of {kind} h={h}")
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(30)


def table(rows: list[tuple[str, int, dict[str, Any]]]) -> list[str]:
    mib = 1 << 20
    out = ["| model | h | dtorch ms | torch ms | numpy floor ms | dtorch / floor | dtorch / torch | params + acts MiB "
           "| dtorch step peak MiB (x) | floor step peak MiB (x) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, h, r in rows:
        torch_ms = f"{r['torch'] * 1e3:.1f}" if "torch" in r else "-"
        vs_torch = f"{r['dtorch'] / r['torch']:.2f}" if "torch" in r else "-"
        peaks = [f"{r['peak'][n] / mib:.1f} ({r['peak'][n] / r['base']:.2f})" for n in ("dtorch", "numpy")]
        out.append(f"| {kind} | {h} | {r['dtorch'] * 1e3:.1f} | {torch_ms} | {r['numpy'] * 1e3:.1f} "
                   f"| {r['dtorch'] / r['numpy']:.2f} | {vs_torch} | {r['base'] / mib:.1f} | {peaks[0]} | {peaks[1]} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,512,1024", help="hidden sizes")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--check", action="store_true", help="first compare losses on the complete model")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--profile", metavar="MODEL:H", help="only cProfile dtorch steps of one case")
    args = parser.parse_args()
    mesh = dt.init_device_mesh("cpu", (WORLD.Get_size(),), mesh_dim_names=("tp",))
    rank0 = WORLD.Get_rank() == 0
    if args.profile:
        kind, h = args.profile.split(":")
        profile(kind, int(h), mesh)
        mesh.free()
        return
    torch_side = None if args.no_torch else try_torch()
    load_before = os.getloadavg()
    lines = check(mesh, torch_side) if args.check else []
    rows = [(kind, h, measure(kind, h, mesh, torch_side, args.reps))
            for kind in args.models.split(",") for h in map(int, args.sizes.split(","))]
    load_after = os.getloadavg()
    if rank0:
        torch_text = f"torch {torch_side.version} (gloo)" if torch_side else "torch not installed"
        print(f"ranks={WORLD.Get_size()}  {torch_text}  1 BLAS thread per rank  reps={args.reps}  "
              "times: median of the slowest rank per step")
        print("load average (1, 5, 15 min) before: " + " ".join(f"{v:.2f}" for v in load_before)
              + "  after: " + " ".join(f"{v:.2f}" for v in load_after))
        print("\n".join(lines + table(rows)))
        print("spread (min-max ms): " + "; ".join(
            f"{k} {h} " + " ".join(f"{n} {lo * 1e3:.0f}-{hi * 1e3:.0f}" for n, (lo, hi) in r["spread"].items())
            for k, h, r in rows))
        print("peak: tracemalloc peak of the bytes allocated during one step (after warm-up), largest rank; "
              "(x) = peak / (this rank's parameters + the floor's saved activations)")
    if torch_side is not None:
        torch_side.close()
    mesh.free()


if __name__ == "__main__":
    main()
