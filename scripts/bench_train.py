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
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tracemalloc  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from benchtools import timed  # noqa: E402
from mpi4py import MPI  # noqa: E402

import dtorch_mpi as dt  # noqa: E402
from dtorch_mpi import nn  # noqa: E402
from dtorch_mpi.nn import functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_transformer_block as tb  # noqa: E402

WORLD = MPI.COMM_WORLD
R, S0, S1 = dt.Replicate(), dt.Shard(0), dt.Shard(1)
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
C_GELU = math.sqrt(2 / math.pi)
Step = Callable[[], float]


# --- the NumPy floor: forward, backward by hand, in-place AdamW ---------------------------------
class AdamWFloor:
    """torch's AdamW on plain arrays, in place."""

    def __init__(self, params: dict[str, np.ndarray]) -> None:
        self.params, self.t = params, 0
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}

    def step(self, grads: dict[str, np.ndarray]) -> None:
        self.t += 1
        b1, b2 = BETAS
        size, c2 = LR / (1 - b1 ** self.t), 1 / math.sqrt(1 - b2 ** self.t)
        for k, p in self.params.items():
            g, m, v = grads[k], self.m[k], self.v[k]
            p *= 1 - LR * WD
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            denom = np.sqrt(v)
            denom *= c2
            denom += EPS
            p -= size * (m / denom)


def gelu_fwd(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = np.tanh(C_GELU * (a + 0.044715 * a * a * a))
    return 0.5 * a * (1 + t), t


def gelu_bwd(a: np.ndarray, t: np.ndarray, g: np.ndarray) -> np.ndarray:
    return g * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * C_GELU * (1 + 3 * 0.044715 * a * a))


def rms_fwd(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + np.finfo(x.dtype).eps)
    return x * r * w, r


def rms_bwd(x: np.ndarray, r: np.ndarray, w: np.ndarray, gy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of ``x * r * w`` with respect to x and w."""
    gyw = gy * w
    gx = r * gyw - x * (r ** 3) * ((gyw * x).mean(-1, keepdims=True))
    return gx, (gy * x * r).reshape(-1, x.shape[-1]).sum(0)


def mlp_floor(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray], int]:
    """Loss, gradients and saved-activation bytes of one MLP step on these pieces (the
    Rowwise all-reduce is left out: on one rank's pieces the output is that rank's term)."""
    a = x @ p["0.weight"].T + p["0.bias"]
    g, t = gelu_fwd(a)
    out = g @ p["2.weight"].T + p["2.bias"]
    diff = out - y
    loss = float((diff * diff).mean())
    gout = diff * (2 / diff.size)
    ga = gelu_bwd(a, t, gout @ p["2.weight"])
    grads = {"0.weight": ga.T @ x, "0.bias": ga.sum(0), "2.weight": gout.T @ g, "2.bias": gout.sum(0)}
    return loss, grads, a.nbytes + t.nbytes + g.nbytes + diff.nbytes


def block_floor(p: dict[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray,
                vocab0: int, causal: np.ndarray) -> tuple[float, dict[str, np.ndarray], int]:
    """One transformer-block step on this rank's pieces: vocabulary rows ``vocab0...``, its
    heads and ffn columns (the block's three all-reduces and cross_entropy's two are left out)."""
    n_rows, (vl, d), (hl, _, dh) = tokens.size, p["embed"].shape, p["wq"].shape
    own = (tokens >= vocab0) & (tokens < vocab0 + vl)
    x0 = np.zeros(tokens.shape + (d,), p["embed"].dtype)
    x0[own] = p["embed"][tokens[own] - vocab0]
    h1, r1 = rms_fwd(x0, p["norm1"])
    h1u = h1[:, None]
    q, k, v = h1u @ p["wq"], h1u @ p["wk"], h1u @ p["wv"]  # [B, H, T, Dh]
    s = q @ k.swapaxes(-1, -2) * (1 / math.sqrt(dh)) + causal
    e = np.exp(s - s.max(-1, keepdims=True))
    prob = e / e.sum(-1, keepdims=True)
    o = prob @ v
    x1 = x0 + (o @ p["wo"]).sum(1)
    h2, r2 = rms_fwd(x1, p["norm2"])
    u = h2 @ p["w1"].T
    gu_act, tu = gelu_fwd(u)
    x2 = x1 + gu_act @ p["w2"].T
    h3, r3 = rms_fwd(x2, p["norm3"])
    z = h3 @ p["out"].T  # [B, T, Vl]
    zmax = z.max(-1, keepdims=True)
    ez = np.exp(z - zmax)
    se = ez.sum(-1, keepdims=True)
    mine = (targets >= vocab0) & (targets < vocab0 + vl)
    zt = np.where(mine, np.take_along_axis(z, np.clip(targets - vocab0, 0, vl - 1)[..., None], -1)[..., 0], 0.0)
    loss = float((np.log(se[..., 0]) + zmax[..., 0] - zt).mean())
    # backward
    gz = ez / se
    gz[mine, targets[mine] - vocab0] -= 1
    gz *= 1 / n_rows
    flat = (-1, d)
    gr: dict[str, np.ndarray] = {"out": gz.reshape(-1, vl).T @ h3.reshape(flat)}
    gx2, gr["norm3"] = rms_bwd(x2, r3, p["norm3"], gz @ p["out"])
    gr["w2"] = gx2.reshape(flat).T @ gu_act.reshape(-1, gu_act.shape[-1])
    gu = gelu_bwd(u, tu, gx2 @ p["w2"])
    gr["w1"] = gu.reshape(-1, gu.shape[-1]).T @ h2.reshape(flat)
    gh2, gr["norm2"] = rms_bwd(x1, r2, p["norm2"], gu @ p["w1"])
    gx1 = gx2 + gh2
    ga = gx1[:, None]  # [B, 1, T, d]
    heads_major = (1, 0, 2, 3)
    gr["wo"] = o.transpose(heads_major).reshape(hl, n_rows, dh).swapaxes(1, 2) @ gx1.reshape(flat)
    go = ga @ p["wo"].swapaxes(1, 2)
    gp = go @ v.swapaxes(-1, -2)
    gv = prob.swapaxes(-1, -2) @ go
    gs = prob * (gp - (gp * prob).sum(-1, keepdims=True)) * (1 / math.sqrt(dh))
    gq, gk = gs @ k, gs.swapaxes(-1, -2) @ q
    h1t = h1.reshape(flat).T
    gh1 = np.zeros_like(h1)
    for name, grad in (("wq", gq), ("wk", gk), ("wv", gv)):
        gr[name] = h1t @ grad.transpose(heads_major).reshape(hl, n_rows, dh)
        gh1 += (grad @ p[name].swapaxes(1, 2)).sum(1)
    gh1x, gr["norm1"] = rms_bwd(x0, r1, p["norm1"], gh1)
    gx0 = gx1 + gh1x
    gr["embed"] = np.zeros_like(p["embed"])
    np.add.at(gr["embed"], tokens[own] - vocab0, gx0[own])
    saved = (x0, h1, r1, q, k, v, prob, o, x1, h2, r2, u, tu, gu_act, x2, h3, r3, ez, se)
    return loss, gr, sum(a.nbytes for a in saved)


def floor_step(fn: Callable[..., tuple[float, dict[str, np.ndarray], int]], params: dict[str, np.ndarray],
               *args: Any) -> tuple[Step, Callable[[], int]]:
    """The floor's step closure and a function giving its saved-activation bytes."""
    opt = AdamWFloor(params)
    last = {"saved": 0}

    def step() -> float:
        loss, grads, last["saved"] = fn(params, *args)
        opt.step(grads)
        return loss

    return step, lambda: last["saved"]


# --- dtorch ---------------------------------------------------------------------------------
def dtorch_step(model: nn.Module, loss_fn: Callable[[], dt.DTensor]) -> Step:
    params = list(model.parameters())
    opt = dt.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    def step() -> float:
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        nn.utils.reduce_gradients(params)
        opt.step()
        return float(loss.to_local())

    return step


def mlp_weights(h: int, dtype: Any) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(h)
    f = 4 * h
    return {"0.weight": rng.uniform(-h ** -0.5, h ** -0.5, (f, h)).astype(dtype),
            "0.bias": rng.uniform(-h ** -0.5, h ** -0.5, f).astype(dtype),
            "2.weight": rng.uniform(-f ** -0.5, f ** -0.5, (h, f)).astype(dtype),
            "2.bias": rng.uniform(-f ** -0.5, f ** -0.5, h).astype(dtype)}


def mlp_data(h: int, batch: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((batch, h)).astype(dtype), rng.standard_normal((batch, h)).astype(dtype)


def dtorch_mlp(mesh: dt.DeviceMesh, weights: dict[str, np.ndarray], x: np.ndarray,
               y: np.ndarray) -> tuple[Step, nn.Module]:
    h, dtype = x.shape[1], x.dtype
    model = nn.Sequential(nn.Linear(h, 4 * h, device_mesh=mesh, dtype=dtype), nn.GELU(approximate="tanh"),
                          nn.Linear(4 * h, h, device_mesh=mesh, dtype=dtype))
    dt.parallelize_module(model, mesh, {"0": dt.ColwiseParallel(use_local_output=False),
                                        "2": dt.RowwiseParallel(use_local_output=False)})
    model.load_state_dict(weights)
    xd = dt.distribute_tensor(x, mesh, [R], src_data_rank=None)
    yd = dt.distribute_tensor(y, mesh, [R], src_data_rank=None)
    return dtorch_step(model, lambda: ((model(xd) - yd) ** 2).mean()), model


def configure_block(d: int, vocab: int, batch: int, seq: int) -> None:
    """Set the example's size constants (read when a Block is built and run)."""
    tb.D, tb.HEADS, tb.DH, tb.FF, tb.VOCAB, tb.BATCH, tb.SEQ = d, d // 64, 64, 4 * d, vocab, batch, seq


def block_setup(mesh: dt.DeviceMesh) -> tuple[tb.Block, np.ndarray, np.ndarray]:
    dt.manual_seed(0)
    return (tb.Block(mesh), *tb.next_token_data())


def dtorch_block(model: tb.Block, tokens: np.ndarray, targets: np.ndarray) -> Step:
    return dtorch_step(model, lambda: F.cross_entropy(model(tokens), targets))


# --- PyTorch DTensor --------------------------------------------------------------------------
class Torch:
    """PyTorch DTensor on gloo over the same ranks (None when torch is not installed)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as tdist
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(1)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29547")
        tdist.init_process_group("gloo", rank=WORLD.Get_rank(), world_size=WORLD.Get_size())
        self.torch, self.tdist = torch, tdist
        self.mesh = init_device_mesh("cpu", (WORLD.Get_size(),))
        self.version = torch.__version__

    def close(self) -> None:
        self.tdist.destroy_process_group()

    def _step(self, params: list[Any], loss_fn: Callable[[], Any], ctx: Callable[[], Any] | None = None) -> Step:
        import contextlib

        opt = self.torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

        def step() -> float:
            opt.zero_grad()
            with ctx() if ctx else contextlib.nullcontext():
                loss = loss_fn()
                loss.backward()
            opt.step()
            return float(loss.detach().full_tensor())

        return step

    def mlp(self, weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> Step:
        torch = self.torch
        from torch.distributed.tensor import Replicate, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        h = x.shape[1]
        model = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(approximate="tanh"),
                                    torch.nn.Linear(4 * h, h))
        model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
        parallelize_module(model, self.mesh, {"0": ColwiseParallel(use_local_output=False),
                                              "2": RowwiseParallel(use_local_output=False)})
        xt = torch.from_numpy(x)
        yt = distribute_tensor(torch.from_numpy(y), self.mesh, [Replicate()])
        return self._step(list(model.parameters()), lambda: ((model(xt) - yt) ** 2).mean())

    def block(self, model: tb.Block, tokens: np.ndarray, targets: np.ndarray) -> Step:
        """The block with the example's placements, written with torch DTensor ops. Attention
        runs heads-first (``[H, B, T, Dh]``, Shard(0)), the projections as 2-D matmuls with
        flattened head weights: torch's batched matmul (and einsum) flattens ``[B, H]`` and
        refuses when the head dim, second there, is sharded."""
        torch = self.torch
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import loss_parallel

        mesh, rep = self.mesh, [Replicate()]
        params = {name: torch.nn.Parameter(distribute_tensor(torch.from_numpy(np.array(p.to_torch())), mesh,
                                                             [Shard(p.placements[0].dim) if p.placements[0].is_shard()
                                                              else Replicate()]))
                  for name, p in model.named_parameters()}
        causal = distribute_tensor(torch.from_numpy(np.array(model.causal.to_torch())), mesh, rep)
        tok = distribute_tensor(torch.from_numpy(tokens), mesh, rep)
        tgt = distribute_tensor(torch.from_numpy(targets).reshape(-1), mesh, rep)
        eps = float(np.finfo(np.float64).eps)

        def rms(x: Any, w: Any) -> Any:
            return x / ((x * x).mean(-1, keepdim=True) + eps).sqrt() * w

        def replicate(t: Any) -> Any:
            return t.redistribute(mesh, rep)

        def loss_fn() -> Any:
            p = params
            # from_local: torch cannot take the residual stream's Partial gradient back to the
            # lookup's MaskPartial; this all-reduces it to Replicate first (Megatron's "f").
            x = DTensor.from_local(replicate(torch.nn.functional.embedding(tok, p["embed"])).to_local(), mesh, rep)
            b, t, d = x.shape
            hh = rms(x, p["norm1"]).reshape(b * t, d)
            q, k, v = ((hh @ p[w].permute(1, 0, 2).reshape(d, -1)).reshape(b, t, -1, tb.DH).permute(2, 0, 1, 3)
                       for w in ("wq", "wk", "wv"))  # [H, B, T, Dh] Shard(0)
            att = torch.softmax(q @ k.transpose(-1, -2) * (1 / math.sqrt(tb.DH)) + causal, -1)
            o = (att @ v).permute(1, 2, 0, 3).reshape(b * t, -1)  # [B*T, H*Dh] Shard(1)
            x = x + replicate((o @ p["wo"].reshape(-1, d)).reshape(b, t, d))
            gact = torch.nn.functional.gelu(rms(x, p["norm2"]) @ p["w1"].T, approximate="tanh")
            x = x + replicate(gact @ p["w2"].T)
            logits = rms(x, p["norm3"]) @ p["out"].T
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt)

        return self._step(list(params.values()), loss_fn, loss_parallel)


def try_torch() -> Torch | None:
    try:
        return Torch()
    except ImportError:
        return None


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
