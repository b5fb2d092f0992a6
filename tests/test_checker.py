"""The ``check`` fixture (conftest.Checker) cannot be forgotten: teardown verifies what a test
recorded, and what an explicit ``done()`` already reported is not reported twice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mpi4py import MPI
from mpi_launch import child_env

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="runs its own pytest; runs in the 1-process pass")
def test_the_check_fixture_verifies_at_teardown() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--color=no", "-p", "no:randomly", "-p", "no:cacheprovider",
                           os.path.join(HERE, "harness_cases", "case_checker_teardown.py")],
                          capture_output=True, text=True, timeout=120, env=child_env(), cwd=HERE)
    out = proc.stdout + proc.stderr
    assert "1 failed, 4 passed, 2 errors" in out, out  # pytest counts a test whose teardown errs as passed too
    assert "ERROR at teardown of test_a_forgotten_done_fails_at_teardown" in out, out
    assert "ERROR at teardown of test_failures_after_a_done_are_still_reported" in out, out
    assert "FAILED" in out and "test_a_failed_done_is_reported_once" in out, out
    assert "ERROR at teardown of test_a_failed_done_is_reported_once" not in out, out  # reported once
