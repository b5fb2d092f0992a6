#!/usr/bin/env python3
"""Run the test suite in one process and under mpiexec at several sizes and comm paths.

A *pass* is one Python stack (interpreter, launcher, test files, extra environment) run at each
world size on each collective path (the 1-process run on its first path only: nothing reaches
the collective backend at one rank); the pip stack is the first pass, the parallel-HDF5 stack
(``--phdf5-python``) and any ``--extra-pass`` follow. On every path but a pass's first, pytest
gets ``--skip-path-independent`` (tests marked ``path_independent`` ran already); under mpiexec
the tests marked ``rank_independent`` are deselected by tests/conftest.py (they ran in the
1-process run). Results are read from each run's JUnit XML report (rank 0 writes it; its
verdicts are every rank's). Every run is bounded (``--run-timeout``); a hung run is killed, and a
run that exits non-zero without a report (or without a failure in it) counts one failure. A run
whose report shows every test passed but which exits non-zero (an error at pytest's end, such as
an exception in a finaliser collected by its last garbage collection, or in MPI's shutdown) is
made once more: the summary says so and prints the first try's error lines (CI keeps only the end
of the output); a second such exit fails. Test failures are never made again.
The last line is the total over all runs, ``total: N passed, N failed, N skipped``.

With ``--jobs 2`` (``make test JOBS=2``) runs are made side by side while their ranks fit
``--rank-budget`` (cores + 1): in practice the 1-process run beside the 2-rank runs. The
1-process run holds the tests that launch their own mpiexec jobs and wait for deadlines, so it
leaves a core partly idle; a run of 3 or more ranks runs alone. On 2 cores it gained ~9 % on
those runs in one try (the 2-rank runs took 2.5x as long beside it), so ``make test`` keeps 1.
Each run's output goes to ``.mpi-logs/<run>/output.txt`` and is printed whole when it ends.

Runs write bytecode caches even where ``PYTHONDONTWRITEBYTECODE`` is set (it is dropped from the
runs' environment unless a pass sets it): without them every rank of every run compiled the
library and pytest rewrote every test module's asserts anew, about a second of CPU per process
(a one-file run: 1.95 -> 0.95 s), ~70 process starts per ``make test``.

Each stack runs with its own launcher, which is also handed to its tests as ``MPIEXEC`` (tests
that start their own ``mpiexec`` must use the launcher of the MPI their Python was built
against). pytest runs with ``--color=no``: Open MPI gives each rank a pseudo-terminal.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("passed", "failed", "errors", "skipped")
OK = (0, 5)  # 5: pytest collected nothing (every test of the run deselected), not a failure


@dataclass
class Pass:
    """One stack's runs: ``sizes`` x ``paths``, each ``python -m pytest tests...``."""

    name: str
    python: str
    mpiexec: str
    sizes: list[int]
    paths: list[str]
    tests: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    pytest_args: list[str] = field(default_factory=list)  # device=, k=


@dataclass
class Result:
    label: str
    rc: int
    seconds: float
    counts: dict[str, int]
    reported: bool  # whether a JUnit report was read
    logdir: str = ""  # its output.txt and, under mpiexec, the other ranks' rankN.log


def _assignments(words: list[str], option: str) -> dict[str, str]:
    """``NAME=VALUE`` words as a mapping (an environment for a pass's runs)."""
    if bad := [w for w in words if "=" not in w or w.startswith("=")]:
        raise SystemExit(f"{option}: {bad[0]!r} is not NAME=VALUE")
    return dict(w.partition("=")[::2] for w in words)


def parse_pass(text: str, defaults: Pass) -> Pass:
    """``NAME [python=P] [mpiexec=M] [sizes=1,2] [paths=auto] [env=K=V]... [tests=a.py,b.py]
    [device=emulated|cuda] [k=EXPR]``: a pass added to the plan (an emulated-device run, another
    MPI); ``device`` is pytest's ``--device``, ``k`` its ``-k``; unset fields come from the pip
    stack."""
    words = shlex.split(text)
    if not words or "=" in words[0]:
        raise SystemExit(f"--extra-pass {text!r}: begin with the pass's name")
    spec = Pass(words[0], defaults.python, defaults.mpiexec, list(defaults.sizes), list(defaults.paths),
                list(defaults.tests), {})
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key == "python":
            spec.python = value
        elif key == "mpiexec":
            spec.mpiexec = value
        elif key == "sizes":
            spec.sizes = [int(s) for s in value.split(",")]
        elif key == "paths":
            spec.paths = value.split(",")
        elif key == "tests":
            spec.tests = value.split(",")
        elif key == "env" and "=" in value:
            spec.env.update(_assignments([value], f"--extra-pass {text!r}"))
        elif key == "device":
            spec.pytest_args += ["--device", value]
        elif key == "k":
            spec.pytest_args += ["-k", value]
        else:
            raise SystemExit(f"--extra-pass {text!r}: {word!r} is not python=, mpiexec=, sizes=, paths=, "
                             f"env=NAME=VALUE, tests=, device= or k=")
    return spec


def plan(passes: list[Pass], other_path_sizes: set[int]) -> list[tuple[Pass, str, int, bool]]:
    """Every run: (pass, path, size, whether the path is the pass's first). The 1-process run is
    made on a pass's first path only: at one rank no collective reaches the backend
    (comm/prologue.py: a group of one returns at once), so the path cannot change it (the tests
    that launch their own mpiexec are rank_independent and path_independent). The other paths
    run at ``other_path_sizes`` only (default 2 and 4: an even split and, with the suite's
    lengths 5-7, uneven pieces; 3 ranks run on the first path, where ``auto`` takes the
    variable-size collectives for uneven pieces anyway)."""
    return [(spec, path, size, i == 0) for spec in passes for i, path in enumerate(spec.paths)
            for size in spec.sizes if i == 0 or (size > 1 and size in other_path_sizes)]


def report_counts(path: str) -> dict[str, int] | None:
    """passed/failed/errors/skipped from a pytest JUnit XML report (None when there is none)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    got = dict.fromkeys(KEYS, 0)
    for suite in root.iter("testsuite"):
        tests, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        got["failed"] += failed
        got["errors"] += errors
        got["skipped"] += skipped
        got["passed"] += tests - failed - errors - skipped
    return got


def next_run(weights: list[int], running: list[int], budget: int, jobs: int) -> int | None:
    """Which waiting run to start now (an index into ``weights``, the waiting runs' rank counts
    in plan order), given the rank counts ``running``: the first that keeps the ranks running
    within ``budget``, at most ``jobs`` runs at once; with nothing running, the first waiting
    one whatever its size (a 4-rank run on 2 cores runs alone). None: wait."""
    if not weights:
        return None
    if not running:
        return 0
    if len(running) >= jobs:
        return None
    room = budget - sum(running)
    return next((i for i, w in enumerate(weights) if w <= room), None)


@dataclass
class Started:
    """A run in progress: its process, output file and start time."""

    index: int
    label: str
    proc: subprocess.Popen[bytes]
    log: str
    start: float
    limit: int


def start_run(index: int, spec: Pass, path: str, size: int, first_path: bool, extra: list[str],
              limit: int) -> Started:
    """Start one run, its output going to ``.mpi-logs/<run>/output.txt`` (printed when it ends,
    so runs made side by side never interleave their lines)."""
    label = f"{spec.name} {path} n={size}"
    logdir = os.path.join(ROOT, ".mpi-logs", f"{spec.name}-{path}-n{size}")
    os.makedirs(logdir, exist_ok=True)
    junit = os.path.join(logdir, "junit.xml")
    if os.path.exists(junit):
        os.remove(junit)
    env = dict(os.environ, **spec.env, DTORCH_COMM_PATH=path, PYTHONUNBUFFERED="1", MPIEXEC=spec.mpiexec,
               DTORCH_TEST_LOGDIR=logdir)
    if "LD_PRELOAD" in spec.env and os.environ.get("LD_PRELOAD"):  # the pass's preload beside the caller's
        env["LD_PRELOAD"] = f"{spec.env['LD_PRELOAD']}:{os.environ['LD_PRELOAD']}"
    if "PYTHONDONTWRITEBYTECODE" not in spec.env:
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # see the module docstring: bytecode caches
    pytest_cmd = [spec.python, "-m", "pytest", "-q", "--color=no", f"--junitxml={junit}", *spec.pytest_args,
                  *spec.tests, *extra]
    if not first_path:
        pytest_cmd.append("--skip-path-independent")
    cmd = pytest_cmd if size == 1 else [*shlex.split(spec.mpiexec), "-n", str(size),
                                        os.path.join(ROOT, "tests", "rank_wrapper.sh"), *pytest_cmd, "--with-mpi"]
    log = os.path.join(logdir, "output.txt")
    print(f"=== start {label}: {' '.join(shlex.quote(c) for c in cmd)}  [DTORCH_COMM_PATH={path}]", flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Started(index, label, proc, log, time.monotonic(), limit)


def finish_run(run: Started, rc: int) -> Result:
    """Print the run's output and read its report."""
    seconds = time.monotonic() - run.start
    with open(run.log, errors="replace") as fh:
        sys.stdout.write(f"\n=== {run.label}\n" + fh.read())
    if rc == 124:
        print(f"!!! run exceeded {run.limit}s and was killed", flush=True)
    print(f"=== exit {rc} after {seconds:.1f}s", flush=True)
    got = report_counts(os.path.join(os.path.dirname(run.log), "junit.xml"))
    return Result(run.label, rc, seconds, got or dict.fromkeys(KEYS, 0), got is not None, os.path.dirname(run.log))


CLUES = ("Traceback", "Error", "Exception", "error:", "uncaught", "BAD TERMINATION", "Abort", "Segmentation", "killed")


def unexplained_exit(result: Result, lines: int = 12) -> str:
    """Why a run exited non-zero with no failure in its report: the lines of its ranks' logs that
    look like the cause (CI keeps only the end of the output, so these are printed beside the
    summary, not only in the run's output far above)."""
    logdir = result.logdir
    found: list[str] = []
    for name in sorted(os.listdir(logdir)) if os.path.isdir(logdir) else []:
        if name == "output.txt" or name.endswith(".log"):
            with open(os.path.join(logdir, name), errors="replace") as fh:
                found += [f"  {name}: {line.rstrip()[:200]}" for line in fh if any(c in line for c in CLUES)]
    head = f"{result.label} exited {result.rc} with no failure in its report; its logs' error lines:"
    return "\n".join([head, *(found[-lines:] or ["  (none: see .mpi-logs)"])])


def unexplained(result: Result) -> bool:
    """Every test of the run passed (its report says so) but the run exited non-zero."""
    return result.rc not in OK and result.reported and result.counts["failed"] == 0 and result.counts["errors"] == 0


def run_all(runs: list[tuple[Pass, str, int, bool]], extra: list[str], limit: int, budget: int,
            jobs: int, rerun: dict[int, str]) -> list[Result]:
    """Make every run, side by side where ``next_run`` lets them (each bounded by ``limit``
    seconds: a run past it is killed, exit 124); results in plan order. A run that exits
    non-zero although its report shows every test passed is made once more (test failures never
    are); ``rerun`` gets why (``unexplained_exit``), for the summary."""
    waiting = list(range(len(runs)))
    running: list[Started] = []
    results: dict[int, Result] = {}
    while waiting or running:
        while True:
            pick = next_run([runs[i][2] for i in waiting], [runs[r.index][2] for r in running], budget, jobs)
            if pick is None:
                break
            i = waiting.pop(pick)
            running.append(start_run(i, *runs[i], extra, limit))
        time.sleep(0.1)
        for run in list(running):
            rc = run.proc.poll()
            if rc is None and time.monotonic() - run.start > run.limit:
                os.killpg(run.proc.pid, 9)
                run.proc.wait()
                rc = 124
            if rc is not None:
                running.remove(run)
                result = finish_run(run, rc)
                if unexplained(result) and run.index not in rerun:
                    rerun[run.index] = unexplained_exit(result)
                    print(f"!!! {rerun[run.index]}\n!!! making {result.label} once more", flush=True)
                    waiting.insert(0, run.index)
                else:
                    results[run.index] = result
    return [results[i] for i in range(len(runs))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mpiexec", default=os.environ.get("MPIEXEC", "mpiexec"), help="the pip stack's launcher")
    ap.add_argument("--sizes", default="1,2,3,4", help="world sizes; 1 runs without mpiexec")
    ap.add_argument("--paths", default="auto,variable,padded", help="DTORCH_COMM_PATH values")
    ap.add_argument("--other-path-sizes", default="2,4",
                    help="world sizes at which the paths after the first run (of those in --sizes)")
    ap.add_argument("--run-timeout", type=int, default=900)
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs made side by side at most (2: the 1-process run, whose launched jobs partly wait "
                         "for deadlines, beside the 2-rank runs; see the module docstring)")
    ap.add_argument("--rank-budget", type=int, default=(os.cpu_count() or 1) + 1,
                    help="ranks of the runs made side by side at most (a run alone may have more)")
    ap.add_argument("--phdf5-python", default="", help="python of the parallel-HDF5 stack")
    ap.add_argument("--phdf5-mpiexec", default="mpiexec", help="the parallel-HDF5 stack's launcher")
    ap.add_argument("--phdf5-tests", default="tests/test_checkpoint.py tests/test_checkpoint_async.py "
                                           "tests/test_checkpoint_layouts.py tests/test_nn.py tests/test_faults.py")
    ap.add_argument("--phdf5-env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in the parallel-HDF5 runs' environment (make test: LD_PRELOAD of scripts/ucx_yield.c)")
    ap.add_argument("--phdf5-sizes", default="1,2,4",
                    help="world sizes of the parallel-HDF5 pass (of those in --sizes): uneven pieces at 4 already, "
                         "(Debian's MPICH spins in HDF5's MPI-IO collectives: without make's yield preload each "
                         "oversubscribed size costs a minute)")
    ap.add_argument("--extra-pass", action="append", default=[], metavar="SPEC",
                    help="another pass after the others: 'NAME [python=P] [mpiexec=M] [sizes=1,2] [paths=auto] "
                         "[env=K=V]... [tests=a.py,b.py] [device=emulated] [k=EXPR]' (unset fields: the pip stack's)")
    ap.add_argument("--only-extra", action="store_true", help="run the --extra-pass passes only")
    ap.add_argument("pytest_args", nargs="*", default=[])
    args = ap.parse_args()
    pip = Pass("pip", sys.executable, args.mpiexec, [int(s) for s in args.sizes.split(",")], args.paths.split(","))
    passes = [pip]
    if args.phdf5_python:
        phdf5_sizes = {int(n) for n in args.phdf5_sizes.split(",")}
        passes.append(Pass("phdf5", args.phdf5_python, args.phdf5_mpiexec, [n for n in pip.sizes if n in phdf5_sizes],
                           ["auto"], args.phdf5_tests.split(), env=_assignments(args.phdf5_env, "--phdf5-env")))
    passes += [parse_pass(text, pip) for text in args.extra_pass]
    if args.only_extra:
        passes = passes[1 + bool(args.phdf5_python):]

    runs = plan(passes, {int(s) for s in args.other_path_sizes.split(",")})
    rerun: dict[int, str] = {}
    results = run_all(runs, args.pytest_args, args.run_timeout, args.rank_budget, args.jobs, rerun)

    total = dict.fromkeys(KEYS, 0)
    bad_runs = []
    print("\nruns:")
    for i, r in enumerate(results):
        for k in KEYS:
            total[k] += r.counts[k]
        c = r.counts
        print(f"  {r.label:<24} {r.seconds:6.1f}s  {c['passed']} passed, {c['failed'] + c['errors']} failed, "
              f"{c['skipped']} skipped" + ("" if r.reported else "  (no report)")
              + ("  (made twice: see below)" if i in rerun else ""))
        if r.rc not in OK:
            bad_runs.append(f"{r.label} (exit {r.rc})")
            if c["failed"] == 0 and c["errors"] == 0:
                total["failed"] += 1
    print(f"  {'all runs':<24} {sum(r.seconds for r in results):6.1f}s")
    for _, why in sorted(rerun.items()):  # a flake of the harness or of MPI's exit, never of a test
        print(f"made twice: {why}")
    if bad_runs:
        print("failed runs: " + ", ".join(bad_runs))
        for r in results:
            if unexplained(r):
                print(unexplained_exit(r))
    print(f"total: {total['passed']} passed, {total['failed'] + total['errors']} failed, {total['skipped']} skipped")
    return 1 if bad_runs else 0


if __name__ == "__main__":
    sys.exit(main())
