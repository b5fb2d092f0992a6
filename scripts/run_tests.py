#!/usr/bin/env python3
"""Run the test suite in one process and under mpiexec at several sizes and comm paths.

Every run is bounded (``--run-timeout``); a hung run is killed and counted as failed. The
last line is the total over all runs, ``total: N passed, N failed, N skipped``.

Each stack (the pip venv; optionally the parallel-HDF5 venv) runs with its own launcher, which
is also handed to its tests as ``MPIEXEC`` (tests that start their own ``mpiexec`` must use the
launcher of the MPI their Python was built against). pytest runs with ``--color=no``: Open MPI
gives each rank a pseudo-terminal, and the summary lines parsed here must be plain text.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd: list[str], env: dict[str, str], limit: int) -> tuple[int, str]:
    print(f"\n=== {' '.join(shlex.quote(c) for c in cmd)}  [DTORCH_COMM_PATH={env.get('DTORCH_COMM_PATH', 'auto')}]",
          flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
            if time.monotonic() - start > limit:
                raise subprocess.TimeoutExpired(cmd, limit)
        rc = proc.wait(timeout=max(1, limit - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        print(f"!!! run exceeded {limit}s and was killed", flush=True)
        rc = 124
    print(f"=== exit {rc} after {time.monotonic() - start:.1f}s", flush=True)
    return rc, "".join(lines)


def counts(text: str) -> dict[str, int]:
    summary = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    result = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    if summary:
        last = summary[-1]
        for key, word in (("passed", "passed"), ("failed", "failed"), ("skipped", "skipped"),
                          ("errors", "error")):
            m = re.search(rf"(\d+) {word}", last)
            if m:
                result[key] = int(m.group(1))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mpiexec", default=os.environ.get("MPIEXEC", "mpiexec"), help="the pip stack's launcher")
    ap.add_argument("--sizes", default="1,2,3,4", help="world sizes; 1 runs without mpiexec")
    ap.add_argument("--paths", default="auto,variable,padded", help="DTORCH_COMM_PATH values")
    ap.add_argument("--run-timeout", type=int, default=900)
    ap.add_argument("--phdf5-python", default="", help="python of the parallel-HDF5 stack")
    ap.add_argument("--phdf5-mpiexec", default="mpiexec", help="the parallel-HDF5 stack's launcher")
    ap.add_argument("--phdf5-tests", default="tests/test_checkpoint.py tests/test_nn.py tests/test_faults.py")
    ap.add_argument("--device", default="", choices=("", "emulated", "cuda"),
                    help="pytest --device: emulated (tests/emulated_cupy, a test double) or cuda (a real GPU)")
    ap.add_argument("--gpu-backends", default="",
                    help="DTORCH_GPU_BACKEND values: every run once per backend (with --device)")
    ap.add_argument("pytest_args", nargs="*", default=[])
    args = ap.parse_args()
    python = sys.executable
    total = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    bad_runs = []
    stacks = [("pip", python, args.mpiexec, args.paths.split(","), args.pytest_args)]
    if args.phdf5_python:
        stacks.append(("phdf5", args.phdf5_python, args.phdf5_mpiexec, ["auto"],
                       args.phdf5_tests.split() + args.pytest_args))
    device = ["--device", args.device] if args.device else []
    gpu_backends = args.gpu_backends.split(",") if args.gpu_backends else [""]
    runs = [(stack, py, mpx, path, size, extra, gpu) for stack, py, mpx, paths, extra in stacks
            for path in paths for size in (int(s) for s in args.sizes.split(",")) for gpu in gpu_backends]
    for stack, py, mpiexec, path, size, extra, gpu in runs:
        env = dict(os.environ, DTORCH_COMM_PATH=path, PYTHONUNBUFFERED="1", MPIEXEC=mpiexec)
        if gpu:
            env["DTORCH_GPU_BACKEND"] = gpu
            print(f"\n--- DTORCH_GPU_BACKEND={gpu} {' '.join(device)}", flush=True)
        env["DTORCH_TEST_LOGDIR"] = os.path.join(ROOT, ".mpi-logs", f"{stack}-{path}-n{size}{'-' + gpu if gpu else ''}")
        pytest_cmd = [py, "-m", "pytest", "-q", "--color=no", *device, *extra]
        if size == 1:
            cmd = pytest_cmd
        else:
            cmd = [*shlex.split(mpiexec), "-n", str(size),
                   os.path.join(ROOT, "tests", "rank_wrapper.sh"), *pytest_cmd, "--with-mpi"]
        rc, text = run(cmd, env, args.run_timeout)
        got = counts(text)
        for k in total:
            total[k] += got[k]
        if rc not in (0,):
            bad_runs.append(f"{stack} {path} n={size}{' ' + gpu if gpu else ''} (exit {rc})")
            if got["failed"] == 0 and got["errors"] == 0:
                total["failed"] += 1
    print()
    if bad_runs:
        print("failed runs: " + ", ".join(bad_runs))
    print(f"total: {total['passed']} passed, {total['failed'] + total['errors']} failed, "
          f"{total['skipped']} skipped")
    return 1 if bad_runs else 0


if __name__ == "__main__":
    sys.exit(main())
