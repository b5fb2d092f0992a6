"""scripts/run_tests.py, the suite's driver: which runs it makes, how it reads a run's JUnit
report, and the passes ``--extra-pass`` adds (CI judges its closing line)."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import RUN_ONCE
from mpi_launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
try:
    import run_tests
finally:
    sys.path.pop(0)

pytestmark = RUN_ONCE  # pure functions of the driver

PIP = run_tests.Pass("pip", "python", "mpiexec", [1, 2, 3, 4], ["auto", "variable", "padded"])


def test_plan_runs_one_process_once_and_marks_the_first_path() -> None:
    phdf5 = run_tests.Pass("phdf5", "py5", "mpx5", [1, 2], ["auto"], ["tests/test_checkpoint.py"])
    got = [(p.name, path, n, first) for p, path, n, first in run_tests.plan([PIP, phdf5], {2, 4})]
    assert got == [("pip", "auto", 1, True), ("pip", "auto", 2, True), ("pip", "auto", 3, True),
                   ("pip", "auto", 4, True), ("pip", "variable", 2, False), ("pip", "variable", 4, False),
                   ("pip", "padded", 2, False), ("pip", "padded", 4, False), ("phdf5", "auto", 1, True),
                   ("phdf5", "auto", 2, True)]
    every = [(path, n) for _, path, n, first in run_tests.plan([PIP], {1, 2, 3, 4}) if not first]
    assert every == [("variable", 2), ("variable", 3), ("variable", 4), ("padded", 2), ("padded", 3), ("padded", 4)]


def test_runs_side_by_side_only_while_their_ranks_fit() -> None:
    pick = run_tests.next_run
    assert pick([], [], 3, 2) is None
    assert pick([4, 1], [], 3, 2) == 0  # nothing running: the next run, whatever its size
    assert pick([2, 1], [1], 3, 2) == 0  # beside the 1-process run: a 2-rank run fits
    assert pick([3, 4, 2], [1], 3, 2) == 2  # the first that fits, not the first in the plan
    assert pick([1], [2], 3, 1) is None  # --jobs 1: one at a time
    assert pick([1], [1, 1], 3, 2) is None  # two running already
    assert pick([2, 3], [2], 3, 2) is None  # nothing fits beside a 2-rank run but a 1-process one


def test_extra_pass_specs() -> None:
    spec = run_tests.parse_pass("emu sizes=1,2 paths=auto env=DTORCH_SEED=1 env=Y=a=b tests=tests/a.py,tests/b.py", PIP)
    assert (spec.name, spec.python, spec.mpiexec, spec.sizes, spec.paths, spec.tests, spec.env) == (
        "emu", "python", "mpiexec", [1, 2], ["auto"], ["tests/a.py", "tests/b.py"], {"DTORCH_SEED": "1", "Y": "a=b"})
    with pytest.raises(SystemExit, match="begin with the pass's name"):
        run_tests.parse_pass("sizes=1", PIP)
    with pytest.raises(SystemExit, match="'colour=red' is not"):
        run_tests.parse_pass("emu colour=red", PIP)
    with pytest.raises(SystemExit, match="'=1' is not NAME=VALUE"):
        run_tests.parse_pass("emu env==1", PIP)


def test_phdf5_env_assignments() -> None:
    """``--phdf5-env`` (make test: LD_PRELOAD of scripts/ucx_yield.c) takes NAME=VALUE words."""
    assert run_tests._assignments(["LD_PRELOAD=/x/a.so", "A=b=c", "E="], "--phdf5-env") == {
        "LD_PRELOAD": "/x/a.so", "A": "b=c", "E": ""}
    for bad in ("LD_PRELOAD", "=x"):
        with pytest.raises(SystemExit, match=f"--phdf5-env: '{bad}' is not NAME=VALUE"):
            run_tests._assignments([bad], "--phdf5-env")


def test_counts_come_from_the_junit_report(tmp_path: os.PathLike) -> None:
    path = os.path.join(tmp_path, "junit.xml")
    with open(path, "w") as fh:
        fh.write('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" '
                 'failures="2" skipped="3" tests="10" time="1.0"></testsuite></testsuites>')
    assert run_tests.report_counts(path) == {"passed": 4, "failed": 2, "errors": 1, "skipped": 3}
    assert run_tests.report_counts(os.path.join(tmp_path, "missing.xml")) is None
    with open(path, "w") as fh:
        fh.write("<testsuites><testsuite")  # a run killed while writing
    assert run_tests.report_counts(path) is None


FAKE_PYTEST = """#!/bin/sh
# stands in for 'python -m pytest ... --junitxml=PATH': writes a report of {failures} failure(s) out
# of 3 tests and exits 1 on its first call (counted in {calls}), {second} on the next
for arg in "$@"; do case "$arg" in --junitxml=*) report="${{arg#--junitxml=}}";; esac; done
echo '<testsuites><testsuite name="pytest" errors="0" failures="{failures}" skipped="0" tests="3"></testsuite></testsuites>' > "$report"
echo x >> {calls}
[ "$(wc -l < {calls})" -gt 1 ] && exit {second}
echo 'Exception ignored in: <generator object planted>'
exit 1
"""


@pytest.mark.parametrize("failures, second, calls, rc", [(0, 0, 2, 0), (0, 1, 2, 1), (1, 0, 1, 1)])
def test_a_run_that_exits_non_zero_with_every_test_passed_is_made_once_more(
        tmp_path: os.PathLike, capsys: pytest.CaptureFixture[str], failures: int, second: int, calls: int,
        rc: int) -> None:
    """Exit 1 with a clean report (an error at pytest's end): made again, and the summary says
    why; a second such exit fails, and a run with a failing test is never made again."""
    counter = os.path.join(tmp_path, "calls")
    script = os.path.join(tmp_path, "fake-python")
    with open(script, "w") as fh:
        fh.write(FAKE_PYTEST.format(failures=failures, calls=counter, second=second))
    os.chmod(script, 0o755)
    spec = run_tests.Pass(f"rerun-test-{failures}{second}", script, "mpiexec", [1], ["auto"])
    rerun: dict[int, str] = {}
    results = run_tests.run_all(run_tests.plan([spec], {2}), [], 60, 3, 1, rerun)
    assert len(open(counter).read().split()) == calls
    assert (results[0].rc != 0) == bool(rc)
    if failures:
        assert not rerun
    else:
        assert "exited 1 with no failure in its report" in rerun[0] and "planted" in rerun[0], rerun
    assert "making" in capsys.readouterr().out or failures
