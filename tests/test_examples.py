"""The examples run under mpiexec and print what they promise."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np
from conftest import RUN_ONCE
from mpi_launch import child_env, mpiexec
from mpi_launch import run as launch

# launches its own mpiexec jobs (1-4 ranks) of the examples, end-to-end demos: every collective
# they make is checked on every path by test_redistribute, test_comm and test_mpi_trace
pytestmark = RUN_ONCE


def run(n: int, *args: str) -> str:
    proc = mpiexec(n, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def results(n: int, script: str, *args: str) -> tuple[str, dict[str, np.ndarray]]:
    """Run an example; its printed output and the arrays it saved (``DTORCH_EXAMPLE_RESULTS``),
    from which the test computes the verdicts itself (never the example's own printed ones).
    ``{tmp}`` in ``args`` is a fresh directory removed afterwards (a checkpoint path)."""
    directory = tempfile.mkdtemp()
    try:
        path = os.path.join(directory, "results.npz")
        argv = [a.replace("{tmp}", directory) for a in args]
        proc = mpiexec(n, sys.executable, script, *argv, env=child_env(DTORCH_EXAMPLE_RESULTS=path))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        with np.load(path) as saved:
            return proc.stdout, dict(saved)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_quickstart() -> None:
    out, got = results(4, "examples/quickstart.py", "{tmp}/quickstart.h5")
    assert "local shapes by rank: [(4, 3), (4, 3), (4, 3), (4, 2)]" in out
    assert "PlacementError, suggested fix:" in out and "after the fix: (Partial(\"sum\"),)" in out
    assert "quickstart done" in out
    full = np.arange(44, dtype=np.float32).reshape(4, 11)
    assert np.array_equal(got["full"], full)
    assert np.allclose(got["matmul"], full @ np.ones((11, 2))) and np.allclose(got["fixed"], full @ np.ones((11, 2)))
    assert np.array_equal(got["weights.weight"], np.ones((9, 11))) and np.array_equal(got["weights.bias"], np.zeros(9))
    for k in ("weight", "bias"):  # saved, reloaded into a replicated module
        assert np.array_equal(got[f"reloaded.{k}"], got[f"weights.{k}"]), k
    assert got["randn_sharded"].shape == (5, 7) and np.array_equal(got["randn_sharded"], got["randn_replicated"])
    assert np.unique(got["randn_sharded"]).size == 35  # random numbers, not a constant


def test_tensor_parallel_mlp() -> None:
    out, got = results(4, "examples/tensor_parallel_mlp.py")
    assert "all_reduce  0             1" in out
    x, w0, b0, w2, b2 = (got[k] for k in ("x", "0.weight", "0.bias", "2.weight", "2.bias"))
    assert w0.shape == (19, 16) and x.shape == (5, 16)  # hidden 4 * 4 + 3: uneven over 4 ranks
    np.testing.assert_allclose(got["y"], np.maximum(x @ w0.T + b0, 0) @ w2.T + b2, rtol=1e-12, atol=1e-12)
    for k in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert np.array_equal(got[f"gathered.{k}"], got[k]), k


def test_checkpoint_reshard() -> None:
    directory = tempfile.mkdtemp()
    try:
        proc = launch([sys.executable, "examples/checkpoint_reshard.py", directory], timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "saved at 4 ranks" in proc.stdout
        assert "loaded at 2 ranks: weights equal True, forward equals NumPy True" in proc.stdout
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_train_mlp_same_curve_on_every_plan_and_rank_count() -> None:
    curves = {}
    for ranks, plan in (("1", "replicated"), ("3", "dp"), ("2", "replicate"), ("3", "tp"), ("4", "dp_tp"), ("3", "fsdp"), ("4", "fsdp_tp")):
        out = run(int(ranks), sys.executable, "examples/train_mlp.py", "--plan", plan, "--optimizer", "adamw",
                  "--task", "classification", "--steps", "5")
        curves[(ranks, plan)] = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]
        deviation = [line for line in out.splitlines() if line.startswith("max |loss - NumPy reference|")]
        assert deviation and float(deviation[0].split()[5].rstrip(",")) < 1e-9, out
    first = curves[("1", "replicated")]
    assert len(first) == 5 and first[-1] < first[0], first
    for key, curve in curves.items():
        assert max(abs(a - b) for a, b in zip(curve, first)) < 1e-9 and len(curve) == 5, (key, curve, first)


def _curve(out: str, prefix: str = "step ") -> dict[int, float]:
    return {int(line.split()[-3]): float(line.split()[-1]) for line in out.splitlines() if line.startswith(prefix)}


def test_train_transformer_block_whole_heads_same_curve_and_resume() -> None:
    """4 heads over 3 ranks stay whole (2/1/1); the loss falls and its curve equals the one-rank
    run. Saved after step 4 on 3 ranks (tp), resumed on the replicated plan in the same launch
    and at 1 rank in a second launch, the curve continues identically."""
    directory = tempfile.mkdtemp()
    checkpoint = os.path.join(directory, "block.h5")
    try:
        one = run(1, sys.executable, "examples/train_transformer_block.py", "--steps", "10")
        out = run(3, sys.executable, "examples/train_transformer_block.py", "--steps", "10",
                  "--checkpoint", checkpoint, "--save-at", "4", "--resume-plan", "replicated")
        again = run(1, sys.executable, "examples/train_transformer_block.py", "--steps", "10",
                    "--checkpoint", checkpoint, "--resume")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert "loss decreased: True" in one and "loss decreased: True" in out, one + out
    assert "heads per rank: [2, 1, 1]" in out and "optimizer step: 0 (none)" in out, out
    assert "forward: 5 (all_reduce" in out and "backward: 3 (all_reduce" in out, out
    curves = [_curve(one), _curve(out)]
    assert list(curves[0]) == list(range(10)) and max(abs(curves[0][s] - curves[1][s]) for s in range(10)) < 1e-9
    resumed, later = _curve(out, "resumed step "), _curve(again)
    assert list(resumed) == list(range(4, 10)) and list(later) == list(range(4, 10)), (resumed, later)
    assert max(abs(resumed[s] - curves[1][s]) for s in resumed) < 1e-12, (resumed, curves[1])
    assert max(abs(later[s] - curves[1][s]) for s in later) < 1e-9, (later, curves[1])
    assert "resumed on plan replicated from step 4" in out and f"resumed from {checkpoint} at step 4" in again


def test_train_transformer_block_fsdp_same_curve_and_resume_across_plans() -> None:
    """The fsdp plan (one fully_shard unit, batch rows per rank, uneven at 3 ranks, attention
    and MLP activation-checkpointed) gives the replicated one-rank curve; saved after step 4 at
    3 ranks, it resumes on the tp plan in the same launch and fully sharded at 2 ranks."""
    directory = tempfile.mkdtemp()
    checkpoint = os.path.join(directory, "block.h5")
    try:
        one = run(1, sys.executable, "examples/train_transformer_block.py", "--steps", "8", "--plan", "replicated")
        out = run(3, sys.executable, "examples/train_transformer_block.py", "--steps", "8", "--plan", "fsdp",
                  "--checkpoint", checkpoint, "--save-at", "4", "--resume-plan", "tp")
        again = run(2, sys.executable, "examples/train_transformer_block.py", "--steps", "8", "--plan", "fsdp",
                    "--checkpoint", checkpoint, "--resume")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert "plan fsdp" in out and "loss decreased: True" in out, out
    assert "reduce_scatter" in out and "all_gather" in out, out  # fully sharded: gathered and reduce-scattered
    want, got = _curve(one), _curve(out)
    assert list(want) == list(range(8)) and list(got) == list(range(8)), (want, got)
    assert max(abs(got[s] - want[s]) for s in want) < 1e-9, (got, want)
    resumed, later = _curve(out, "resumed step "), _curve(again)
    assert list(resumed) == list(range(4, 8)) and list(later) == list(range(4, 8)), (resumed, later)
    assert max(abs(resumed[s] - want[s]) for s in resumed) < 1e-9, (resumed, want)
    assert max(abs(later[s] - want[s]) for s in later) < 1e-9, (later, want)
