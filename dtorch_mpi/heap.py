"""glibc's allocator kept from handing MB-sized blocks back to the system between steps.

With its defaults glibc serves a large allocation from a fresh ``mmap`` (or trims the heap top
once enough is freed), so every MB-sized array a training step makes anew (a gradient, an
activation, MPICH's own temporary buffer inside a collective) gets new pages: each first write
of a 4 KiB page faults and the kernel zeroes it, and each free unmaps it again (~0.25 ms for
2 MB here, with the GIL held). A step that makes the same sizes every time then spends much of
its local time in the kernel. Measured on the 2-core machine (docs/performance.md, "Page
faults"): a raw in-place 2 MB ``Iallreduce`` into a fresh array 650 µs against 450 µs tuned; the
blocking ``reduce_gradients`` of 4 x 2 MB gradients 10.5-11 ms against 4.5 ms; the plain
4-layer step's local work 5.5 ms against 2.9.

With ``DTORCH_MALLOC_TUNING=1`` the library sets, at import, glibc's mmap threshold to 64 MiB
and its trim threshold to 256 MiB (``mallopt``, as Open MPI's ``mpi_leave_pinned`` did for its
registration cache): blocks below 64 MiB come from the heap and, freed, are kept for the next
allocation of that size; the heap is handed back only when more than 256 MiB lie free at its
top. Memory freed during a step stays with the process for the next one, as a caching allocator
keeps it (PyTorch's on GPUs). The whole process's peak resident set moves little
(``bench_memory.py --step``, dp and fsdp at 2 and 4 ranks: 0-3.5 MiB above glibc's defaults,
of 107-172 MiB), while its resident set after the steps stays higher (fsdp at 2 ranks 102 ->
121 MiB): what a step freed is kept for the next, not added to the peak.

It is opt-in: the allocator belongs to the whole process, every library in it included, and a
library import changing it unasked would surprise (PyTorch leaves it to the user, who preloads
jemalloc or tcmalloc). Left alone, even when asked, where the process chose for itself
(``GLIBC_TUNABLES`` naming either threshold, or glibc's ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` variables) and where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform

from . import settings

MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_OWN_CHOICE = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")

state = "not yet"
"""What :func:`tune` did: ``tuned``, ``off`` (not asked for), ``the process's own`` (the
environment chose thresholds), ``not glibc``, or ``refused`` (``mallopt`` said no)."""


def _process_chose(environ: dict[str, str] | os._Environ[str]) -> bool:
    tunables = environ.get("GLIBC_TUNABLES", "")
    return any(name in environ for name in _OWN_CHOICE) or any(name in tunables for name in _TUNABLES)


def tune() -> str:
    """Set the thresholds (module docstring) unless something else chose; what was done."""
    global state
    if not settings.get("DTORCH_MALLOC_TUNING"):
        state = "off"
    elif _process_chose(os.environ):
        state = "the process's own"
    elif platform.libc_ver()[0] != "glibc":  # musl and others: other allocators, other knobs
        state = "not glibc"
    else:
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            state = "not glibc"
        else:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            state = "tuned" if ok else "refused"
    return state
