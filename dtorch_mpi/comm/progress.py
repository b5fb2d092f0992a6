"""Background progress for nonblocking collectives.

MPI advances a nonblocking collective only while some thread of the process is inside an MPI
call; NumPy work between ``redistribute(async_op=True)`` and ``wait()`` makes none, so without
help a large transfer sits idle until the wait. While any library-started request is
incomplete, a daemon thread tests the in-flight requests every ``DTORCH_PROGRESS_INTERVAL``
microseconds (default 50; the interval doubles every 64 polls up to 1 ms, so a transfer that
takes long costs little CPU, and starts again at the base for each new request). Testing an
incomplete request runs MPI's whole progress engine (MPICH, Open MPI), so the transfer
advances beside the caller's work. (``MPI_Iprobe`` on a self communicator does not: MPICH
answers it without progressing.)

Each request is tested under its own lock (``comm/work.py``), so this thread and the main
thread, waiting on it, never test it at once (completing one request from two threads is
erroneous MPI); a request this thread completes is marked so and never tested again, and the
main thread, finding it complete, releases it; the buffers it held are dropped by this
thread at once (``comm/work.py``). A request that a thread is waiting on (its lock
held for the whole wait, which naps between its tests) is skipped, and the thread then tests
a receive of its own that nothing matches, so the transfer still advances during those naps.
While a wait on any thread spins (``comm/deadline.py``: it tests without pause, which runs
MPI's whole progress engine for every request), the thread does not poll at all but sleeps
until the spin ends: each wake-up is a thread switch and a GIL hand-over, and where ranks share
cores a turn taken from a spinning rank (a raw 2 MB reduce-scatter's spinning wait at 2 ranks:
240 µs alone, 390 µs beside a thread that wakes every 50 µs; issue 26).
The thread never starts or waits on a request,
so it changes no MPI-level call sequence. It stops polling as soon as every request in flight
has completed (polling on until the main thread reaped them cost fully_shard a fifth of a
core: 20 ms of CPU in a 120 ms step, on the cores its compute needed; issue 26), and sleeps on
an event when nothing is in flight, so blocking programs pay nothing.

``DTORCH_ASYNC_PROGRESS``: ``thread`` (the default where MPI runs at ``MPI_THREAD_MULTIPLE``,
mpi4py's default) or ``off`` (then transfers advance only inside library calls: every
collective the library starts, ``done()`` and ``wait()``). It is a per-process choice (it
moves no data), so ranks need not agree on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from mpi4py import MPI

from .. import settings
from . import deadline

MODES = settings.PROGRESS_MODES
_POLLS_PER_STEP = 64  # polls at each interval before it doubles (a 64 MB transfer takes ~6 ms)
_MAX_INTERVAL = 1e-3
_STAND_ASIDE = 1e-2  # the longest it waits for a spinning wait to end before it looks again


def progress_mode() -> str:
    """``DTORCH_ASYNC_PROGRESS`` checked, ``thread`` by default; ``off`` where MPI was not
    initialised with ``MPI_THREAD_MULTIPLE`` (a second thread may not call MPI then)."""
    mode = str(settings.get("DTORCH_ASYNC_PROGRESS"))
    if mode == "thread" and MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return "off"
    return mode


def poll_interval() -> float:
    """Seconds between progress polls (``DTORCH_PROGRESS_INTERVAL`` in microseconds)."""
    return float(settings.get("DTORCH_PROGRESS_INTERVAL")) * 1e-6


def _interval_after(base: float, polls: int) -> float:
    """The poll interval after ``polls`` polls: ``base`` doubled every ``_POLLS_PER_STEP``
    polls, at most ``_MAX_INTERVAL``. The exponent is capped (``1 << n`` grows without bound: a
    wait of minutes made a float overflow that killed the thread)."""
    return min(base * (1 << min(polls // _POLLS_PER_STEP, 30)), _MAX_INTERVAL)


class ProgressThread:
    """Calls ``poll()`` (which tests the requests in flight, so MPI advances them) until it
    says none is left incomplete; where it says one it skipped is being waited on (by a wait
    that naps between its tests), it drives MPI itself: it tests a receive of its own, posted
    on a private duplicate of ``COMM_SELF`` that no message ever matches."""

    def __init__(self, poll: Callable[[], tuple[bool, bool]], interval: float) -> None:
        self._poll = poll
        self._interval = interval
        self._wake = threading.Event()
        self._stop = False
        self.polling = False  # inside a run of polls (tests read it)
        self._comm = MPI.COMM_SELF.Dup()  # no message is ever sent on it
        self._never = self._comm.Irecv(bytearray(1), source=0, tag=0)
        self._thread = threading.Thread(target=self._run, name="dtorch-mpi-progress", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """A request was started: poll until nothing is in flight."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            polls = 0
            self.polling = True
            while not self._stop:
                if deadline.someone_spins():  # that wait drives MPI now (module docstring)
                    deadline.until_none_spins(_STAND_ASIDE)
                    continue
                try:
                    incomplete, held = self._poll()
                except Exception:  # (a bug: the thread lives on for the next request; the waits
                    break  # drive MPI themselves)
                if not incomplete:
                    break
                if held:
                    self._never.Test()
                polls += 1
                interval = _interval_after(self._interval, polls)
                if self._wake.wait(interval):  # a new request, or stop: back to the base interval
                    self._wake.clear()
                    polls = 0
            self.polling = False
            if self._stop:
                return

    def stop(self) -> None:
        """End the thread (before MPI is finalised) and free its receive and communicator."""
        self._stop = True
        self._wake.set()
        self._thread.join()
        if not MPI.Is_finalized():
            self._never.Cancel()
            self._never.Wait()
            self._comm.Free()


_thread: ProgressThread | None = None
_mode: str | None = None


def started(poll: Callable[[], tuple[bool, bool]]) -> None:
    """A nonblocking request has been started: make sure it progresses in the background
    (``poll()`` tests the requests in flight: whether any is still incomplete, and whether
    one of those is being waited on by another thread)."""
    global _thread, _mode
    if _mode is None:
        _mode = progress_mode()
    if _mode == "off":
        return
    thread = _thread
    if thread is None:
        with _starting:  # the main thread and the issue thread both start requests
            if _thread is None:
                _thread = ProgressThread(poll, poll_interval())
            thread = _thread
    thread.kick()


_starting = threading.Lock()


def set_progress_mode(mode: str) -> None:
    """Choose ``thread`` or ``off`` for this process from now on (overrides the environment)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r}: use one of {', '.join(MODES)}")
    _mode = "off" if MPI.Query_thread() != MPI.THREAD_MULTIPLE else mode


def stop() -> None:
    """Stop the progress thread if one runs (called as MPI is finalised: comm/work.py)."""
    global _thread
    if _thread is not None:
        _thread.stop()
        _thread = None
