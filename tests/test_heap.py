"""The opt-in allocator tuning (dtorch_mpi/heap.py): off unless asked, then a fresh MB-sized
array comes from glibc's heap instead of its own ``mmap``; left alone where the process chose
its thresholds. Each case imports the library in a child interpreter: the thresholds are
process-wide and set once, at import."""

from __future__ import annotations

import platform
import sys

import pytest
from conftest import RUN_ONCE
from mpi_launch import child_env, run

pytestmark = [*RUN_ONCE, pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")]

# bytes glibc holds in mmapped blocks (mallinfo2, glibc >= 2.33) before and after a fresh 2 MiB array
_CHILD = """
import ctypes
import numpy as np
import dtorch_mpi
from dtorch_mpi import heap

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
before = libc.mallinfo2().hblkhd
block = np.ones(2 << 20, dtype=np.uint8)
print(heap.state, libc.mallinfo2().hblkhd - before)
"""


def _child(**env: str) -> tuple[str, int]:
    environ = child_env(**env)
    for name in ("DTORCH_MALLOC_TUNING", "GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_",
                 "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD"):
        if name not in env:
            environ.pop(name, None)
    proc = run([sys.executable, "-c", _CHILD], timeout=120, env=environ)
    assert proc.returncode == 0, proc.stderr
    state, grown = proc.stdout.strip().rsplit(" ", 1)
    return state, int(grown)


def test_without_the_setting_glibc_keeps_its_defaults() -> None:
    state, grown = _child()
    assert state == "off"
    assert grown >= 2 << 20  # glibc's default: a 2 MiB block is its own mmap


def test_the_setting_serves_a_fresh_mb_array_from_the_heap() -> None:
    state, grown = _child(DTORCH_MALLOC_TUNING="1")
    assert (state, grown) == ("tuned", 0)


@pytest.mark.parametrize("chosen", [{"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"},
                                    {"MALLOC_TRIM_THRESHOLD_": "1048576"}])
def test_a_process_that_chose_its_thresholds_keeps_them(chosen: dict[str, str]) -> None:
    state, grown = _child(DTORCH_MALLOC_TUNING="1", **chosen)
    assert state == "the process's own"
    assert grown >= 2 << 20  # a 1 MiB threshold still maps a 2 MiB block
