"""Simulated scale, per-call Python (issue 27 items 1 and 9): every MPI-backend route, through
the prologue, on a stand-in communicator of 64 and of 4,096 ranks (tests/standin_comm.py: no
data moves). After the first call of a shape the library runs the same Python lines whatever
the group size: no Python loop over ranks per call (counts, displacements, datatypes and
block copies are made once per layout). scripts/bench_scale_percall.py measures the time."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
from standin_comm import StandInComm

import dtorch_mpi as dt
from dtorch_mpi.comm import Group, backend_named
from dtorch_mpi.comm.config import comm_path, set_comm_path

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/scripts")
from bench_scale_percall import cases
from conftest import RUN_ONCE

pytestmark = RUN_ONCE  # pure simulations (planner arithmetic, a stand-in communicator): no rank count or path changes them

LIBRARY = dt.__file__.rsplit("/", 1)[0]


def library_lines(call: Callable[[], Any]) -> int:
    """Python lines of dtorch_mpi executed by ``call()``."""
    count = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if not frame.f_code.co_filename.startswith(LIBRARY):
            return None
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


@pytest.mark.parametrize("path", ["variable", "padded"])
def test_per_call_python_does_not_grow_with_the_group(path: str) -> None:
    before = comm_path()
    set_comm_path(path)
    try:
        backend = backend_named("mpi")
        lines: dict[int, dict[str, int]] = {}
        for p in (64, 4096):
            comm = StandInComm(p)
            group = Group(comm, 0)  # type: ignore[arg-type]
            lines[p] = {}
            for label, (method, args, _) in cases(p).items():
                call = lambda: getattr(backend, method)(group, *args)
                call()  # the first call of a shape computes its layout
                lines[p][label] = library_lines(call)
            assert sum(comm.calls.values()) == 2 * len(lines[p])  # each call reached MPI once
        assert lines[64] == lines[4096]
    finally:
        set_comm_path(before)
