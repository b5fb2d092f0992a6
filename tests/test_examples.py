"""The examples run under mpiexec and print what they promise."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
from mpi4py import MPI
from mpi_launch import mpiexec
from mpi_launch import run as launch

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="launches mpiexec; runs in the 1-process pass")


def run(n: int, *args: str) -> str:
    proc = mpiexec(n, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_quickstart() -> None:
    out = run(4, sys.executable, "examples/quickstart.py")
    assert "local shapes by rank: [(4, 3), (4, 3), (4, 3), (4, 2)]" in out
    assert "PlacementError, suggested fix:" in out and "after the fix: (Partial(\"sum\"),)" in out
    assert "saved and reloaded: True" in out and "randn identical across placements: True" in out
    assert "quickstart done" in out


def test_tensor_parallel_mlp() -> None:
    out = run(4, sys.executable, "examples/tensor_parallel_mlp.py")
    assert "equals the NumPy reference: True" in out
    assert "all_reduce  0             1" in out


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
