"""The collective deadline: every collective the library starts completes within
``DTORCH_COLLECTIVE_TIMEOUT`` seconds (default 600; ``0`` turns the deadline off) or raises
``CollectiveTimeoutError`` on the ranks waiting (PyTorch's process-group timeout is the anchor).

Collectives are started nonblocking and waited on by polling ``Test``: MPI has no timed wait,
and a blocking call cannot be interrupted. The wait adapts (the classic spin-then-sleep
back-off): for the first ``DTORCH_WAIT_SPIN`` microseconds (default 500) it polls without
pause, yielding the CPU every 16 polls (``sched_yield``), so a short collective's latency is
that of a spinning wait (a background thread's wait spins at most 50 µs: :func:`wait_spin`;
the progress thread stands aside meanwhile: :func:`someone_spins`); after that it sleeps
between bursts of 16 polls, the nap doubling from 20 µs up to 1 ms and never longer than an
eighth of the time waited so far (so a wait ends at most ~1/8 later than a spinning one
would). A rank waiting for a slower peer thus stops
burning the core that peer may share with it (oversubscribed runs, shared nodes); MPICH's and
Open MPI's own blocking waits spin instead. The clock is read once per 16 polls, for the
deadline and the back-off; with the deadline off the same loop runs without the timeout
check: the calls MPI sees do not depend on the settings, and the polled nonblocking forms are
as fast as MPICH 5's blocking ones or faster (``Allgatherv`` 2-3.5x faster at 1-64 MB;
``Alltoallv`` 1.3-1.7x; docs/performance.md).

A wait may watch something beside its request (:func:`watch`, set once by
comm/divergence.py: the divergence check that overlaps a blocking data call). It is polled
before each nap, once the wait has spun for ``DTORCH_WAIT_SPIN``, so a wait that ends while it
spins pays nothing for it (the caller takes the verdict after the data), and it ends the wait
by raising (the check found the calls differ: the data may never complete).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import numpy as np
from mpi4py import MPI

from .. import settings
from ..errors import CollectiveTimeoutError


def collective_timeout() -> float:
    """Seconds a collective may take (``DTORCH_COLLECTIVE_TIMEOUT``); 0 means no deadline."""
    return settings.get("DTORCH_COLLECTIVE_TIMEOUT")


def set_collective_timeout(seconds: float) -> None:
    """Set the deadline for this process (every rank must set the same)."""
    settings.put("DTORCH_COLLECTIVE_TIMEOUT", float(seconds))


_LIBRARY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_acting = threading.local()


def user_frame() -> FrameType | None:
    """The innermost frame of this thread outside dtorch_mpi (None: there is none)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY):
        frame = frame.f_back
    return frame


def call_site() -> str:
    """The innermost frame outside dtorch_mpi: where the user started the collective (on a
    thread acting for the caller, the caller's: :func:`acting_for`)."""
    given: str | None = getattr(_acting, "site", None)
    if given is not None:
        return given
    frame = user_frame()
    if frame is None:
        return "unknown"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def acting_for(site: str | None) -> None:
    """This thread now waits on behalf of a call made at ``site`` (``call_site()`` of the
    thread that made it; None: on its own behalf again). The issue thread (comm/issuer.py) sets
    it around each call it checks and starts, so a timeout names the user's line, not the
    thread's."""
    _acting.site = site


_POLLS_PER_CHECK = 16  # polls between clock reads (a Test with nothing to do costs ~1 µs)
_FIRST_NAP = 2e-5
_LONGEST_NAP = 1e-3
_NAP_SHARE = 0.125  # a nap is at most this share of the time waited so far


def wait_spin() -> float:
    """Seconds a wait polls without pause before it backs off (``DTORCH_WAIT_SPIN``); on a
    thread other than the main one (the issue thread's checks, comm/issuer.py) at most
    :data:`BACKGROUND_SPIN`: its polls are Python that holds the GIL between yields, time the
    computing thread then waits for (fully_shard's step, 8 x 2 MB layers at 2 ranks, in-process
    A/B: exposed 9.2-11.3 ms at a 500 us spin against 5.2-9.1 at 50; issue 26), and nothing
    waits on its latency until the call's own wait, later."""
    spin = settings.get("DTORCH_WAIT_SPIN") * 1e-6
    if threading.current_thread() is not threading.main_thread():
        return min(spin, BACKGROUND_SPIN)
    return spin


BACKGROUND_SPIN = 50e-6


def next_nap(previous: float, waited: float) -> float:
    """The back-off's next sleep: double the last (from ``_FIRST_NAP``), at most
    ``_LONGEST_NAP`` and at most ``_NAP_SHARE`` of the seconds ``waited`` so far."""
    return min(max(2.0 * previous, _FIRST_NAP), _LONGEST_NAP, _NAP_SHARE * waited)


_watch: Callable[[], None] | None = None


def watch(poll: Callable[[], None] | None) -> None:
    """While set, every wait calls ``poll()`` before each nap (after its spin); ``poll`` raises to
    end the wait (the caller abandons the request it waited for). Set once, by comm/divergence.py
    (``poll`` looks for a check overlapping a data wait: cheap, and rare, as naps are)."""
    global _watch
    _watch = poll


def wait_request(request: MPI.Request, what: str) -> None:
    """Wait until ``request`` completes, or raise ``CollectiveTimeoutError`` naming ``what``.
    Spins first, then backs off to growing naps (module docstring); polls the watched request
    meanwhile (:func:`watch`). (A GPU event stands in for a request too: its test drives no
    MPI progress.)"""
    if not request.Test():
        wait_until(request.Test, what, drives_mpi=isinstance(request, MPI.Request))


def wait_until(done: Callable[[], bool], what: str, drives_mpi: bool = True) -> None:
    """Poll ``done()`` until it is true, as :func:`wait_request` waits (the same spin, back-off,
    watch and deadline): for a request's ``Test``, or for a condition MPI does not signal (the
    divergence check's shared-memory board, which then also drives MPI's progress itself).
    While it spins it counts as driving MPI's progress (:func:`someone_spins`) if
    ``drives_mpi``: ``done()`` calls into MPI."""
    limit = collective_timeout()
    spin = wait_spin()
    start = time.monotonic()
    polls = 0
    nap = 0.0
    spinning = spin > 0 and drives_mpi and _spin_begins()
    try:
        while not done():
            polls += 1
            if polls % _POLLS_PER_CHECK:
                continue
            waited = time.monotonic() - start
            if limit > 0 and waited > limit:
                raise CollectiveTimeoutError(
                    f"{what} did not complete within DTORCH_COLLECTIVE_TIMEOUT={limit:g}s "
                    f"(started at {call_site()}, rank {MPI.COMM_WORLD.Get_rank()}): some rank of the group "
                    f"did not make the matching call (it failed, hangs, or runs another collective). "
                    f"The communicator is unusable after this; end the job."
                )
            if waited < spin:
                os.sched_yield()  # let a peer rank sharing this core run (blocking MPI waits yield too)
            else:
                if spinning:
                    spinning = _spin_ends()
                if _watch is not None:
                    _watch()
                nap = next_nap(nap, waited)
                time.sleep(nap)
    finally:
        if spinning:
            _spin_ends()


_spinners = 0  # waits in their spin now, on any thread
_spinners_lock = threading.Lock()
_none_spinning = threading.Event()
_none_spinning.set()


def _spin_begins() -> bool:
    global _spinners
    with _spinners_lock:
        _spinners += 1
        _none_spinning.clear()
    return True


def _spin_ends() -> bool:
    global _spinners
    with _spinners_lock:
        _spinners -= 1
        if not _spinners:
            _none_spinning.set()
    return False


def someone_spins() -> bool:
    """Whether a wait on some thread is in its spin now: testing without pause, it runs MPI's
    progress engine, which advances every request in flight, not only its own."""
    return _spinners > 0


def until_none_spins(timeout: float) -> None:
    """Sleep until no wait spins (at most ``timeout`` seconds). The progress thread stands
    aside so: each of its wake-ups is a thread switch, and on cores the ranks share, a turn
    taken from a spinning rank (a 2 MB reduce-scatter's wait at 2 ranks, raw mpi4py: 240 µs
    alone, 390 µs beside a thread waking every 50 µs; issue 26)."""
    _none_spinning.wait(timeout)


def allgather_bytes(comm: MPI.Intracomm, payload: bytes) -> list[bytes]:
    """Every rank's ``payload`` (bytes of any length, e.g. an error's text), in rank order: an
    ``Iallgather`` of the lengths and an ``Iallgatherv`` of the bytes, each under the deadline."""
    lengths = np.zeros(comm.Get_size(), dtype=np.int64)
    mine = np.array([len(payload)], dtype=np.int64)
    wait_request(comm.Iallgather(mine, lengths), "the library's error-report exchange (Allgather)")
    displs = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    send = np.frombuffer(payload, dtype=np.uint8) if payload else np.empty(0, np.uint8)
    wait_request(comm.Iallgatherv(send, [out, (lengths.tolist(), displs.tolist()), MPI.BYTE]),
                 "the library's error-report exchange (Allgatherv)")
    raw = out.tobytes()
    return [raw[int(s) : int(s) + int(n)] for s, n in zip(displs, lengths)]
