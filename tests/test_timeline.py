"""The timeline (dtorch_mpi/timeline.py): a traced replicate / fully_shard step writes valid
Chrome trace-event JSON per rank with the collectives a CommCounter counts (kinds, bytes,
lanes), the backward nodes inside the backward and the user spans; nothing is recorded when
tracing is off; the per-rank files merge; DTORCH_TRACE traces a whole program."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import Any

import pytest
from conftest import RANK, SIZE, WORLD, Checker

import dtorch_mpi as dt
from dtorch_mpi import timeline
from dtorch_mpi.comm import counter
from dtorch_mpi.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import train_mlp


def _step(plan: str, mesh: dt.DeviceMesh) -> Any:
    dt.manual_seed(0)
    model = train_mlp.MLP(3, mesh)
    train_mlp.apply_plan(model, plan)
    opt = dt.optim.SGD(list(model.parameters()), lr=0.1)
    x_full, y_full = train_mlp.dataset("regression")
    x = dt.distribute_tensor(x_full, mesh, [dt.Shard(0)])
    y = dt.distribute_tensor(y_full, mesh, [dt.Shard(0)])

    def step() -> None:
        opt.zero_grad()
        with dt.trace_span("forward"):
            loss = F.mse_loss(model(x), y)
        loss.backward()
        with dt.trace_span("optimizer"):
            opt.step()

    return step


@pytest.mark.parametrize("plan", ["replicate", "fsdp"])
def test_a_traced_step_is_chrome_trace_json_with_every_collective(plan: str, mesh1d: dt.DeviceMesh,
                                                                  shared_dir: str, check: Checker) -> None:
    step = _step(plan, mesh1d)
    step()  # the first step fixes replicate's bucket order; trace the second
    path = os.path.join(shared_dir, "trace.json")
    with dt.trace(path) as t, dt.CommCounter() as moved:
        step()
    check.true(t.path == os.path.join(shared_dir, f"trace.rank{RANK}.json"), f"path {t.path}")
    with open(t.path) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    check.true(all(isinstance(e["ts"], float) and e["dur"] >= 0 and e["pid"] == RANK for e in xs), "X fields")
    comm = [e for e in xs if e["cat"] == "comm"]
    check.true(len(comm) == moved.count, f"{len(comm)} collective events, CommCounter {moved.count}")
    check.true(Counter(e["name"] for e in comm) == Counter(moved.kinds()), "collective kinds")
    check.true(sorted(e["args"]["bytes_sent"] for e in comm) == sorted(r.bytes_sent for r in moved.records),
               "collective bytes")
    check.true(all((e["tid"] >= timeline.ASYNC_LANE) == e["args"]["nonblocking"] for e in comm),
               "nonblocking collectives in the in-flight lanes, blocking in the comm lane")
    (whole,) = [e for e in xs if e["name"] == "backward()"] or [None]
    check.true(whole is not None, "one backward() event")
    nodes = [e for e in xs if e["cat"] == "backward" and e["name"] != "backward()"]
    check.true(len(nodes) > 3, f"{len(nodes)} backward node events")
    if whole is not None:
        inside = [e["ts"] >= whole["ts"] and e["ts"] + e["dur"] <= whole["ts"] + whole["dur"] + 1 for e in nodes]
        check.true(all(inside), "every backward node inside backward()")
        started = [e for e in comm if e["args"]["nonblocking"] and e["name"] in ("all_reduce", "reduce_scatter")]
        check.true(SIZE == 1 or len(started) > 0, "gradient reductions are nonblocking")
        check.true(all(whole["ts"] <= e["ts"] <= whole["ts"] + whole["dur"] for e in started),
                   "the gradient reductions start during backward")
    check.true({e["name"] for e in xs if e["cat"] == "user"} == {"forward", "optimizer"}, "user spans")
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    check.true(all(e["tid"] in names for e in xs), "every lane is named")
    WORLD.Barrier()
    if RANK == 0:
        merged = timeline.merge([timeline.rank_path(path, r) for r in range(SIZE)], path)
        with open(merged) as f:
            pids = {e["pid"] for e in json.load(f)["traceEvents"]}
        check.true(pids == set(range(SIZE)), f"merged pids {pids}")
    check.done()


def test_off_records_nothing(mesh1d: dt.DeviceMesh, shared_dir: str, check: Checker) -> None:
    step = _step("replicate", mesh1d)
    with dt.trace(os.path.join(shared_dir, "t.json")) as t:
        step()
    n = len(t.events)
    check.true(timeline.current is None and counter.on_started is None and t.counter not in counter._active,
               "tracing is off after the block")
    step()
    check.true(len(t.events) == n, "events recorded after the trace stopped")
    check.true(isinstance(dt.trace_span("x"), type(timeline._OFF)), "a span when off is the shared no-op")
    with pytest.raises(RuntimeError, match="no trace"):
        timeline.stop()
    with dt.trace(os.path.join(shared_dir, "u.json")), pytest.raises(RuntimeError, match="already"):
        timeline.start(os.path.join(shared_dir, "v.json"))
    check.done()


@pytest.mark.skipif(SIZE > 1, reason="launches mpiexec; runs in the 1-process pass")
def test_dtorch_trace_environment_traces_the_program(tmp_path: Any) -> None:
    from mpi_launch import mpiexec

    path = str(tmp_path / "run.json")
    proc = mpiexec(2, sys.executable, "examples/train_mlp.py", "--plan", "replicate", "--steps", "2",
                   env={**os.environ, "DTORCH_TRACE": path})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        with open(timeline.rank_path(path, r)) as f:
            events = json.load(f)["traceEvents"]
        kinds = Counter(e["name"] for e in events if e.get("cat") == "comm")
        assert kinds["all_reduce"] >= 2 and sum(e["name"] == "backward()" for e in events) == 2, kinds
