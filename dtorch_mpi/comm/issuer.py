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
over. Every other call the prologue makes first waits until everything handed over has
started (:func:`drain`; nothing to wait for costs one test of an int), so on every
communicator each rank still makes the same calls in the same order, and a call handed over
never overtakes one made before it. The thread touches only the twin's check and data
communicators, which only the prologue uses.

A thread that waits for a call the issue thread has not taken yet (``Issued.wait``, or
:func:`drain`) takes and starts the queued calls itself, oldest first, up to its own: taking a
call and running it is one step under a lock, so the order stays the order of hand-over
whoever runs them. Such a call is one waited for soon after it was made (a prefetch whose
unit computes less than the thread takes to wake, an ``unshard(async_op=True)`` waited for at
once), where the thread would only add its wake-up (0.6-1.2 ms on a loaded 2-core machine: the
GIL and a core after a submit). Where the caller knows that it waits next (the last reduction
of a backward: fully_shard's last unit to reduce, replicate's last bucket; a parameterless
root's prefetch of its first block), it does not hand the call over at all
(``deferred(beside_work=False)``): even a thread that finds nothing left to take has been
woken, and takes the GIL and a core from the wait (2 ranks, 4 x 2 MB layers, off-core
compute, A/B: 0.2-0.5 ms a step on one host, ~1 ms for replicate across two fake hosts;
issue 26).

What a program sees: the same calls, results and divergence errors, but an error found by a
handed-over call's check (``SPMDDivergenceError``, ``CollectiveTimeoutError``) or its start is
raised by the handle's ``wait()``, on every rank, rather than by the call: for ``fully_shard``
and ``replicate`` inside the library's own wait, in the same forward or backward. The checked
calls made on that communicator after a divergent one, until the program receives its error,
are refused on every rank alike (:func:`refusal`).

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
from ..errors import SPMDDivergenceError
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
        if not self._started.is_set():
            _help_until(self._started)
        self._started.wait()  # bounded: the check is under the collective deadline, the start is nonblocking
        if self._error is not None:
            received(self._error)
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
epoch = 0
"""How many divergence errors found by handed-over calls the program has received (a call is
stamped with it when numbered, on the computing thread): see :func:`refusal`."""
_refusing: dict[tuple[int, int], SPMDDivergenceError] = {}  # (id(twin), epoch) -> the error found


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
    while True:
        with _lock:
            while not _queue:
                _lock.wait()
        if not _start_next():
            return


def _start_next(unless: threading.Event | None = None) -> bool:
    """Take the oldest call handed over and run its check and start (on whichever thread calls
    this: the issue thread, or one waiting for that call, :func:`_help_until`); ``False`` where
    that was the thread's stop marker. The run lock makes taking and running one step, so calls
    start in the order they were handed over whoever runs them. Nothing is taken once
    ``unless`` is set (a helper whose call the thread started meanwhile)."""
    global _outstanding
    reraise: BaseException | None = None
    handle: Issued | None = None
    with _run_lock:
        try:
            with _lock:
                if not _queue or (unless is not None and unless.is_set()):
                    return True
                if _queue[0][1] is _stop_marker:
                    if threading.current_thread() is not _thread:
                        return True  # only the thread itself ends the thread
                    _queue.popleft()
                    return False
                handle, issue, args, site = _queue.popleft()
            deadline.acting_for(site)
            handle._handle = issue(*args)
        except BaseException as exc:  # (raised by the handle's wait, on the caller's thread)
            if handle is None:
                raise
            handle._error = exc
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) and threading.current_thread() is not _thread:
                reraise = exc  # a helper's own interrupt: its caller sees it too, now
        finally:  # a call taken counts as started whatever happened (an interrupt included)
            if handle is not None:
                deadline.acting_for(None)
                handle._started.set()
                with _lock:
                    _outstanding -= 1
                    if not _outstanding:
                        _lock.notify_all()
    if reraise is not None:
        raise reraise
    return True


def _help_until(started: threading.Event | None) -> None:
    """Start queued calls on this thread, oldest first, until ``started`` is set (None: until
    none is queued): a call waited for soon after it was handed over then pays no wait for the
    issue thread to wake and get a core (0.6-1.2 ms on a loaded 2-core machine, issue 26)."""
    while started is None or not started.is_set():
        with _lock:
            if not _queue or _queue[0][1] is _stop_marker:
                return  # the thread has taken every call: it sets ``started`` when it is done
        _start_next(unless=started)


_run_lock = threading.Lock()  # held while a call handed over is taken and run


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
    """Wait until every call handed over has started (before any other call), starting those
    still queued on this thread."""
    if _outstanding and threading.current_thread() is not _thread:
        _help_until(None)
        with _lock:
            while _outstanding:
                _lock.wait()


def found(twin: object, stamp: int, error: SPMDDivergenceError) -> None:
    """A handed-over call stamped ``stamp`` on ``twin``'s communicator found the group's calls
    apart (on the issue thread, or a helper). Every rank of the group got the same verdict."""
    _refusing.setdefault((id(twin), stamp), error)


def refusal(twin: object, stamp: int) -> SPMDDivergenceError | None:
    """The error to refuse a checked call with, or None to check and start it.

    A call on a communicator where a handed-over call found the ranks apart, numbered after that
    call and before the program received its error (the same ``stamp``), is refused: numbered,
    never checked or started, its error raised by its wait (a blocking one: by the call). The
    decision is the program order's, the same on every rank. On one rank the issue thread may
    find the divergence before the computing thread makes the next call; on another, after. Had
    the next call's check run, it would wait for ranks that refuse it, until the collective
    deadline."""
    return _refusing.get((id(twin), stamp))


def received(error: BaseException) -> None:
    """The program got ``error`` (a call or a wait raised it): calls numbered from now on run
    again, and a divergence's agreed call count takes effect (``SPMDDivergenceError.resume``,
    comm/divergence.py). Each error counts once, whichever of its refused calls raised it first."""
    global epoch
    resume = getattr(error, "resume", None)
    if resume is not None:
        error.resume = None  # type: ignore[attr-defined]
        resume()
    stamps = [stamp for (_, stamp), found_error in list(_refusing.items()) if found_error is error]
    if epoch in stamps:  # (a list: the issue thread may record another communicator's meanwhile)
        epoch += 1  # (the entry stays: calls stamped before may still wait in the thread's queue)


def forget(twin: object) -> None:
    """``twin`` is freed (its mesh was): no refusal may outlive it into a twin at its address."""
    for key in [key for key in _refusing if key[0] == id(twin)]:
        del _refusing[key]


def refused(error: SPMDDivergenceError) -> "Issued":
    """A handle for a call refused on the computing thread (:func:`refusal`)."""
    handle = Issued()
    handle._error = error
    handle._started.set()
    return handle


def deferring() -> bool:
    """Whether a nonblocking checked call made now may be handed to the thread."""
    return _deferring > 0 and threading.current_thread() is threading.main_thread() and issue_mode() == "thread"


@contextlib.contextmanager
def deferred(beside_work: bool = True) -> Iterator[None]:
    """The nonblocking calls made inside may be handed to the issue thread (see the module doc):
    for the library's overlap paths, whose own waits take the errors. ``beside_work=False``:
    the caller waits for them next, with no work in between (the last reduction of a
    backward, a parameterless root's prefetch of its first block), so they start on the
    caller's thread, also inside an outer ``deferred()``: handed over, the thread's wake-up
    would only come between the caller and its wait (module doc)."""
    global _deferring
    if not beside_work:
        outer, _deferring = _deferring, 0
        try:
            yield
        finally:
            _deferring = outer
        return
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
