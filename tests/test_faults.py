"""Fault injection: a rank killed (SIGKILL) in the middle of a checkpoint save leaves the
previous checkpoint in place, bit for bit, and loadable; an I/O error reported on one rank by a
collective write makes every rank raise instead of hanging (both HDF5 stacks: the cases run
under the interpreter of the stack being tested)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest
from conftest import RUN_ONCE
from mpi_launch import mpiexec

import dtorch_mpi as dt

# launches its own 2-rank mpiexec jobs; a killed save or an I/O error behaves the same on every
# collective path
pytestmark = RUN_ONCE

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_sigkill_during_save_keeps_the_previous_checkpoint(mode: str) -> None:
    workdir = tempfile.mkdtemp(prefix="dtorch-kill-")
    path = os.path.join(workdir, "model.h5")
    try:
        proc = mpiexec(2, sys.executable, os.path.join(HERE, "harness_cases", "kill_during_save.py"), path,
                       mode, timeout=120)
        assert proc.returncode != 0, proc.stdout + proc.stderr
        assert "the kill did not happen" not in proc.stdout
        with open(path, "rb") as now, open(path + ".A", "rb") as before:
            assert now.read() == before.read(), "the previous checkpoint changed"
        with dt.init_device_mesh("cpu", (1,)) as mesh:
            target = {f"layer{i}.w": dt.zeros(9, 4, dtype=np.float64, device_mesh=mesh) for i in range(3)}
            dt.load(path, target)
            for i in range(3):
                assert np.all(target[f"layer{i}.w"].to_torch() == i)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_io_error_in_a_collective_write_does_not_hang() -> None:
    workdir = tempfile.mkdtemp(prefix="dtorch-ioerr-")
    try:
        proc = mpiexec(2, sys.executable, os.path.join(HERE, "harness_cases", "io_error_during_save.py"),
                       os.path.join(workdir, "model.h5"), timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert "rank 0 raised CheckpointError" in out and "rank 1 raised CheckpointError" in out, out
        assert "previous checkpoint intact" in out, out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
