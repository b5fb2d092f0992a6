"""The examples run under mpiexec and print what they promise."""

from __future__ import annotations

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
