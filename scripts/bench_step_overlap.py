#!/usr/bin/env python3
"""How much of a data-parallel step's communication is exposed? (``replicate``, ``fully_shard``)

Under mpiexec. A stack of ``--layers`` Linear(H, H) layers (float64, H from ``--layer-mb``:
each layer's weight that many MB), a small Shard(0) batch, and per layer injected compute of
``--work-ms`` in forward and again in backward (a hook on the layer's output runs it just before
the layer's backward), so compute and communication have known sizes. Two kinds of compute:
``offcore`` (time.sleep: work that leaves this rank's core free, a GPU kernel or a transfer
carried by a network card) and ``numpy`` (np.sin over an array: needs the core MPI's
shared-memory copies need too). Cases, interleaved repeat by repeat, medians of the slowest rank:

  compute     the plain model, batch sharded, no gradient reduction (the compute-only step)
  blocking    compute, then ``reduce_gradients`` (the packed blocking form)
  replicate   ``dtorch.replicate(bucket_bytes=--bucket-mb)``: all-reduces during backward
  fsdp        ``fully_shard`` per layer and on the root (prefetched all-gathers, reduce-scatters
              during backward); the last layer with ``reshard_after_forward=False``, as
              torchtitan shards FSDP2 models: its backward runs next, so a reshard would only
              make that backward wait for a fresh all-gather

and the communication alone: ``comm(dp)`` = blocking - compute; ``comm(fsdp)`` = the fsdp step
with no injected work and every collective started inline (``DTORCH_ASYNC_ISSUE=inline``: its
blocking-like form, fixed whatever the mode under test) - the compute step with no injected
work. Exposed = step - compute;
``exp/comm`` = exposed / comm (the goal: <= 0.25 off-core); ``step/max`` = step / max(compute,
comm) (goal <= 1.1). BLAS runs one thread per rank (set before NumPy loads). ``--trace PATH`` writes a timeline (dtorch_mpi/timeline.py) of one step
of each of compute, replicate and fsdp (``PATH`` -> ``PATH-replicate-offcore.rank<r>.json`` ...).
``--load-ms`` adds off-core work at the start of every step (loading the batch); ``--unshard``
adds the row ``fsdp+unshard``, interleaved with the others: its step first calls
``layers[0].unshard(async_op=True)`` (FSDP2's explicit prefetch), so the first unit's
all-gather runs beside the load instead of before the forward. ``--optimizer`` ends every step
with an SGD step and adds the row ``fsdp-ondemand``: fsdp with ``prefetch_after_step=False``
(the default starts the first unit's all-gather at the end of the optimizer step, so it runs
beside the next step's load). A sharded plan's optimizer updates 1/ranks of the parameters, so
each plan's compute-only step is the compute step with that plan's own optimizer time (both
medians, printed; for the fsdp plans fsdp-ondemand's, whose step starts no gather): the
saving is not hidden communication. The harness's barrier before each step and its time
reduction after it wait as the library does (``timed_interleaved(polled=True)``): MPICH's
blocking calls spin, and at 3-4 ranks on 2 cores they starved the prefetch after the step
(started at one step's end, in flight across the barrier) of the core it needed, adding 60-130
ms to some steps that a training loop, loading its next batch there, would not see. ``--plans replicate`` times only
replicate beside compute and blocking; ``--bucket-mb 1,2,4`` times one replicate per bucket size,
interleaved in the same run (a bucket sweep).
"""

from __future__ import annotations

# ruff: noqa: E402  (the BLAS thread count must be set before NumPy is imported)
import argparse
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one core per rank: a threaded
    os.environ.setdefault(_var, "1")  # BLAS made each backward matmul 10x slower on this loaded machine
import statistics
import time
from collections.abc import Callable

import numpy as np
from benchtools import numpy_work, process_environment, timed_interleaved
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.comm import issuer
from dtorch_mpi.nn import functional as F

WORLD = MPI.COMM_WORLD
S0 = dt.Shard(0)


class Stack(nn.Module):
    def __init__(self, layers: int, width: int, mesh: dt.DeviceMesh, work: Callable[[], object]) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width, bias=False, device_mesh=mesh, dtype=np.float64)
                                      for _ in range(layers)])
        self.work = work

    def forward(self, x: dt.DTensor) -> dt.DTensor:
        for layer in self.layers:
            x = layer(x)
            self.compute()  # the layer's forward compute
            if x.requires_grad:
                x.register_hook(lambda g: self.compute())  # its backward compute
        return x

    def compute(self) -> None:
        with dt.trace_span("compute"):
            self.work()


def step_numpy_work(seconds: float) -> Callable[[], object]:
    return numpy_work(seconds, 1 << 16, 7)


def offcore_work(seconds: float) -> Callable[[], object]:
    return (lambda: None) if seconds <= 0 else (lambda: time.sleep(seconds))


def make_step(plan: str, mesh: dt.DeviceMesh, layers: int, width: int, work: Callable[[], object],
              bucket: int, load: Callable[[], object] = lambda: None,
              optimizer_times: list[float] | None = None) -> Callable[[], object]:
    """One training step of ``plan``; with ``optimizer_times`` it ends with an SGD step, whose
    time on this rank each step appends there."""
    dt.manual_seed(0)
    model = Stack(layers, width, mesh, work)
    if plan == "replicate":
        dt.replicate(model, mesh=mesh, bucket_bytes=bucket)
    elif plan.startswith("fsdp"):
        for i, layer in enumerate(model.layers):  # the last layer stays gathered after forward: its
            dt.fully_shard(layer, mesh=mesh, reshard_after_forward=i < layers - 1)  # backward is next
        dt.fully_shard(model, mesh=mesh,  # (torchtitan's recipe for FSDP2)
                       prefetch_after_step=plan != "fsdp-ondemand")
    params = list(model.parameters())
    x = dt.distribute_tensor(np.random.default_rng(2).standard_normal((4 * WORLD.size, width)), mesh, [S0])
    opt = dt.optim.SGD(params, lr=1e-9) if optimizer_times is not None else None

    first = model.layers[0]

    def step() -> object:
        for p in params:
            p.grad = None
        if plan == "fsdp+unshard":
            first.unshard(async_op=True)  # the first unit's all-gather beside the batch's load
        with dt.trace_span("load"):
            load()
        loss = F.mse_loss(model(x), x)
        loss.backward()
        if plan == "blocking":
            nn.utils.reduce_gradients(params)
        if opt is not None and optimizer_times is not None:
            if plan == "compute":  # its gradients are unreduced (Partial): the same local update,
                for p in params:  # read as the parameter's placements (no communication)
                    p.grad = dt.DTensor(p.grad.to_local(), p.spec)  # type: ignore[union-attr]
            start = time.perf_counter()
            with dt.trace_span("optimizer"):
                opt.step()
            optimizer_times.append(time.perf_counter() - start)
        return loss

    return step


def issued_inline(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with every collective started on the calling thread (comm/issuer.py)."""
    def run() -> object:
        with issuer.issuing("inline"):
            return fn()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer-mb", type=float, default=2.0)
    ap.add_argument("--work-ms", type=float, default=5.0, help="injected compute per layer, forward and backward")
    ap.add_argument("--bucket-mb", default="2", help="replicate's bucket size; a list: one replicate row each")
    ap.add_argument("--kinds", default="offcore,numpy")
    ap.add_argument("--reps", type=int, default=15,
                    help="interleaved repeats (7 gave medians that moved as much between runs as the effects)")
    ap.add_argument("--trace", default="")
    ap.add_argument("--load-ms", type=float, default=0.0,
                    help="off-core work at the start of every step (loading the batch), in every plan")
    ap.add_argument("--unshard", action="store_true",
                    help="add fsdp+unshard: fsdp that starts its first unit's all-gather before the load")
    ap.add_argument("--plans", default="replicate,fsdp",
                    help="the plans timed beside compute and blocking (a bucket sweep needs only replicate)")
    ap.add_argument("--optimizer", action="store_true",
                    help="end every step with an SGD step, and add fsdp-ondemand (prefetch_after_step=False)")
    args = ap.parse_args()
    mesh = dt.init_device_mesh("cpu", (WORLD.size,))
    width = max(1, int(np.sqrt(args.layer_mb * (1 << 20) / 8)))
    sizes = [float(mb) for mb in args.bucket_mb.split(",")]
    bucket = int(sizes[0] * (1 << 20))
    if WORLD.rank == 0:
        print(f"{WORLD.size} ranks, {os.cpu_count()} cores, load before {os.getloadavg()[0]:.2f}; "
              f"collectives issued {issuer.issue_mode()}; "
              f"{args.layers} layers of {width}x{width} float64 ({width * width * 8 / 2**20:.2f} MB), "
              f"{args.work_ms} ms compute per layer per direction, bucket {args.bucket_mb} MB, {args.reps} reps"
              + (f", {args.load_ms} ms load per step" if args.load_ms else "")
              + (", fsdp+unshard starts its first unit's gather before the load" if args.unshard else "")
              + f"; environment: {process_environment()}")
        print(f"{'kind':>8} {'plan':>15} {'compute':>8} {'comm':>8} {'step':>8} {'exposed':>8} {'exp/comm':>8} "
              f"{'step/max':>8}   (ms, medians of the slowest rank)")
    chosen = tuple(args.plans.split(",")) + (("fsdp+unshard",) if args.unshard else ()) \
        + (("fsdp-ondemand",) if args.optimizer and "fsdp" in args.plans.split(",") else ())
    unknown = set(chosen) - {"replicate", "fsdp", "fsdp+unshard", "fsdp-ondemand"}
    if unknown:
        ap.error(f"--plans: unknown plan(s) {sorted(unknown)}; choose from replicate, fsdp")
    sharded = any(p.startswith("fsdp") for p in chosen)  # (the fsdp reference needs the bare steps)
    bare = {p: make_step(p, mesh, args.layers, width, lambda: None, bucket) for p in ("compute", "fsdp")} \
        if sharded else {}
    for kind in args.kinds.split(","):
        work = (offcore_work if kind == "offcore" else step_numpy_work)(args.work_ms / 1e3)
        load = offcore_work(args.load_ms / 1e3)
        plans = ("compute", "blocking") + chosen
        optimizer_times: dict[str, list[float]] = {}

        def timings(name: str) -> list[float] | None:
            return optimizer_times.setdefault(name, []) if args.optimizer else None

        steps = {p: make_step(p, mesh, args.layers, width, work, bucket, load, timings(p)) for p in plans}
        if len(sizes) > 1 and "replicate" in steps:  # the sweep: one replicate per bucket size
            del steps["replicate"]
            optimizer_times.pop("replicate", None)
            for mb in sizes:
                name = f"replicate {mb:g}MB"
                steps[name] = make_step("replicate", mesh, args.layers, width, work, int(mb * (1 << 20)), load,
                                        timings(name))
            plans = tuple(steps)
        cases: dict[str, Callable[[], object]] = dict(steps)
        if sharded:
            cases.update({"bare compute": bare["compute"], "bare fsdp": issued_inline(bare["fsdp"])})
        for fn in cases.values():
            fn()  # a first warm-up (replicate fixes its bucket order on it); timed_interleaved runs the second
        med = {name: t * 1e3 for name, t in timed_interleaved(cases, args.reps, WORLD, polled=True).items()}
        dp = med["blocking"] - med["compute"]
        fsdp = med["bare fsdp"] - med["bare compute"] if sharded else float("nan")
        comm = {plan: fsdp if plan.startswith("fsdp") else dp for plan in plans}
        # each plan's compute-only step: the compute step with this plan's own optimizer work
        # (a sharded plan updates 1/ranks of the parameters: that saving is not hidden communication)
        opt_ms = {p: WORLD.allreduce(statistics.median(optimizer_times[p]) * 1e3 if optimizer_times.get(p) else 0.0,
                                     op=MPI.MAX) for p in plans}
        # (fsdp's own includes starting the next gather: the update alone is fsdp-ondemand's)
        update = {p: opt_ms.get("fsdp-ondemand", t) if p.startswith("fsdp") else t for p, t in opt_ms.items()}
        base = {plan: med["compute"] - update["compute"] + update[plan] for plan in plans}
        if WORLD.rank == 0:
            print(f"{kind:>8} all medians: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
            if args.optimizer:
                print(f"{kind:>8} optimizer step medians: " + ", ".join(f"{k} {v:.2f}" for k, v in opt_ms.items()))
            for plan in plans[1:]:
                exposed = med[plan] - base[plan]
                c = comm[plan]
                print(f"{kind:>8} {plan:>15} {base[plan]:8.2f} {c:8.2f} {med[plan]:8.2f} {exposed:8.2f} "
                      f"{exposed / c if c > 0 else float('nan'):8.2f} {med[plan] / max(base[plan], c):8.2f}")
        if args.trace and kind == args.kinds.split(",")[0]:
            for plan in ("compute", *(p for p in ("replicate", "fsdp") if p in steps)):  # (not in a sweep)
                root, ext = os.path.splitext(args.trace)
                with dt.trace(f"{root}-{plan}-{kind}{ext or '.json'}"), dt.trace_span("step"):
                    steps[plan]()
    if WORLD.rank == 0:
        print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
