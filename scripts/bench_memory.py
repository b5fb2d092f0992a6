#!/usr/bin/env python3
"""Memory per rank: what building and sharding a model holds, and what activation
checkpointing keeps (issue 25's memory goals).

Run, from the checkout root:
    PYTHONPATH=$PWD mpiexec -n N python scripts/bench_memory.py [--layers 8] [--width 512]
        [--plans replicated,tp,fsdp] [--ac-blocks 8] [--ac-width 256] [--reps 3] [--skip-ac]

Construction: a ``Sequential`` of ``--layers`` equal ``Linear(width, width)`` (float64: 8
layers of 512 are a 16 MiB model), built and sharded by each plan; per rank the tracemalloc
peak of the bytes allocated while building + sharding, the bytes still held after, and the
``VmHWM`` (peak resident set, /proc/self/status; reset per plan through /proc/self/clear_refs)
above the resident set before building. Beside them the goal: model/N + one parameter
(``replicated`` keeps the whole model by definition, so its goal is the model).
``ok``: peak <= goal + 1 MiB (the generator's kept scratch). Plans: ``replicated`` (no plan), ``tp`` (Colwise / Rowwise alternating), ``fsdp`` (one
``dtorch.fully_shard`` unit per layer, then the model: skipped while dtorch has no
``fully_shard``). Add a plan by adding a row to PLANS.

Training step (``--step``, run alone: ``MALLOC_MMAP_THRESHOLD_=65536`` in the environment makes
glibc return every large array's pages at free, so the peak resident set measures what is
alive): the same model (a GELU after each layer), batch ``--batch`` rows sharded over the
data-parallel ranks, AdamW, one warm-up step (optimizer state made), then one step's VmHWM
(all of it run twice per plan, the first to warm the process: MPI's shared memory, imports)
above the resident set before the model was built (parameters, gradients, optimizer state,
gathered units, activations, communication buffers: everything) beside the formula
(parameters + gradients + optimizer state)/N + 2 largest units + activations (``dp``: the
whole state on every rank; ``fsdp_tp``: a (2, N/2) mesh, units over dp of tp pieces). The
activations term is measured: the traced bytes a third step's forward leaves held (the gathered
units live in fully_shard's memory map, which tracemalloc does not see). ``ok``: peak <=
1.15 x formula. ``+2g``: the peak over the formula plus two units' unsharded gradients (the
unit whose gradients are being computed and the one whose reduce-scatter is in flight hold
theirs whole, which the issue's formula leaves out). Plans: ``dp`` (replicated parameters, ``reduce_gradients``), ``fsdp``,
``fsdp_tp`` (even rank counts >= 4), ``fsdp_lean`` (fsdp with ``backward_prefetch=False``:
no prefetch in backward, each reduce-scatter finished before the next unit's backward), and
where torch is importable ``torch_fsdp2`` and
``torch_ddp``: PyTorch's FSDP2 and DDP on gloo, the same model and step, against the formula
of ``fsdp`` / ``dp`` (list those first).

Activation checkpointing: a stack of ``--ac-blocks`` pre-norm residual MLP blocks
``x + W2 @ dropout(gelu(W1 @ layer_norm(x)))`` (width d, ffn 4d, float64, batch sharded over the
ranks), one training step (forward, backward) with and without
``dtorch.nn.utils.checkpoint`` per block: the bytes the forward leaves held (activations kept
for backward, tracemalloc current after forward minus before), the peak of the step, and the
step time (median over ``--reps`` of the slowest rank). Goal: kept <= inputs of each block + one
block's activations; extra step time <= 35 %.
"""

from __future__ import annotations

import argparse
import os
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import dtorch_mpi as dt  # noqa: E402
from dtorch_mpi import nn  # noqa: E402

WORLD = MPI.COMM_WORLD
MiB = 1 << 20
SLACK_MIB = 1.0
"""Allowed above the construction goal: the random generator's scratch, kept from call to call
(3 x 256 KiB for uniform draws), and the modules' Python objects."""


def status_kib(field: str) -> int:
    """A ``VmXXX`` line of /proc/self/status, in KiB (0 where there is no procfs)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_hwm() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0: ``5 > clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def plan_tp(model: nn.Module, mesh: dt.DeviceMesh) -> None:
    styles = {str(i): (nn.ColwiseParallel(use_local_output=False) if i % 2 == 0
                       else nn.RowwiseParallel(use_local_output=False)) for i in range(len(model))}  # type: ignore[arg-type]
    nn.parallelize_module(model, mesh, styles)


def plan_fsdp(model: nn.Module, mesh: dt.DeviceMesh) -> None:
    for layer in model._modules.values():
        dt.fully_shard(layer, mesh=mesh)  # type: ignore[attr-defined]
    dt.fully_shard(model, mesh=mesh)  # type: ignore[attr-defined]


PLANS: dict[str, tuple[Callable[[nn.Module, dt.DeviceMesh], None] | None, Callable[[], bool]]] = {
    "replicated": (None, lambda: True),
    "tp": (plan_tp, lambda: True),
    "fsdp": (plan_fsdp, lambda: hasattr(dt, "fully_shard")),
}
"""plan -> (how it shards a built model, whether this dtorch has it)."""


def construction(plan: str, layers: int, width: int, mesh: dt.DeviceMesh) -> dict[str, float] | None:
    shard, available = PLANS[plan]
    if not available():
        return None
    WORLD.Barrier()
    rss0 = status_kib("VmRSS")
    hwm_ok = reset_hwm()
    tracemalloc.start()
    t0 = time.perf_counter()
    model = nn.Sequential(*(nn.Linear(width, width, device_mesh=mesh, dtype=np.float64) for _ in range(layers)))
    if shard is not None:
        shard(model, mesh)
    for p in model.parameters():  # a deferred parameter is made here at the latest
        p.to_local()
    seconds = time.perf_counter() - t0
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    hwm = status_kib("VmHWM") - rss0 if hwm_ok else float("nan")
    full = sum(p.size * p.dtype.itemsize for p in model.parameters())
    largest = max(p.size * p.dtype.itemsize for p in model.parameters())
    n = mesh.size()
    goal = full if plan == "replicated" else full / n + largest
    out = {"model": full / MiB, "goal": goal / MiB, "peak": peak / MiB, "held": current / MiB,
           "hwm": hwm / 1024, "seconds": seconds}
    del model
    return out


class MLPBlock(nn.Module):
    """``x + W2 @ dropout(gelu(W1 @ layer_norm(x)))`` (every parameter replicated)."""

    def __init__(self, d: int, mesh: dt.DeviceMesh, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, device_mesh=mesh, dtype=np.float64)
        self.fc1 = nn.Linear(d, 4 * d, device_mesh=mesh, dtype=np.float64)
        self.fc2 = nn.Linear(4 * d, d, device_mesh=mesh, dtype=np.float64)
        self.act, self.drop = nn.GELU(), nn.Dropout(p)

    def forward(self, x: Any) -> Any:
        return x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


def ac_step(blocks: list[MLPBlock], x: dt.DTensor, use: bool, traced: bool) -> tuple[float, float, float]:
    """One forward + backward: (bytes kept after forward, step peak bytes, seconds). Memory is
    traced (``traced``) or the step timed, never both: tracemalloc slows Python several-fold."""
    from dtorch_mpi.nn.utils import checkpoint

    for b in blocks:
        for p in b.parameters():
            p.grad = None
    dt.manual_seed(1)
    WORLD.Barrier()
    if traced:
        tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    h: Any = x
    for b in blocks:
        h = checkpoint(b, h) if use else b(h)
    loss = (h * h).mean()
    kept = tracemalloc.get_traced_memory()[0] - base
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] - base
    if traced:
        tracemalloc.stop()
    return kept, peak, WORLD.allreduce(seconds, op=MPI.MAX)


def activation_checkpointing(n_blocks: int, d: int, batch: int, reps: int, mesh: dt.DeviceMesh) -> dict[str, float]:
    blocks = [MLPBlock(d, mesh, 0.1) for _ in range(n_blocks)]
    x = dt.distribute_tensor(np.random.default_rng(0).standard_normal((batch, d)), mesh, [dt.Shard(0)],
                             src_data_rank=None, requires_grad=True)
    rows = x.to_local().shape[0]
    for use in (False, True):  # warm-up (plans compiled, buffers pooled)
        ac_step(blocks, x, use, False)
    memory = {use: ac_step(blocks, x, use, True) for use in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(reps):
        for use in ((False, True) if r % 2 == 0 else (True, False)):  # alternate who goes first
            times[use].append(ac_step(blocks, x, use, False)[2])
    one_input = rows * d * 8
    grads = sum(p.to_local().nbytes for b in blocks for p in b.parameters())
    # what one block saves for backward, roughly: norm in/out, fc1 in, fc1 out, gelu out, mask,
    # dropout out (the ffn-wide ones 4x): printed only to size the goal
    return {"inputs": n_blocks * one_input / MiB, "block_acts": (3 + 4 * 4) * one_input / MiB,
            "grads": grads / MiB,
            "kept_plain": memory[False][0] / MiB, "kept_ac": memory[True][0] / MiB,
            "peak_plain": memory[False][1] / MiB, "peak_ac": memory[True][1] / MiB,
            "time_plain": float(np.median(times[False])), "time_ac": float(np.median(times[True]))}


def slice_cost(reps: int, mesh: dt.DeviceMesh) -> list[tuple[int, int, float, float]]:
    """Replicate -> Shard(d) per call: the piece copied out (now) against the view it was
    before (``executor._cut`` patched back to ``x[index]`` for the comparison)."""
    from benchtools import timed

    from dtorch_mpi.redistribute import executor

    copy_cut = executor._cut

    def view_cut(step: Any, x: Any, xp: Any) -> Any:
        return x[step.args[0]]

    rows = []
    for nbytes in (1 << 10, 64 << 10, 1 << 20, 16 << 20):
        n = int(np.sqrt(nbytes // 8))
        x = dt.distribute_tensor(np.ones((n, n)), mesh, [dt.Replicate()], src_data_rank=None)
        for d in (0, 1):
            target = [dt.Shard(d)]
            got = []
            for cut in (view_cut, copy_cut):
                executor._cut = cut
                got.append(timed(lambda: x.redistribute(placements=target), reps * 20))
            executor._cut = copy_cut
            rows.append((n * n * 8, d, got[0], got[1]))
    return rows


def _step_model(plan: str, layers: int, width: int, n: int) -> tuple[nn.Module, Any, int, dt.DeviceMesh | None]:
    """The step benchmark's model under ``plan``: (model, the mesh its input lives on, dp
    size, a 2-D mesh to free or None)."""
    mesh2 = None
    if plan == "fsdp_tp":
        mesh2 = dt.init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
        mesh, dp = mesh2["tp"], 2
    else:
        mesh, dp = dt.init_device_mesh("cpu", (n,)), n
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width, device_mesh=mesh, dtype=np.float64), nn.GELU()]
    model = nn.Sequential(*mods)
    lin = [m for m in mods if isinstance(m, nn.Linear)]
    if plan == "fsdp_tp":
        for i, m in enumerate(lin):
            (nn.ColwiseParallel(use_local_output=False) if i % 2 == 0
             else nn.RowwiseParallel(use_local_output=False)).apply(m, mesh)
    if plan in ("fsdp", "fsdp_tp", "fsdp_lean"):
        dp_mesh = mesh2["dp"] if mesh2 is not None else mesh
        prefetch = plan != "fsdp_lean"  # fsdp_lean: backward_prefetch=False, the least memory
        for m in lin:
            dt.fully_shard(m, mesh=dp_mesh, backward_prefetch=prefetch)
        dt.fully_shard(model, mesh=dp_mesh, backward_prefetch=prefetch)
    return model, mesh, dp, mesh2


def step_memory(plan: str, layers: int, width: int, batch: int) -> dict[str, float] | None:
    n = WORLD.Get_size()
    if plan == "fsdp_tp" and (n < 4 or n % 2):
        return None
    import gc
    gc.collect()
    WORLD.Barrier()
    rss0 = status_kib("VmRSS")
    model, mesh, dp, mesh2 = _step_model(plan, layers, width, n)
    try:
        opt = dt.optim.AdamW(model.named_parameters(), lr=1e-3, weight_decay=0.0)
        full = np.random.default_rng(0).standard_normal((batch, width))
        if plan == "fsdp_tp":  # each dp group its half of the batch, replicated over tp
            x = dt.distribute_tensor(np.array_split(full, 2)[mesh2.get_coordinate()[0]], mesh,  # type: ignore[union-attr]
                                     [dt.Replicate()], src_data_rank=None)
        else:
            x = dt.distribute_tensor(full, mesh, [dt.Shard(0)], src_data_rank=None)
        params = list(model.parameters())

        def step(trace: bool) -> float:
            opt.zero_grad()
            if trace:
                tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            loss = (model(x) ** 2).mean()
            kept = tracemalloc.get_traced_memory()[0] - before
            if trace:
                tracemalloc.stop()
            loss.backward()
            if plan == "dp":
                nn.utils.reduce_gradients(params)
            opt.step()
            return kept

        step(False)  # warm-up: optimizer state, plans, pooled buffers
        WORLD.Barrier()
        hwm_ok = reset_hwm()
        t0 = time.perf_counter()
        step(False)
        seconds = time.perf_counter() - t0
        peak = status_kib("VmHWM") - rss0 if hwm_ok else float("nan")
        from dtorch_mpi.comm import pool
        pooled = pool.held_bytes()  # collectives' buffers kept for reuse (DTORCH_BUFFER_POOL_BYTES)
        acts = step(True)
        state = sum(p.to_local().nbytes for p in params)  # parameters held (sharded or not)
        whole = sum(p.size * p.dtype.itemsize for p in params)
        unit = max(p.size * p.dtype.itemsize for p in params if p.ndim == 2)  # a layer's weight
        unit += width * 8  # and its bias
        tp = n // dp if plan == "fsdp_tp" else 1
        gathered = 0 if plan == "dp" else 2 * unit / tp
        formula = 4 * (whole / (dp * tp) if plan != "dp" else whole) + gathered + acts  # p + g + 2 Adam moments
        return {"state": 4 * state / MiB, "gathered": gathered / MiB, "acts": acts / MiB, "formula": formula / MiB,
                "peak": peak / 1024, "pool": pooled / MiB,
                "seconds": seconds}
    finally:
        if mesh2 is not None:
            mesh2.free()
        else:
            mesh.free()


_TORCH_PG: list[bool] = []  # whether gloo's process group was made (once per process)


def torch_step_memory(plan: str, layers: int, width: int, batch: int) -> dict[str, float] | None:
    """``torch_fsdp2`` / ``torch_ddp``: the same model and step in PyTorch (``fully_shard`` per
    Linear and on the root, or DistributedDataParallel) on gloo over the same ranks, the
    step's VmHWM above the resident set before building (None without torch)."""
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        return None
    if not _TORCH_PG:
        torch.set_num_threads(1)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29553")
        tdist.init_process_group("gloo", rank=WORLD.Get_rank(), world_size=WORLD.Get_size())
        _TORCH_PG.append(True)
    import gc
    gc.collect()
    WORLD.Barrier()
    rss0 = status_kib("VmRSS")
    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width, dtype=torch.float64), torch.nn.GELU()]
    model: Any = torch.nn.Sequential(*mods)
    if plan == "torch_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD.Get_size(),))
        for m in mods:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    rows = np.array_split(np.random.default_rng(0).standard_normal((batch, width)), WORLD.Get_size())
    x = torch.from_numpy(rows[WORLD.Get_rank()].copy())

    def step() -> None:
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()

    step()
    WORLD.Barrier()
    hwm_ok = reset_hwm()
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    return {"peak": (status_kib("VmHWM") - rss0) / 1024 if hwm_ok else float("nan"), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--plans", default="replicated,tp,fsdp")
    ap.add_argument("--ac-blocks", type=int, default=8)
    ap.add_argument("--ac-width", type=int, default=256)
    ap.add_argument("--ac-batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-ac", action="store_true")
    ap.add_argument("--slice-cost", action="store_true", help="also time the Replicate -> Shard copy")
    ap.add_argument("--step", action="store_true", help="only the training-step peak (see the docstring)")
    ap.add_argument("--step-plans", default="dp,fsdp,fsdp_tp")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    if args.step:
        if WORLD.Get_rank() == 0:
            print(f"ranks {WORLD.Get_size()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
                  f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}")
            print(f"training step: {args.layers} x (Linear({args.width}, {args.width}) + GELU) float64, batch "
                  f"{args.batch}, AdamW; MiB per rank (the largest over ranks); state = p + g + 2 moments held")
            print(f"{'plan':<9}{'state':>8}{'2 units':>8}{'acts':>7}{'formula':>9}{'VmHWM+':>8}{'ratio':>7}{'ok':>4}{'+2g':>6}{'pool':>7}{'s':>7}")
        formulas: dict[str, float] = {}
        for plan in filter(None, args.step_plans.split(",")):
            if plan.startswith("torch_"):
                torch_step_memory(plan, args.layers, args.width, args.batch)  # warm-up run, as below
                got = torch_step_memory(plan, args.layers, args.width, args.batch)
                if WORLD.allreduce(got is None, op=MPI.LOR):  # every rank skips alike
                    if WORLD.Get_rank() == 0:
                        print(f"{plan:<9}  (torch is not installed)")
                    continue
                peak = WORLD.allreduce(got["peak"] if got else 0.0, op=MPI.MAX)
                secs = WORLD.allreduce(got["seconds"] if got else 0.0, op=MPI.MAX)
                mine = "fsdp" if plan == "torch_fsdp2" else "dp"  # the formula of the same plan
                if WORLD.Get_rank() == 0 and mine in formulas:
                    ratio = peak / formulas[mine]
                    print(f"{plan:<9}{'':>32}{peak:8.2f}{ratio:7.2f}{'yes' if ratio <= 1.15 else 'no':>4}"
                          f"{'':>13}{secs:7.3f}   (formula: {mine}'s)")
                elif WORLD.Get_rank() == 0:
                    print(f"{plan:<9}{'':>32}{peak:8.2f}   (list {mine} first for its formula){secs:7.3f}")
                continue
            step_memory(plan, args.layers, args.width, args.batch)  # once to warm the process (MPI, imports, caches)
            row = step_memory(plan, args.layers, args.width, args.batch)
            flags = WORLD.allgather(row is None)
            if any(flags):
                if WORLD.Get_rank() == 0:
                    print(f"{plan:<9}  (needs an even rank count >= 4)")
                continue
            assert row is not None
            worst = {k: WORLD.allreduce(v, op=MPI.MAX) for k, v in row.items()}
            formulas[plan] = worst["formula"]
            if WORLD.Get_rank() == 0:
                ratio = worst["peak"] / worst["formula"]
                print(f"{plan:<9}{worst['state']:8.2f}{worst['gathered']:8.2f}{worst['acts']:7.2f}"
                      f"{worst['formula']:9.2f}{worst['peak']:8.2f}{ratio:7.2f}{'yes' if ratio <= 1.15 else 'no':>4}"
                      f"{worst['peak'] / (worst['formula'] + worst['gathered']):6.2f}{worst['pool']:7.2f}{worst['seconds']:7.3f}")
        return
    mesh = dt.init_device_mesh("cpu", (WORLD.Get_size(),))
    n = mesh.size()
    me = WORLD.Get_rank()
    if me == 0:
        print(f"ranks {n}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        print(f"construction: {args.layers} x Linear({args.width}, {args.width}) float64; MiB per rank "
              f"(the largest over ranks)")
        print(f"{'plan':<11}{'model':>8}{'goal':>8}{'peak':>8}{'held':>8}{'VmHWM+':>8}{'ok':>4}{'s':>7}")
    for plan in filter(None, args.plans.split(",")):
        row = construction(plan, args.layers, args.width, mesh)
        if row is None:
            if me == 0:
                print(f"{plan:<11}  (not in this dtorch)")
            continue
        worst = {k: WORLD.allreduce(v, op=MPI.MAX) for k, v in row.items()}
        if me == 0:
            ok = "yes" if worst["peak"] <= worst["goal"] + SLACK_MIB else "no"
            print(f"{plan:<11}{worst['model']:8.2f}{worst['goal']:8.2f}{worst['peak']:8.2f}{worst['held']:8.2f}"
                  f"{worst['hwm']:8.2f}{ok:>4}{worst['seconds']:7.3f}")
    if args.slice_cost:
        rows = slice_cost(args.reps, mesh)
        if me == 0:
            print("Replicate -> Shard(d), us per call (median, slowest rank): a view before, a copy now")
            for nbytes, d, view, copy in rows:
                print(f"  {nbytes / 1024:9.0f} KiB  Shard({d})  view {view * 1e6:9.1f}  copy {copy * 1e6:9.1f}")
    if args.skip_ac:
        return
    from dtorch_mpi.nn import utils

    if not hasattr(utils, "checkpoint"):
        if me == 0:
            print("activation checkpointing: not in this dtorch")
        return
    ac = activation_checkpointing(args.ac_blocks, args.ac_width, args.ac_batch, args.reps, mesh)
    worst = {k: WORLD.allreduce(v, op=MPI.MAX) for k, v in ac.items()}
    if me == 0:
        extra = worst["time_ac"] / worst["time_plain"] - 1
        print(f"activation checkpointing: {args.ac_blocks} blocks, d={args.ac_width}, ffn {4 * args.ac_width}, "
              f"batch {args.ac_batch} (Shard(0)), dropout 0.1; MiB per rank")
        print(f"  kept after forward: plain {worst['kept_plain']:.2f}, checkpointed {worst['kept_ac']:.2f} "
              f"(block inputs {worst['inputs']:.2f}; one block's activations ~{worst['block_acts']:.2f})")
        print(f"  step peak: plain {worst['peak_plain']:.2f}, checkpointed {worst['peak_ac']:.2f} "
              f"(of which the parameters' gradients {worst['grads']:.2f})")
        print(f"  step time: plain {worst['time_plain'] * 1e3:.1f} ms, checkpointed {worst['time_ac'] * 1e3:.1f} ms "
              f"(+{extra * 100:.0f} %, goal <= 35 %)")


if __name__ == "__main__":
    main()
