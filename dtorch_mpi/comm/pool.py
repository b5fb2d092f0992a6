"""Reused host buffers for collective outputs and temporaries (a small caching allocator).

A collective into freshly allocated NumPy memory pays the page faults of touching it (with
MPICH up to 2.5x the same collective into a reused buffer at 4-64 MB), and a redistribute in a
training loop allocates the same sizes every step. So the pool keeps the 1-D byte arrays it
allocated ("owners") and hands out typed views of them. Every view of a view keeps the owner
referenced (NumPy collapses ``.base`` to the owner), and so does anything built on one (a
``memoryview``, ``torch.from_numpy``, an in-flight request's keep-list). An owner whose
reference count shows that only the pool holds it is therefore unused by anyone, and only
such an owner is handed out again: a buffer still in use, or any slice of it, is never reused.

Owners start their buffers at a page boundary. A copy on this machine (MPI's into an output,
NumPy's) runs 1.75x slower when its destination lies 16-48 bytes past its source modulo 4096 (the
store and later loads alias in the core's 4 KiB address match), and where a heap-allocated
buffer falls was chance; large NumPy arrays sit 16 bytes into a page (their mmap header), so an
output at a page boundary is never in that band relative to them, and results are the same
from run to run (scripts/bench_redistribute.py).

Bounded by ``DTORCH_BUFFER_POOL_BYTES`` (default 256 MiB, ``0`` turns pooling off; the oldest
owners are forgotten first, which never frees one still in use: its users keep it). Small
buffers bypass the pool (malloc reuses them without page faults, and the pool would only add
Python time). Emptied by ``DeviceMesh.free()``. CuPy buffers go to CuPy's own caching allocator.
A result kept from step to step (fully_shard's gradient shards) stays the pool's: dropped by
``zero_grad``, its owner is idle and the next step's collective writes into it again. A buffer
one user asks for every step, of one size, can be kept by that user instead (:class:`Kept`:
replicate's buckets), outside the cap.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from math import prod
from typing import Any

import numpy as np

from .. import settings

POOLED_FROM = 256 << 10
"""Smallest buffer (bytes) worth pooling: below it glibc malloc reuses freed heap memory."""

PAGE = 4096
Owner = tuple[np.ndarray, int]  # (allocation, offset of its first page boundary): the pool's unit
_owners: "OrderedDict[int, list[Owner]]" = OrderedDict()  # nbytes -> owners, oldest size first
_held = 0
_lock = threading.Lock()


def pool_cap() -> int:
    """The most bytes the pool keeps (``DTORCH_BUFFER_POOL_BYTES``)."""
    return settings.get("DTORCH_BUFFER_POOL_BYTES")


def set_pool_cap(nbytes: int) -> None:
    """Bound the pool to ``nbytes`` (0 turns reuse off); forgets owners beyond the new bound."""
    settings.put("DTORCH_BUFFER_POOL_BYTES", settings.parse("DTORCH_BUFFER_POOL_BYTES", str(nbytes)))
    _shrink(0)


def held_bytes() -> int:
    """Bytes of the owners the pool keeps (in use or idle)."""
    return _held


def clear() -> None:
    """Forget every owner (buffers still in use stay alive with their users)."""
    global _held
    _owners.clear()
    _held = 0


def _refcounts(bucket: list[Owner]) -> list[int]:
    return [sys.getrefcount(owner) for owner, _ in bucket]


def _find_idle(bucket: list[Owner]) -> int | None:
    """The index of the first owner in ``bucket`` that nobody but the pool holds (None: none)."""
    for i, refs in enumerate(_refcounts(bucket)):
        if refs <= _IDLE_REFS:
            return i
    return None


def _probe_idle_refs() -> int:
    """The reference count an owner nobody else holds shows in ``_refcounts`` (measured once
    through the same code path, so it holds on any interpreter)."""
    return _refcounts([(np.empty(1, np.uint8), 0)])[0]


def _new_owner(nbytes: int) -> Owner:
    """An allocation with room for ``nbytes`` from a page boundary on."""
    raw = np.empty(nbytes + PAGE, np.uint8)
    return raw, -raw.ctypes.data % PAGE


_IDLE_REFS = _probe_idle_refs()


def _shrink(incoming: int) -> None:
    """Forget the oldest owners until ``incoming`` more bytes fit under the cap."""
    global _held
    while _owners and _held + incoming > pool_cap():
        nbytes, bucket = next(iter(_owners.items()))
        bucket.pop(0)
        _held -= nbytes
        if not bucket:
            del _owners[nbytes]


def empty(xp: Any, shape: tuple[int, ...] | int, dtype: Any) -> Any:
    """An uninitialised array like ``xp.empty(shape, dtype)``, reusing an idle pooled owner of
    the same size when there is one (NumPy buffers from :data:`POOLED_FROM` bytes on)."""
    if xp is not np:
        return xp.empty(shape, dtype=dtype)
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = prod(dims) * dt.itemsize
    if nbytes < POOLED_FROM or dt.hasobject or nbytes > pool_cap():
        return np.empty(dims, dtype=dt)
    with _lock:  # one thread's idle owner must not be handed to another before it holds a view
        bucket = _owners.get(nbytes)
        idle = _find_idle(bucket) if bucket else None
        if bucket and idle is not None:
            entry = bucket[idle]
        else:
            global _held
            _shrink(nbytes)
            entry = _new_owner(nbytes)
            _owners.setdefault(nbytes, []).append(entry)
            _held += nbytes
        _owners.move_to_end(nbytes)
        owner, start = entry
        return owner[start : start + nbytes].view(dt).reshape(dims)  # its ``.base`` is ``owner``


class Kept:
    """Buffers their user asks for again and again, of one size (a ``replicate`` bucket, every
    step): kept here, outside the pool's cap, as DDP keeps its buckets. In the shared pool a
    model whose buckets outgrew the cap had the oldest forgotten every step, and a forgotten
    buffer from 32 MiB (glibc's largest mmap threshold) is mapped and faulted in afresh at its
    next use (a copy into a fresh 128 MiB took 35-384 ms on this machine, into warm pages 21).

    A buffer is handed out again only when idle (nothing but this holds it, the pool's test).
    Two are kept: with gradients zeroed in place rather than dropped, the last step's buffer
    is still viewed while the next one packs, and the one before it is idle again. Where
    both are in use (or for another size), a new one replaces the older. Used by one thread."""

    __slots__ = ("_owners",)

    def __init__(self) -> None:
        self._owners: list[Owner] = []  # (allocation, page offset), the last handed out last

    def empty(self, xp: Any, size: int, dtype: Any) -> Any:
        """An uninitialised 1-D array like ``xp.empty(size, dtype)``: an idle kept buffer of
        this size when there is one (NumPy buffers from :data:`POOLED_FROM` bytes on)."""
        dt = np.dtype(dtype)
        nbytes = size * dt.itemsize
        if xp is not np or nbytes < POOLED_FROM or dt.hasobject:
            return xp.empty(size, dtype=dt)
        owners = self._owners
        if owners and owners[0][0].nbytes != nbytes + PAGE:
            owners.clear()  # another size: the kept ones go with their users
        idle = _find_idle(owners)
        if idle is not None:
            entry = owners.pop(idle)
        else:
            entry = _new_owner(nbytes)
            del owners[:-1]  # (the newer of two in use stays kept)
        owners.append(entry)
        owner, start = entry
        return owner[start : start + nbytes].view(dt)


def allocator(xp: Any, shape: tuple[int, ...], dtype: Any) -> Callable[[], Any]:
    """``empty(xp, shape, dtype)`` as a function of no arguments, with the choice between a
    plain and a pooled allocation made once (for a compiled plan's output buffers)."""
    dt = np.dtype(dtype)
    if xp is np and (prod(shape) * dt.itemsize < POOLED_FROM or dt.hasobject):
        return partial(np.empty, shape, dt)
    return partial(empty, xp, shape, dt)
