"""The issue thread: the library's overlapped collectives checked and started beside its compute.

``fully_shard``'s prefetched all-gathers and reduce-scatters and ``replicate``'s bucket
all-reduces are started inside the forward and backward hooks and waited for later. Each such
call of 64 KiB or more first waits for every rank of its group to post the call's fingerprint
(the divergence check, comm/divergence.py: a nonblocking call is checked before its data
moves), then MPICH copies, and over shared memory often sends, the data inside the start. Both
ran on the thread that computes, so neither could hide behind that work: 0.4-1.1 ms per call
at 2 MB, the most of fully_shard's exposed communication (issue 26).

Inside :func:`deferred` (the library's overlap paths use it), a nonblocking call the default
check covers (with a backend whose checked data moves on the twin's data communicator: the MPI
backend on MPICH) is handed to one daemon thread instead. The caller numbers the call and takes
its fingerprint, in program order as before, and gets an :class:`Issued` handle at once; the
thread runs the check and the start, one call after another in the order they were handed
over. Every other call the prologue makes first waits until the thread has started everything
handed to it (:func:`drain`; nothing to wait for costs one test of an int), so on every
communicator each rank still makes the same calls in the same order, and a call handed over
never overtakes one made before it. The thread touches only the twin's check and data
communicators, which only the prologue uses.

What a program sees: the same calls, results and divergence errors, but an error found by a
handed-over call's check (``SPMDDivergenceError``, ``CollectiveTimeoutError``) or its start is
raised by the handle's ``wait()``, on every rank, rather than by the call: for ``fully_shard``
and ``replicate`` inside the library's own wait, in the same forward or backward.

``DTORCH_ASYNC_ISSUE``: ``thread`` (the default where MPI runs at ``MPI_THREAD_MULTIPLE``) or
``inline`` (every call on the caller's thread, as before: an A/B switch for the benchmark).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from mpi4py import MPI

from .. import settings
from . import deadline

MODES = settings.ISSUE_MODES


def issue_mode() -> str:
    """``DTORCH_ASYNC_ISSUE``, ``inline`` where MPI is not at ``MPI_THREAD_MULTIPLE``."""
    mode = str(settings.get("DTORCH_ASYNC_ISSUE"))
    if mode == "thread" and MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return "inline"
    return mode


def set_issue_mode(mode: str) -> None:
    """``thread`` or ``inline`` for this process from now on (every rank alike or not: the
    calls MPI sees are the same either way)."""
    if mode not in MODES:
        raise ValueError(f"issue mode {mode!r}: use one of {', '.join(MODES)}")
    drain()
    settings.put("DTORCH_ASYNC_ISSUE", mode)


@contextlib.contextmanager
def issuing(mode: str) -> Iterator[None]:
    """:func:`set_issue_mode` inside, the previous setting back after (an A/B of the modes in
    one process: tests, benchmarks)."""
    before = str(settings.get("DTORCH_ASYNC_ISSUE"))
    set_issue_mode(mode)
    try:
        yield
    finally:
        set_issue_mode(before)


class Issued:
    """The handle of a call handed to the issue thread: ``wait()`` waits for the thread to
    start it, then for the call (raising what its check or start raised); ``done()`` polls."""

    __slots__ = ("_started", "_handle", "_error")

    def __init__(self) -> None:
        self._started = threading.Event()
        self._handle: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        if not self._started.is_set():
            return False
        return self._error is not None or bool(self._handle.done())

    def wait(self) -> Any:
        self._started.wait()  # bounded: the check is under the collective deadline, the start is nonblocking
        if self._error is not None:
            raise self._error
        while _outstanding and not self._handle.done():
            _yield_to_thread()
        return self._handle.wait()


_lock = threading.Condition()
_queue: deque[tuple[Issued, Callable[..., Any], tuple[Any, ...], str | None]] = deque()
_outstanding = 0  # calls handed over and not yet started (read without the lock: one int)
_thread: threading.Thread | None = None
_deferring = 0  # depth of deferred() on the main thread
issued = 0
"""Calls handed to the thread so far in this process (tests and benchmarks read it)."""


def _yield_to_thread() -> None:
    """Let the thread run while it has calls to start: sleep on its condition (which drops the
    GIL) until it has started them all, at most ``_YIELD`` seconds. A wait that polled instead
    would hold the GIL between polls, and the thread (woken for the GIL only to find it taken
    again) could wait whole milliseconds for it."""
    with _lock:
        if _outstanding:
            _lock.wait(_YIELD)


_YIELD = 1e-4


def _run() -> None:
    global _outstanding
    while True:
        with _lock:
            while not _queue:
                _lock.wait()
            handle, issue, args, site = _queue.popleft()
        if issue is _stop_marker:
            return
        deadline.acting_for(site)
        try:
            handle._handle = issue(*args)
        except BaseException as exc:  # (raised by the handle's wait, on the caller's thread)
            handle._error = exc
        finally:
            deadline.acting_for(None)
        handle._started.set()
        with _lock:
            _outstanding -= 1
            if not _outstanding:
                _lock.notify_all()


def _stop_marker() -> None:
    """The item that ends the thread (:func:`stop`)."""


def submit(issue: Callable[..., Any], *args: Any) -> Issued:
    """Hand ``issue(*args)`` (a check and a start, returning the call's handle) to the thread."""
    global _outstanding, _thread, issued
    handle = Issued()
    site = deadline.call_site()  # (a few frames up: named by a timeout the thread raises)
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_run, name="dtorch-mpi-issue", daemon=True)
            _thread.start()
        _outstanding += 1
        issued += 1
        _queue.append((handle, issue, args, site))
        _lock.notify_all()
    return handle


def drain() -> None:
    """Wait until the thread has started every call handed to it (before any other call)."""
    if _outstanding and threading.current_thread() is not _thread:
        with _lock:
            while _outstanding:
                _lock.wait()


def deferring() -> bool:
    """Whether a nonblocking checked call made now may be handed to the thread."""
    return _deferring > 0 and threading.current_thread() is threading.main_thread() and issue_mode() == "thread"


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """The nonblocking calls made inside may be handed to the issue thread (see the module doc):
    for the library's overlap paths, whose own waits take the errors."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1


def stop() -> None:
    """Start everything handed over, then end the thread (at exit, before MPI is finalised)."""
    global _thread, _outstanding
    thread = _thread
    if thread is None:
        return
    drain()
    with _lock:
        _outstanding += 1
        _queue.append((Issued(), _stop_marker, (), None))
        _lock.notify_all()
    thread.join()
    with _lock:
        _outstanding -= 1
    _thread = None
