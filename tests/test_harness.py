"""Self-test of the MPI harness: one rank's failure is every rank's, and nothing hangs."""

from __future__ import annotations

import os
import sys
import time

from conftest import RUN_ONCE
from mpi_launch import ROOT, child_env, mpiexec

# launches its own 2-rank mpiexec jobs; the harness's verdicts, deadlines and abort do not depend
# on the collective path
pytestmark = RUN_ONCE

HERE = os.path.dirname(os.path.abspath(__file__))


def _launch(case: str, extra: list[str], limit: int, **env_extra: str) -> tuple[int, str, float]:
    # --color=no: Open MPI gives each rank's stdout a pseudo-terminal even when piped
    start = time.monotonic()
    proc = mpiexec(2, os.path.join(HERE, "rank_wrapper.sh"), sys.executable, "-m", "pytest", "-q",
                   "--color=no", "--with-mpi", "-p", "no:randomly", os.path.join(HERE, "harness_cases", case),
                   *extra, timeout=limit, env=child_env(DTORCH_TEST_ALL_OUTPUT="1", **env_extra))
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def test_failure_on_one_rank_is_reported_by_every_rank() -> None:
    rc, out, _ = _launch("case_one_rank_fails.py", [], 120)
    assert rc != 0
    # both ranks print their own summary: each must count the planted test as failed
    assert out.count("1 failed, 1 passed") == 2, out
    assert "failed on rank(s) [1] of 2" in out, out


def test_a_hung_rank_ends_the_run() -> None:
    rc, out, elapsed = _launch("case_one_rank_hangs.py", ["--timeout=5"], 120)
    assert rc != 0
    assert "Timeout" in out, out
    assert elapsed < 60, f"the run took {elapsed:.0f}s"


def test_spmd_debug_mode_names_a_planted_divergence() -> None:
    rc, out, elapsed = _launch("case_divergent_collectives.py", ["--timeout=20", "-s"], 120,
                               DTORCH_SPMD_DEBUG="1")
    assert rc == 0, out
    assert "group rank 0: all_gather" in out and "group rank 1: all_to_all" in out, out
    assert elapsed < 60


def _this_checkout(env: dict[str, str]) -> dict[str, str]:
    """A plain script imports dtorch_mpi from this checkout (not an installed copy)."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def test_an_uncaught_exception_on_one_rank_ends_the_job() -> None:
    """Rank 1 raises, rank 0 waits in a collective: the hook prints the rank and the traceback
    and aborts the job. The figure printed is the time from the raise to the job's end."""
    script = os.path.join(HERE, "harness_cases", "abort_on_exception.py")
    env = _this_checkout(child_env())
    env.pop("DTORCH_ABORT_ON_EXCEPTION", None)
    proc = mpiexec(2, sys.executable, script, timeout=120, env=env)
    ended = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "uncaught RuntimeError on rank 1 of 2; aborting the whole job" in out, out
    assert "planted failure on rank 1" in out and "Traceback" in out, out
    assert "rank 0 was not stopped" not in out, out
    raised = float(out.split("RAISING AT ")[1].split()[0])
    print(f"exception to end of job: {ended - raised:.2f} s")
    assert ended - raised < 20, f"the job took {ended - raised:.1f}s to end after the exception"


def test_abort_on_exception_can_be_turned_off() -> None:
    """DTORCH_ABORT_ON_EXCEPTION=0: the hook is not installed (rank 0 stays in its collective
    until the launcher's own timeout ends it)."""
    code = ("import dtorch_mpi as dt, dtorch_mpi.abort as a; m = dt.init_device_mesh('cpu', (2,)); "
            "import sys; sys.stdout.write(f'installed={a.installed()}\\n'); m.free()")
    for value, want in (("0", "installed=False"), ("1", "installed=True")):
        env = _this_checkout(child_env(DTORCH_ABORT_ON_EXCEPTION=value))
        proc = mpiexec(2, sys.executable, "-c", code, timeout=120, env=env)
        assert proc.returncode == 0 and proc.stdout.count(want) == 2, proc.stdout + proc.stderr


def test_a_skipped_collective_raises_collective_timeout_error() -> None:
    rc, out, elapsed = _launch("case_collective_timeout.py", ["--timeout=60", "-s"], 120,
                               DTORCH_COLLECTIVE_TIMEOUT="3")
    assert rc == 0, out
    assert "CollectiveTimeoutError" in out or "did not complete within DTORCH_COLLECTIVE_TIMEOUT=3s" in out, out
    assert "metadata check (Allreduce) did not complete" in out, out  # the library's own small collectives too
    assert elapsed < 60
