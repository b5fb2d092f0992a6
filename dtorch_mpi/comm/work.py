"""Handles of nonblocking collectives: they keep every buffer alive until completion.

MPI writes into a nonblocking collective's buffers until the request completes, whoever still
holds the handle. So a started request and its buffers are owned by a module-level registry
of in-flight requests, not by the handle: dropping a handle (a ``redistribute(async_op=True)``
result deleted before use, a ``to_torch_async()`` handle never waited) leaves the buffers alive
until MPI is done. Completed requests are reaped at the start of every later collective
(``reap()``) and at exit (``wait_all()``), which only tests/waits requests and never starts
one, so it is safe at any point of the program. A program that finalises MPI itself calls
``dtorch_mpi.wait_all()`` first.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from threading import Lock, current_thread, main_thread
from typing import Any

from mpi4py import MPI

from . import issuer, progress
from .deadline import wait_request


class _InFlight:
    """A started request and the buffers/datatypes MPI may still touch. Its ``test()`` is the
    only way any thread tests it: under its lock, so the main thread (waiting) and the progress
    thread (comm/progress.py, polling) never test it at once (MPI forbids two threads
    completing one request), and once complete it is never tested again. An error MPI reports
    as it completes the request is kept (``error``) and raised by the owner's ``wait()`` or
    ``done()``, on the thread that waits, whichever thread's test met it."""

    __slots__ = ("request", "keep", "complete", "error", "polled", "_lock")

    def __init__(self, request: MPI.Request, keep: tuple[Any, ...]) -> None:
        self.request = request
        self.keep = keep
        self.complete = False
        self.error: Exception | None = None
        self.polled = isinstance(request, MPI.Request)  # the progress thread's (not a GPU event)
        self._lock = Lock()

    def test(self, block: bool = True) -> bool:
        """Whether the request has completed (testing it drives MPI's progress engine); with
        ``block=False``, ``False`` at once where another thread is testing it now. Never
        raises: an error completing it is kept in ``error``."""
        if self.complete:
            return True
        if not self._lock.acquire(block):
            return False
        try:
            if not self.complete and self.request.Test():
                self.complete = True
        except Exception as exc:  # (MPI completed the request with an error: it is null now)
            self.error, self.complete = exc, True
        finally:
            self._lock.release()
        return self.complete

    def being_tested(self) -> bool:
        return self._lock.locked()

    def wait(self, what: str) -> None:
        """Wait until the request completes (bounded by the deadline), raising the error it
        completed with. The lock is held throughout, so the progress thread skips it (this
        thread drives MPI meanwhile) rather than taking turns at it, each turn a thread switch."""
        with self._lock:
            if not self.complete:
                wait_request(self.request, what)
                self.complete = True
        if self.error is not None:
            raise self.error


_IN_FLIGHT: set[_InFlight] = set()
_ABANDONED: list[_InFlight] = []  # timed out: MPI may still write into these buffers, so never freed


def in_flight() -> int:
    """How many started requests MPI may still be writing into (after reaping finished ones)."""
    reap()
    return len(_IN_FLIGHT)


def reap() -> None:
    """Release the buffers of every in-flight request that has completed (never blocks). Only
    on the main thread: the issue thread (comm/issuer.py) adds requests meanwhile, and it must
    not test a request the main thread may be waiting on."""
    if not _IN_FLIGHT or current_thread() is not main_thread():
        return
    for entry in [e for e in list(_IN_FLIGHT) if e.test(block=False)]:  # (one the progress thread is testing: next time)
        _IN_FLIGHT.discard(entry)


def _poll_in_flight() -> tuple[bool, bool]:
    """The progress thread's poll: test every incomplete in-flight request (which advances
    them); whether any is still incomplete, and whether one of those is being waited on by
    another thread now (its lock held: skipped here, the caller then drives MPI by other means,
    as that wait naps between its tests). A request completed here is reaped by the main
    thread, which finds it complete; its buffers are dropped here at once (MPI is done with
    them; the result lives on in its handle's finishing step). Dropping the last reference to a
    large buffer hands its memory back to the system (glibc: an unmap or a heap trim, ~0.25 ms
    for a 2 MB gradient on this machine, with the GIL held), which on this thread happens
    beside the computing thread's work rather than inside its wait (fully_shard's step, 4 x 2 MB
    layers at 2 ranks, A/B in one process: 1.1-1.7 ms less exposed; issue 26)."""
    incomplete = held = False
    for entry in list(_IN_FLIGHT):
        if entry.complete or not entry.polled:  # (a GPU event: this thread sets no device)
            continue
        if entry.test(block=False):
            entry.keep = ()
        else:
            incomplete = True
            held = held or entry.being_tested()
    return incomplete, held


def progress_in_background() -> None:
    """The request just started is waited on later: keep MPI progressing it meanwhile
    (comm/progress.py)."""
    progress.started(_poll_in_flight)


def drain() -> None:
    """Wait for every in-flight request (at exit, before MPI is finalised)."""
    for entry in list(_IN_FLIGHT):
        try:
            entry.wait("a dropped nonblocking collective (at exit)")
        except Exception:
            _ABANDONED.append(entry)  # timed out: MPI may still write into its buffers
        _IN_FLIGHT.discard(entry)


def wait_all() -> None:
    """Wait for every nonblocking transfer the library started (also those whose handles were
    dropped) and stop the progress thread (comm/progress.py; it starts again with the next
    transfer). Runs at exit, before mpi4py finalises MPI. A program that calls
    ``MPI.Finalize()`` itself calls this first: MPI forbids another thread's MPI calls while
    ``MPI_Finalize`` runs (MPICH stops locking as it starts, so a poll caught there corrupts
    its state)."""
    issuer.stop()
    progress.stop()
    drain()


def _at_finalize(comm: MPI.Comm, keyval: int, value: object) -> None:
    """MPI_Finalize deletes ``COMM_SELF``'s attributes first: the last chance to wait for what
    is in flight while MPI may still be called (a safety net for a program that finalises MPI
    without :func:`wait_all`; the progress thread may have polled as finalising began)."""
    wait_all()


MPI.COMM_SELF.Set_attr(MPI.Comm.Create_keyval(delete_fn=_at_finalize), None)
atexit.register(wait_all)  # Python's atexit runs before mpi4py's exit hook calls MPI_Finalize

_BEFORE_START: list[Callable[[], None]] = []


def before_collective(hook: Callable[[], None]) -> None:
    """Run ``hook`` before every collective a backend starts (the executor starts the queued
    steps of pending multi-step redistributes there, in one order on every rank)."""
    _BEFORE_START.append(hook)


def collective_starting() -> None:
    """Called first by a backend about to start a collective (before its SPMD debug check)."""
    for hook in _BEFORE_START:
        hook()


class Work:
    """A started collective. ``wait()`` returns its result; ``done()`` polls without blocking.

    The registry holds the request with every buffer and derived datatype the operation uses
    (mpi4py does not for every nonblocking collective) until MPI has finished with them, even
    if this handle is dropped first. The finishing step (copying out of padded buffers,
    dividing an average, narrowing a widened dtype) runs exactly once, on ``wait()``/``done()``.
    """

    __slots__ = ("_entry", "_finish", "_result", "_finished", "_what")

    def __init__(
        self,
        request: MPI.Request,
        finish: Callable[[], Any],
        keep: tuple[Any, ...] = (),
        what: str = "a nonblocking collective",
    ) -> None:
        self._finish = finish
        self._result: Any = None
        self._finished = False
        self._what = what
        self._entry: _InFlight | None = _InFlight(request, keep)
        _IN_FLIGHT.add(self._entry)

    def _complete(self) -> None:
        if self._entry is not None:
            _IN_FLIGHT.discard(self._entry)
            self._entry = None
        self._result = self._finish()
        self._finished = True

    def done(self) -> bool:
        entry = self._entry
        if not self._finished and entry is not None and entry.test(block=False):  # a poll never blocks
            if entry.error is not None:
                self.wait()  # raises it, as wait() would
            self._complete()
        return self._finished

    def wait(self) -> Any:
        if not self._finished:
            entry = self._entry
            assert entry is not None
            try:
                entry.wait(self._what)
            except Exception:
                _IN_FLIGHT.discard(entry)  # never completes: its buffers stay alive for good
                _ABANDONED.append(entry)
                raise
            self._complete()
        return self._result


class Done:
    """A finished collective's handle: its result, nothing pending (what every blocking call
    and local step returns; lighter than a :class:`Work`, as it is made on every call)."""

    __slots__ = ("_result",)

    def __init__(self, result: Any) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def wait(self) -> Any:
        return self._result


def waited(request: MPI.Request, finish: Callable[[], Any], keep: tuple[Any, ...], what: str) -> Done:
    """A request started for a blocking call, waited here at once (bounded by the deadline).
    Nothing else runs until it completes, so it skips the in-flight registry; if the wait
    times out, its buffers are kept for good, as ``Work.wait`` keeps them."""
    try:
        wait_request(request, what)
    except Exception:
        _ABANDONED.append(_InFlight(request, keep))
        raise
    return Done(finish())


def completed(result: Any) -> Done:
    return Done(result)
