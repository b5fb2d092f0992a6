"""Background progress of nonblocking collectives (comm/progress.py): a started transfer
finishes while the caller makes no MPI call at all."""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable

import numpy as np
import pytest
from conftest import Checker
from mpi4py import MPI
from mpi_launch import child_env, mpiexec

import dtorch_mpi as dt
from dtorch_mpi.comm import Group, backend_named, progress, work
from dtorch_mpi.comm.progress import progress_mode, set_progress_mode
from dtorch_mpi.split import split_sizes

BACKEND = backend_named("mpi")
ROWS_PER_RANK = 1 << 17  # 1 MB of float64 per rank: far above the eager limit, so MPI must progress it


@pytest.fixture
def restore_progress_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever mode a test sets, the one before it comes back afterwards (also on failure)."""
    monkeypatch.setattr(progress, "_mode", progress._mode)


@pytest.fixture
def thread_progress(restore_progress_mode: None) -> None:
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        pytest.skip("MPI runs below MPI_THREAD_MULTIPLE here: no progress thread")
    set_progress_mode("thread")


def test_an_async_gather_fills_its_output_while_the_caller_makes_no_mpi_call(
    mesh1d: dt.DeviceMesh, thread_progress: None, check: Checker
) -> None:
    """The caller only reads the output buffer (plain Python, no MPI call) until every rank's
    block has arrived; without background progress it would wait forever (bounded here)."""
    group = Group(mesh1d.get_group(0), 0)
    m = group.size
    sizes = split_sizes(ROWS_PER_RANK * m, m)  # equal blocks: every path gathers straight into ``out``
    full = np.arange(sum(sizes), dtype=np.float64)
    start = sum(sizes[: group.rank])
    out = np.full_like(full, -1.0)
    work = BACKEND.all_gather(group, full[start : start + sizes[group.rank]], out, 0, sizes, async_op=True)
    deadline = time.monotonic() + 60
    while not np.array_equal(out, full) and time.monotonic() < deadline:
        time.sleep(1e-3)  # the caller's "work": no MPI call on this thread
    arrived = np.array_equal(out, full)
    check.equal(work.wait(), full, "the gathered vector")
    assert arrived, "the transfer did not progress while the caller made no MPI call"


def test_the_thread_stops_polling_once_the_transfer_completed_though_nobody_waited_yet(
    mesh1d: dt.DeviceMesh, thread_progress: None, check: Checker
) -> None:
    """The thread completes a request itself and then rests, though the request stays in
    flight until the main thread's next collective or wait reaps it (it used to poll on until
    then: a fifth of a core in fully_shard's step, issue 26)."""
    group = Group(mesh1d.get_group(0), 0)
    m = group.size
    sizes = split_sizes(ROWS_PER_RANK * m, m)
    full = np.arange(sum(sizes), dtype=np.float64)
    start = sum(sizes[: group.rank])
    out = np.full_like(full, -1.0)
    handle = BACKEND.all_gather(group, full[start : start + sizes[group.rank]], out, 0, sizes, async_op=True)
    entry = getattr(handle, "_entry", None)  # None: finished inside the call (one rank)
    deadline = time.monotonic() + 60
    thread = progress._thread
    while entry is not None and not (entry.complete and thread is not None and not thread.polling) \
            and time.monotonic() < deadline:
        time.sleep(1e-3)  # no MPI call on this thread
        thread = progress._thread
    if entry is not None:
        rested = entry.complete and thread is not None and not thread.polling
        assert entry in work._IN_FLIGHT, "the request was reaped, though the main thread made no MPI call"
        assert rested, "the progress thread still polls a completed transfer"
    check.equal(handle.wait(), full, "the gathered vector")


def test_the_thread_drops_the_buffers_of_a_request_it_completed(
    mesh1d: dt.DeviceMesh, thread_progress: None, check: Checker
) -> None:
    """A send buffer nothing but the in-flight request holds is freed by the progress thread
    when it completes the request, before the owner's wait: freeing a large array hands its
    memory back to the system (~0.25 ms for 2 MB with glibc), which then happens beside the
    caller's work rather than inside its wait (issue 26). The result is untouched."""
    group = Group(mesh1d.get_group(0), 0)
    m = group.size
    sizes = split_sizes(ROWS_PER_RANK * m, m)
    full = np.arange(sum(sizes), dtype=np.float64)
    start = sum(sizes[: group.rank])
    send = full[start : start + sizes[group.rank]].copy()
    sent = weakref.ref(send)
    out = np.full_like(full, -1.0)
    handle = BACKEND.all_gather(group, send, out, 0, sizes, async_op=True)
    del send
    entry = getattr(handle, "_entry", None)  # None: finished inside the call (one rank)
    deadline = time.monotonic() + 60
    while entry is not None and not entry.complete and time.monotonic() < deadline:
        time.sleep(1e-3)  # no MPI call on this thread: only the progress thread completes it
    if entry is not None:
        assert entry.complete, "the progress thread did not complete the request"
        assert sent() is None, "the completed request still holds its send buffer"
    check.equal(handle.wait(), full, "the gathered vector")


class _FailsOnTest:
    """A request stand-in whose completion fails, as MPI's ``Test`` raises for a request that
    completes with an error (a truncated receive). A real MPI error is not used: it can leave
    the MPI library unusable for the rest of the process (Open MPI aborted a later call)."""

    def Test(self) -> bool:
        raise RuntimeError("the request completed with an error")


def test_an_error_completing_a_request_on_the_thread_is_raised_by_the_wait(thread_progress: None) -> None:
    """A request whose completion fails while the progress thread tests it: the thread lives
    on, and the owner's wait raises the error (it used to kill the thread, and the wait,
    finding an MPI request null, returned as if done)."""
    handle = work.Work(_FailsOnTest(), lambda: None, (), "a failing request")  # type: ignore[arg-type]
    entry = handle._entry
    assert entry is not None
    entry.polled = True  # the stand-in as an MPI request: the thread's to test
    work.progress_in_background()
    deadline = time.monotonic() + 30
    while not entry.complete and time.monotonic() < deadline:
        time.sleep(1e-3)  # the progress thread meets the error, not this thread
    thread = progress._thread
    assert entry.complete and entry.error is not None, "the progress thread did not complete the request"
    assert thread is not None and thread._thread.is_alive(), "the error ended the progress thread"
    with pytest.raises(RuntimeError, match="completed with an error"):
        handle.wait()
    work._ABANDONED.remove(entry)  # (kept for good by the failed wait: it holds no buffer)


def test_a_request_being_waited_on_is_skipped_and_reported_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress thread's poll never tests a request another thread is waiting on (that wait
    holds its lock throughout); it reports it held, so the thread drives MPI by its own receive
    meanwhile. A complete request is not tested again."""
    never = _DoneAfter(1e9)
    entry = work._InFlight(never, ())  # type: ignore[arg-type]
    assert not entry.polled, "a request that is not MPI's (a GPU event) is not the thread's"
    entry.polled = True  # the stand-in as an MPI request
    monkeypatch.setattr(work, "_IN_FLIGHT", {entry})
    tested = []
    monkeypatch.setattr(never, "Test", lambda: tested.append(1) or False)
    assert work._poll_in_flight() == (True, False) and len(tested) == 1
    with entry._lock:  # as entry.wait() holds it
        assert work._poll_in_flight() == (True, True) and len(tested) == 1, "a held request was tested"
    entry.complete = True
    assert work._poll_in_flight() == (False, False) and len(tested) == 1, "a complete request was tested again"


def test_async_results_are_right_with_and_without_the_thread(mesh1d: dt.DeviceMesh, check: Checker,
                                                            restore_progress_mode: None) -> None:
    full = np.random.default_rng(5).random((2 * mesh1d.size() + 1, 3))
    for mode in ("off", "thread"):
        set_progress_mode(mode)
        x = dt.distribute_tensor(full, mesh1d, [dt.Shard(0)])
        y = x.redistribute(placements=[dt.Shard(1)], async_op=True)
        handle = x.to_torch_async()
        check.equal(y.to_torch(), full, f"async S0->S1 ({mode})")
        check.equal(handle.wait(), full, f"to_torch_async ({mode})")


@pytest.mark.parametrize("value", ["always", ""])
def test_a_wrong_progress_setting_is_a_clear_error(value: str, monkeypatch: pytest.MonkeyPatch,
                                                   restore_progress_mode: None) -> None:
    monkeypatch.setenv("DTORCH_ASYNC_PROGRESS", value)
    with pytest.raises(ValueError, match=r"DTORCH_ASYNC_PROGRESS.*thread, off"):
        progress_mode()
    with pytest.raises(ValueError, match="use one of thread, off"):
        set_progress_mode(value)


@pytest.mark.parametrize("value", ["0", "-5", "fast"])
def test_a_wrong_progress_interval_is_a_clear_error(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from dtorch_mpi.comm.progress import poll_interval

    monkeypatch.setenv("DTORCH_PROGRESS_INTERVAL", value)
    with pytest.raises(ValueError, match="DTORCH_PROGRESS_INTERVAL"):
        poll_interval()


_TRANSFERS_IN_FLIGHT = """
import numpy as np
from mpi4py import MPI
import dtorch_mpi as dt
from dtorch_mpi.comm import progress
mesh = dt.init_device_mesh("cpu", (MPI.COMM_WORLD.size,))
full = np.arange(1 << 18, dtype=np.float64)
x = dt.distribute_tensor(full, mesh, [dt.Shard(0)])
kept = x.redistribute(placements=[dt.Replicate()], async_op=True)
x.to_torch_async()  # dropped: still in flight when the program ends
assert progress._thread is not None, "the progress thread should be polling now"
"""

_FINALIZE_AFTER_WAIT_ALL = _TRANSFERS_IN_FLIGHT + """
dt.wait_all()
assert progress._thread is None, "wait_all() stops the progress thread"
assert np.array_equal(kept.to_local(), full), "a transfer waited by wait_all() keeps its result"
MPI.Finalize()
print("finalized", flush=True)
"""


@pytest.mark.rank_independent  # launches its own mpiexec
@pytest.mark.path_independent  # the progress thread's stop at exit: the same on every path
@pytest.mark.parametrize("program, ending", [
    (_TRANSFERS_IN_FLIGHT + "print('ended', flush=True)", "ended"),
    (_FINALIZE_AFTER_WAIT_ALL, "finalized"),
], ids=["exit-finalizes", "program-finalizes-after-wait_all"])
def test_mpi_is_finalized_only_after_the_progress_thread_stopped(program: str, ending: str) -> None:
    """MPI forbids another thread's MPI calls while MPI_Finalize runs (MPICH stops locking as it
    starts, and a poll caught there aborts finalisation ~10% of the time: the failure this
    guards against). At exit, an atexit hook stops the thread and waits for the dropped
    transfers before mpi4py finalises; a program finalising MPI itself calls wait_all() first."""
    proc = mpiexec(2, sys.executable, "-c", program, timeout=120, env=child_env(DTORCH_ASYNC_PROGRESS="thread"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count(ending) == 2 and "after finalizing" not in out and "mutex" not in out, out


def test_the_poll_interval_stays_bounded_however_long_a_wait_lasts() -> None:
    """A wait of minutes (tens of thousands of polls) keeps the interval at its cap: the doubling
    used to overflow a float and end the progress thread."""
    from dtorch_mpi.comm.progress import _MAX_INTERVAL, _interval_after

    assert _interval_after(50e-6, 0) == 50e-6
    assert _interval_after(50e-6, 64) == 100e-6
    for polls in (10**3, 10**5, 10**7):
        assert _interval_after(50e-6, polls) == _MAX_INTERVAL


class _DoneAfter:
    """A request stand-in that completes ``seconds`` after it is made (the wait's loop only
    calls ``Test``)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def Test(self) -> bool:
        return time.monotonic() >= self.end


def _naps_of_a_wait(monkeypatch: pytest.MonkeyPatch, seconds: float) -> tuple[list[float], float]:
    from dtorch_mpi.comm import deadline

    naps: list[float] = []
    real_sleep = time.sleep

    def recording_sleep(s: float) -> None:
        naps.append(s)
        real_sleep(s)

    monkeypatch.setattr(deadline.time, "sleep", recording_sleep)
    start = time.monotonic()
    deadline.wait_request(_DoneAfter(seconds), "a test wait")  # type: ignore[arg-type]
    return naps, time.monotonic() - start


def test_a_waiting_rank_backs_off_to_bounded_naps_after_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait longer than DTORCH_WAIT_SPIN sleeps between polls (so it leaves a shared core to
    the ranks still working); each nap at most 1 ms and at most an eighth of the time waited,
    doubling from 20 µs."""
    from dtorch_mpi import settings
    from dtorch_mpi.comm.deadline import _FIRST_NAP, _LONGEST_NAP, next_nap

    monkeypatch.setitem(settings._kept, "DTORCH_WAIT_SPIN", 200.0)
    naps, took = _naps_of_a_wait(monkeypatch, 0.03)
    assert naps, "a 30 ms wait never slept"
    assert max(naps) <= _LONGEST_NAP and sum(naps) <= took
    assert next_nap(0.0, 1.0) == _FIRST_NAP and next_nap(_FIRST_NAP, 1.0) == 2 * _FIRST_NAP
    assert next_nap(_LONGEST_NAP, 10.0) == _LONGEST_NAP and next_nap(1e-4, 2e-4) == pytest.approx(2.5e-5)


def test_a_wait_spins_without_sleeping_for_the_spin_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within DTORCH_WAIT_SPIN a wait never sleeps (a short collective's latency is that of a
    spinning wait); a huge spin time restores the pure spin."""
    from dtorch_mpi import settings

    monkeypatch.setitem(settings._kept, "DTORCH_WAIT_SPIN", 1e9)
    naps, _ = _naps_of_a_wait(monkeypatch, 0.005)
    assert naps == []


def test_a_background_threads_wait_spins_at_most_50_us(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue thread's waits (its checks) back off after 50 µs whatever DTORCH_WAIT_SPIN
    says: their polls hold the GIL the computing thread needs."""
    import threading

    from dtorch_mpi import settings
    from dtorch_mpi.comm.deadline import BACKGROUND_SPIN, wait_spin

    monkeypatch.setitem(settings._kept, "DTORCH_WAIT_SPIN", 1e9)
    got: list[object] = []

    def background() -> None:
        got.append(wait_spin())
        got.append(_naps_of_a_wait(monkeypatch, 0.01)[0])

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert got[0] == BACKGROUND_SPIN == 50e-6 and wait_spin() == 1e3
    assert got[1], "a 10 ms wait on a background thread never slept"


def test_a_wait_is_seen_spinning_only_while_it_spins(monkeypatch: pytest.MonkeyPatch) -> None:
    """``someone_spins()`` holds while a wait polls without pause, not once it naps or ends
    (also by raising); a wait with no spin time, or on something whose test drives no MPI
    progress (a GPU event), never counts."""
    from dtorch_mpi import settings
    from dtorch_mpi.comm import deadline

    seen: list[bool] = []

    def done_after(seconds: float) -> Callable[[], bool]:
        end = time.monotonic() + seconds

        def done() -> bool:
            seen.append(deadline.someone_spins())
            return time.monotonic() > end
        return done

    monkeypatch.setitem(settings._kept, "DTORCH_WAIT_SPIN", 1e9)
    assert not deadline.someone_spins()
    deadline.wait_until(done_after(0.002), "a spinning wait")
    assert seen and all(seen) and not deadline.someone_spins()
    monkeypatch.setitem(settings._kept, "DTORCH_WAIT_SPIN", 200.0)
    seen.clear()
    deadline.wait_until(done_after(0.01), "a wait that naps")
    assert seen[0] and not seen[-1] and not deadline.someone_spins()

    def fails() -> bool:
        raise RuntimeError("the request completed with an error")
    with pytest.raises(RuntimeError):
        deadline.wait_until(fails, "a failing wait")
    assert not deadline.someone_spins()
    seen.clear()
    deadline.wait_until(done_after(0.002), "a wait on a GPU event", drives_mpi=False)
    assert seen and not any(seen)
    monkeypatch.setitem(settings._kept, "DTORCH_WAIT_SPIN", 0.0)
    seen.clear()
    deadline.wait_until(done_after(0.001), "a wait without spin")
    assert not any(seen)


@pytest.mark.skipif(MPI.Query_thread() != MPI.THREAD_MULTIPLE, reason="no progress thread below MPI_THREAD_MULTIPLE")
def test_the_thread_stands_aside_while_a_wait_spins() -> None:
    """While some wait spins (it drives MPI's progress itself), the progress thread does not
    poll: each of its wake-ups would be a thread switch taken from the spinning rank. It polls
    again once the spin ends."""
    from dtorch_mpi.comm import deadline

    polls = [0]

    def poll() -> tuple[bool, bool]:
        polls[0] += 1
        return True, False  # one request, never complete

    thread = progress.ProgressThread(poll, 50e-6)
    try:
        deadline._spin_begins()
        try:
            thread.kick()
            time.sleep(0.02)  # (a poll already under way when the spin began may finish)
            before = polls[0]
            time.sleep(0.05)
            during = polls[0] - before
        finally:
            deadline._spin_ends()
        time.sleep(0.05)
        after = polls[0] - before - during
    finally:
        thread.stop()
    assert during == 0, f"the thread polled {during} times while a wait spun"
    assert after > 0, "the thread did not poll again once the spin ended"


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_a_wrong_wait_spin_is_a_clear_error(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from dtorch_mpi import settings

    monkeypatch.setenv("DTORCH_WAIT_SPIN", value)
    monkeypatch.delitem(settings._kept, "DTORCH_WAIT_SPIN", raising=False)
    with pytest.raises(ValueError, match="DTORCH_WAIT_SPIN"):
        settings.get("DTORCH_WAIT_SPIN")
