"""Ranks that diverge never get silently wrong data (SPEC 5, issue 23 item 12).

By default a divergent collective of 64 KiB or more raises ``SPMDDivergenceError`` on every rank
(the calls' fingerprints meet on the communicator's check twin, comm/divergence.py); debug mode
(``DTORCH_SPMD_DEBUG=1``) checks every collective, with the call site and a packed bucket's
parameters. Where one side makes no checked call the deadline bounds it
(harness_cases/case_divergence_deadline.py, launched at 3 ranks)."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest
from conftest import RANK, SIZE
from mpi4py import MPI
from mpi_launch import child_env, mpiexec

import dtorch_mpi as dt
from dtorch_mpi.comm import divergence
from dtorch_mpi.comm.divergence import CHECK_FROM
from dtorch_mpi.nn import Parameter
from dtorch_mpi.nn.utils import clip_grad_norm_, reduce_gradients

HERE = os.path.dirname(os.path.abspath(__file__))
R, S0, S1 = dt.Replicate(), dt.Shard(0), dt.Shard(1)
ranks = pytest.mark.skipif(SIZE == 1, reason="a divergence needs two ranks")
BIG = (2 * SIZE + 1, 4096)  # float64: 5-9 x 32 KiB, uneven rows
EDGE = (16, CHECK_FROM // 16 // 8)  # exactly 64 KiB of float64
OVERLAPS = dt.comm.backend_named("mpi").overlaps  # the check overlaps the data (MPICH; not Open MPI)


@pytest.fixture(params=["board", "allreduce"])
def form(request: pytest.FixtureRequest) -> Iterator[str]:
    """The check's two forms (DTORCH_SPMD_CHECK_FORM): on one host ``auto`` takes the node's
    shared-memory board; ``allreduce`` is the form of groups across nodes."""
    from dtorch_mpi.comm import config

    before = config.check_form()
    config.set_check_form("auto" if request.param == "board" else "allreduce")
    yield request.param
    config.set_check_form(before)


@pytest.fixture
def mesh1d(form: str) -> Iterator[dt.DeviceMesh]:
    """Every test here runs on a mesh of each form (the suite's shared mesh1d is replaced)."""
    mesh = dt.init_device_mesh("cpu", (SIZE,))
    yield mesh
    mesh.free()


@pytest.fixture
def mesh2d(form: str) -> Iterator[dt.DeviceMesh]:
    from conftest import MESH2D_SHAPES

    mesh = dt.init_device_mesh("cpu", MESH2D_SHAPES.get(SIZE, (SIZE, 1)), mesh_dim_names=("dp", "tp"))
    yield mesh
    mesh.free()


@pytest.fixture
def debug() -> Iterator[None]:
    from dtorch_mpi.comm import config

    before = config.spmd_debug()
    config.set_spmd_debug(True)
    yield
    config.set_spmd_debug(before)


def _diverges(call: Callable[[], Any], *names: str) -> str:
    """``call`` raises SPMDDivergenceError here (every rank asserts it: none returns data)."""
    with pytest.raises(dt.SPMDDivergenceError, match="different collective calls") as err:
        call()
    text = str(err.value)
    for name in names:
        assert name in text, text
    return text


@ranks
@pytest.mark.parametrize("shape", [BIG, EDGE], ids=["big", "64KiB"])
def test_mismatched_redistributes_raise_by_default(mesh1d: dt.DeviceMesh, shape: tuple[int, int]) -> None:
    """Rank 0 gathers, the others all-to-all the same tensor (issue 23's reproducer)."""
    x = dt.distribute_tensor(np.ones(shape), mesh1d, [S0])
    _diverges(lambda: x.redistribute(placements=[R] if RANK == 0 else [S1]), "all_gather", "all_to_all")
    y = x.redistribute(placements=[R])  # nothing moved before the check: the group is still in step
    assert np.array_equal(y.to_local(), np.ones(shape))


def _data_comm(mesh: dt.DeviceMesh) -> MPI.Intracomm:
    twin = divergence.twin_of(mesh.get_group(0))
    assert twin is not None
    return twin.data


@ranks
def test_a_verdict_of_different_calls_ends_an_overlapped_data_wait(mesh1d: dt.DeviceMesh) -> None:
    """Rank 0's blocking gather starts its data while its check is in flight; the others make a
    nonblocking call of another shape (checked before its data starts), so rank 0's data never
    completes: only the check's verdict, watched during the data wait, ends it (long before
    the deadline). Rank 0's request is abandoned, every rank replaces the data communicator,
    and the mesh works on. (Where the check does not overlap, rank 0 raises before its data.)"""
    from dtorch_mpi.comm import deadline, work

    x = dt.distribute_tensor(np.ones(BIG), mesh1d, [S0])
    y = dt.distribute_tensor(np.ones((2 * SIZE + 2, 4096)), mesh1d, [S0])
    before, abandoned, retired = _data_comm(mesh1d), len(work._ABANDONED), len(divergence._RETIRED)
    limit = deadline.collective_timeout()
    deadline.set_collective_timeout(60)  # a watch that missed the verdict would end here
    try:
        start = time.monotonic()
        if RANK == 0:
            _diverges(lambda: x.redistribute(placements=[R]), str(BIG), str((2 * SIZE + 2, 4096)))
        else:
            _diverges(lambda: y.redistribute(placements=[R], async_op=True), str(BIG))
        took = time.monotonic() - start
    finally:
        deadline.set_collective_timeout(limit)
    assert took < 30, took
    assert len(work._ABANDONED) == abandoned + (RANK == 0 and OVERLAPS)  # rank 0's gather, never completed
    assert _data_comm(mesh1d) is not before and len(divergence._RETIRED) == retired + 1
    assert not any(twin.overlapping for twin in divergence._TWINS.values())
    np.testing.assert_array_equal(x.redistribute(placements=[R]).to_local(), np.ones(BIG))
    np.testing.assert_array_equal(y.redistribute(placements=[R], async_op=True).to_local(),
                                  np.ones((2 * SIZE + 2, 4096)))


@ranks
def test_an_error_in_an_overlapped_data_call_becomes_the_verdict(mesh1d: dt.DeviceMesh,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A mismatched data call may fail in MPI (a truncated message) before the check's verdict
    arrives: the verdict decides. Rank 0's gather fails at once (before its data starts); the
    others' all-to-all waits for data that never comes until the verdict ends it: every rank
    raises SPMDDivergenceError (rank 0's caused by its failure)."""
    from dtorch_mpi.comm.mpi_backend import MPIBackend

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("truncated")

    if RANK == 0:
        monkeypatch.setattr(MPIBackend, "all_gather", fails)
    x = dt.distribute_tensor(np.ones(BIG), mesh1d, [S0])
    with pytest.raises(dt.SPMDDivergenceError, match="different collective calls") as err:
        x.redistribute(placements=[R] if RANK == 0 else [S1])
    if RANK == 0 and OVERLAPS:  # (else rank 0 raised before starting its data)
        assert isinstance(err.value.__cause__, RuntimeError)
    monkeypatch.undo()
    np.testing.assert_array_equal(x.redistribute(placements=[S1]).redistribute(placements=[R]).to_local(),
                                  np.ones(BIG))


def _count_checks(monkeypatch: pytest.MonkeyPatch, checks: list[int]) -> None:
    """Append every check's fingerprint to ``checks``: every check on a twin starts with its
    ``start`` (overlapped or not)."""
    for twin in divergence._TWINS.values():
        monkeypatch.setattr(twin, "start", lambda fp, start=twin.start: (checks.append(fp), start(fp))[1])


@ranks
def test_checked_calls_move_their_data_on_the_data_communicator(mesh1d: dt.DeviceMesh,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """From 64 KiB (the default check's calls) the data moves on the twin's data communicator,
    blocking (the check overlapped) or not (the check first); below it on the mesh's own
    communicator, with no check and nothing watched: the small call costs what it did. (On an
    MPI the check does not overlap on, every call moves on the mesh's communicator.)"""
    from dtorch_mpi.comm import prologue
    from dtorch_mpi.comm.mpi_backend import MPIBackend

    comms: list[MPI.Intracomm] = []
    checks: list[int] = []
    watched: list[object] = []
    gather, check_overlapping = MPIBackend.all_gather, prologue.overlapped
    monkeypatch.setattr(MPIBackend, "all_gather",
                        lambda self, group, *a, **k: (comms.append(group.comm), gather(self, group, *a, **k))[1])
    _count_checks(monkeypatch, checks)

    def watching(twin: divergence.Twin, *args: Any) -> Any:  # the overlapped check: the data wait watches it
        watched.append(twin)
        return check_overlapping(twin, *args)

    monkeypatch.setattr(prologue, "overlapped", watching)
    below = (16, EDGE[1] - 1)
    for shape, async_op, checked, overlapped in ((below, False, False, False), (below, True, False, False),
                                                 (EDGE, False, True, True), (BIG, True, True, False)):
        x = dt.distribute_tensor(np.ones(shape), mesh1d, [S0])
        comms.clear(), checks.clear(), watched.clear()
        y = x.redistribute(placements=[R], async_op=async_op)
        np.testing.assert_array_equal(y.to_local(), np.ones(shape))
        want = _data_comm(mesh1d) if checked and OVERLAPS else mesh1d.get_group(0)
        assert len(comms) == 1 and comms[0] is want, (shape, async_op, comms)
        assert len(checks) == checked, (shape, async_op, checks)
        assert bool(watched) == (overlapped and OVERLAPS), (shape, async_op, watched)


@ranks
def test_a_skipped_call_raises_at_the_next_one_by_default(mesh1d: dt.DeviceMesh) -> None:
    """Rank 0 makes a gather the others skip: their next (correct) gather meets it and raises."""
    x = dt.distribute_tensor(np.ones((2 * SIZE + 2, 4096)), mesh1d, [S0])
    y = dt.distribute_tensor(np.ones(BIG), mesh1d, [S0])

    def run() -> None:
        if RANK == 0:
            x.redistribute(placements=[R])
        y.redistribute(placements=[R])

    _diverges(run, str(BIG), str((2 * SIZE + 2, 4096)))


@ranks
def test_a_skipped_identical_call_raises_in_debug(mesh1d: dt.DeviceMesh, debug: None) -> None:
    """Same shapes, so only the call site tells the calls apart: debug mode compares it."""
    x = dt.distribute_tensor(np.ones((5, 3)), mesh1d, [S0])
    y = dt.distribute_tensor(np.zeros((5, 3)), mesh1d, [S0])

    def run() -> None:
        if RANK == 0:
            x.redistribute(placements=[R])
        y.redistribute(placements=[R])

    _diverges(run, "test_divergence.py:")


@ranks
@pytest.mark.parametrize("placements", [[R], [S1]], ids=["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("size", ["big", "small"])
def test_reduce_gradients_in_another_order_raises(mesh1d: dt.DeviceMesh, request: pytest.FixtureRequest,
                                                  placements: list[dt.Placement], size: str) -> None:
    """One rank passes the parameters reversed: one bucket of the same total size, other contents
    (raised by default from 64 KiB, in debug mode below)."""
    if size == "small":
        request.getfixturevalue("debug")
    cols = 64 * SIZE + 1
    shapes = [(64, cols), (40, cols), (24, cols)] if size == "big" else [(3, cols), (2, cols)]
    params = []
    for i, shape in enumerate(shapes):
        p = Parameter(dt.zeros(*shape, dtype=np.float64, device_mesh=mesh1d, placements=placements))
        p.grad = dt.DTensor.from_local(np.full(shape, float(i)), mesh1d, [dt.Partial()], shape=shape)
        params.append(p)
    assert (sum(math.prod(s) for s in shapes) * 8 >= CHECK_FROM) == (size == "big")
    _diverges(lambda: reduce_gradients(reversed(params) if RANK == 0 else params), "bucket of")


@ranks
@pytest.mark.parametrize("norms", [(math.inf, 2.0), (1.0, 2.0)], ids=["max-vs-sum", "p1-vs-p2"])
def test_clip_grad_norm_with_different_norm_types_raises_in_debug(mesh1d: dt.DeviceMesh, debug: None,
                                                                   norms: tuple[float, float]) -> None:
    p = Parameter(dt.zeros(2 * SIZE + 1, 3, dtype=np.float64, device_mesh=mesh1d, placements=[S0]))
    p.grad = dt.distribute_tensor(np.ones((2 * SIZE + 1, 3)), mesh1d, [S0])
    _diverges(lambda: clip_grad_norm_([p], 1e9, norms[0] if RANK == 0 else norms[1]), "norm_type")


@ranks
def test_small_mismatched_redistributes_raise_in_debug(mesh1d: dt.DeviceMesh, debug: None) -> None:
    x = dt.distribute_tensor(np.ones((2 * SIZE + 1, 3)), mesh1d, [S0])
    _diverges(lambda: x.redistribute(placements=[R] if RANK == 0 else [S1]), "all_gather", "all_to_all")


@ranks
def test_the_default_check_runs_from_64_kib_only(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Below 64 KiB on every rank no check runs (it costs the count of the call only); from 64 KiB
    every collective is checked once, on every rank alike (uneven pieces: the size is group-wide)."""
    checks: list[int] = []
    _count_checks(monkeypatch, checks)
    below = (16, EDGE[1] - 1)
    for shape, want in ((below, 0), (EDGE, 1), (BIG, 1)):
        x = dt.distribute_tensor(np.ones(shape), mesh1d, [S0])
        checks.clear()
        for dst in ([R], [S1]):
            x.redistribute(placements=dst)
        assert len(checks) == 2 * want, (shape, checks)
    x = dt.distribute_tensor(np.ones(BIG), mesh2d, [S0, S1])  # a sub-mesh group has its own twin
    checks.clear()
    x.redistribute(placements=[R, R])
    assert len(checks) == sum(n > 1 for n in mesh2d.shape), checks


launches_its_own_job = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                                          reason="launches its own mpiexec; runs in the 1-process pass")


def _case_output_at_a_2s_deadline(case: str, form: str = "auto") -> str:
    """Run tests/harness_cases/``case`` on 3 ranks with DTORCH_COLLECTIVE_TIMEOUT=2, every rank's
    output shown; the job must exit 0 (every planted divergence raised where the case expects)."""
    proc = mpiexec(3, os.path.join(HERE, "rank_wrapper.sh"), sys.executable, "-m", "pytest", "-q", "-s",
                   "--color=no", "--with-mpi", "-p", "no:randomly",
                   os.path.join(HERE, "harness_cases", case), timeout=120,
                   env=child_env(DTORCH_TEST_ALL_OUTPUT="1", DTORCH_COLLECTIVE_TIMEOUT="2",
                                 DTORCH_SPMD_CHECK_FORM=form))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@launches_its_own_job
@pytest.mark.parametrize("check_form", ["auto", "allreduce"])
def test_divergences_without_a_meeting_check_end_at_the_deadline(check_form: str) -> None:
    out = _case_output_at_a_2s_deadline("case_divergence_deadline.py", check_form)
    for rank in range(3):
        assert f"rank {rank} raised CollectiveTimeoutError" in out, out
        assert f"rank {rank} raised SPMDDivergenceError:" in out, out
        assert f"rank {rank} raised SPMDDivergenceError after a small call elsewhere" in out, out
        assert f"rank {rank} raised CollectiveTimeoutError at its wait, naming its line" in out, out


@launches_its_own_job
def test_a_rank_that_skips_the_first_mesh_leaves_the_others_at_the_deadline() -> None:
    """The first mesh's first collective (the library's duplicate of COMM_WORLD) is bounded by
    the deadline: it was a blocking Dup, and the others hung in it forever."""
    out = _case_output_at_a_2s_deadline("case_mesh_deadline.py")
    for rank in range(2):
        assert f"rank {rank} raised CollectiveTimeoutError: DeviceMesh construction" in out, out
    assert "rank 2 skipped the mesh" in out, out


@pytest.mark.skipif(SIZE != 4, reason="a 2 x 2 mesh")
def test_mismatched_nested_shard_exchanges_raise_by_default(mesh2d: dt.DeviceMesh) -> None:
    """Two whole-mesh exchanges (nested-shard redistributes: one Alltoallv on the mesh
    communicator, block counts differing per rank by design) to different targets: the check
    fingerprints what every rank shares (the global shape and both placements)."""
    from dtorch_mpi.redistribute.planner import exchanges_directly

    src = (S0, S0)
    targets = [t for t in [(S1, S1), (S1, S0), (S0, S1), (R, S1), (S1, R)] if exchanges_directly(src, t)]
    assert len(targets) >= 2, targets
    x = dt.distribute_tensor(np.ones(BIG), mesh2d, list(src))
    _diverges(lambda: x.redistribute(placements=list(targets[0] if RANK == 0 else targets[1])), "exchange")
    y = x.redistribute(placements=list(targets[0]))  # nothing moved before the check
    np.testing.assert_array_equal(y.to_torch(), np.ones(BIG))


def _board(ranks: int, count: int, compiled: bool) -> Any:
    """A board of ``ranks`` words in private memory (no window): the verdict's rules alone."""
    words = memoryview(bytearray(8 * divergence._LINE * ranks)).cast("B").cast("Q")
    return divergence._Board.in_memory(words, 0, [divergence._LINE * r for r in range(1, ranks)], count, compiled)


@ranks
def test_a_compiled_steps_inline_fingerprint_is_the_calls_fingerprint(mesh1d: dt.DeviceMesh,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The prologue fingerprints a call whose compiled step kept its digest inline (its hot
    path); a rank whose step has not kept it yet fingerprints through ``_fingerprint``: for the
    same call at the same number the two must agree, or matching ranks would diverge."""
    from dtorch_mpi.comm import Group, backend_for

    backend, group = backend_for("cpu"), Group(mesh1d.get_group(0), 0)
    twin = divergence.twin_of(group.comm)
    assert twin is not None
    checks: list[int] = []
    _count_checks(monkeypatch, checks)
    send = np.ones((EDGE[0] // SIZE + 1, EDGE[1]))
    out = np.empty((send.shape[0] * SIZE, EDGE[1]))
    cell: list[int | None] = [None]
    for digest in (cell, None, cell):  # fills the cell; the slow path; the inline path
        checks.clear()
        seq = twin.seq
        backend.all_gather(group, send, out, 0, (send.shape[0],) * SIZE, digest=digest)
        assert cell[0] is not None and checks == [divergence.fingerprint(seq, cell[0], "", "")], (digest, checks)
    np.testing.assert_array_equal(out, np.ones(out.shape))


def test_a_data_wait_polls_only_the_check_its_own_thread_overlaps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The data waits' watch polls the twin whose check overlaps this thread's wait, never one
    another thread's wait is on (a checkpoint save's writer must not take the main thread's
    verdict)."""
    import threading

    class Marked:
        def __init__(self) -> None:
            self.overlapping, self.polled_by = 0, []

        def poll(self) -> None:
            self.polled_by.append(threading.get_ident())

    mine, other, idle = Marked(), Marked(), Marked()
    go = threading.Event()
    worker = threading.Thread(target=lambda: (go.wait(), divergence._poll_overlapping()))
    worker.start()
    mine.overlapping, other.overlapping = threading.get_ident(), worker.ident
    for key, twin in enumerate((mine, other, idle)):
        monkeypatch.setitem(divergence._TWINS, -1 - key, twin)
    divergence._poll_overlapping()  # this thread's wait
    go.set()  # the worker's wait
    worker.join()
    assert mine.polled_by == [threading.get_ident()]
    assert other.polled_by == [worker.ident]
    assert idle.polled_by == []


@ranks
@pytest.mark.skipif(MPI.Query_thread() != MPI.THREAD_MULTIPLE, reason="two threads making MPI calls")
def test_a_plans_context_covers_only_its_own_thread(mesh1d: dt.DeviceMesh) -> None:
    """A small collective another thread makes (a loader's, on a mesh of its own) while the
    training thread is inside a plan's ``call_context(every_size=True)`` on rank 0 only is
    unchecked on every rank: the context is the thread's. (Shared by threads, the call was
    checked on rank 0 alone, whose check then waited out the deadline.)"""
    import threading

    from dtorch_mpi.comm import deadline

    loader_mesh = dt.init_device_mesh("cpu", (SIZE,))
    small = dt.distribute_tensor(np.arange(2.0 * SIZE).reshape(SIZE, 2), loader_mesh, [S0])
    big = dt.distribute_tensor(np.arange(float(BIG[0] * BIG[1])).reshape(BIG), loader_mesh, [S0])
    got: list[Any] = []

    def load() -> None:
        try:
            got.append(small.redistribute(placements=[R]).to_local())
        except BaseException as exc:  # raised below, on this rank's main thread
            got.append(exc)

    before = deadline.collective_timeout()
    deadline.set_collective_timeout(5)  # (the failure this guards against waits it out)
    try:
        loader = threading.Thread(target=load)
        with divergence.call_context(lambda: "a plan's bucket", every_size=True) if RANK == 0 else nullcontext():
            loader.start()
            loader.join()
        whole = big.redistribute(placements=[R]).to_local()  # the loader mesh's next checked call
    finally:
        deadline.set_collective_timeout(before)
        loader_mesh.free()
    assert not isinstance(got[0], BaseException), got[0]
    np.testing.assert_array_equal(got[0], np.arange(2.0 * SIZE).reshape(SIZE, 2))
    np.testing.assert_array_equal(whole, np.arange(float(BIG[0] * BIG[1])).reshape(BIG))


def test_the_board_is_compiled_where_it_can_be() -> None:
    """The install builds comm/_board.c (setup.py) wherever there is a C compiler and Python's
    headers; the Python rules are the fallback only where there are not."""
    import shutil
    import sysconfig

    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not (headers and shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0])):
        pytest.skip("no C compiler or Python headers here: the board runs its Python rules")
    assert divergence.COMPILED, "comm/_board.c was not built: reinstall (pip install -e .) and read its build output"


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("count", [0, 7, 0xFFFF], ids=["first", "later", "wraps"])
def test_the_board_verdict_reads_each_word_by_its_number(count: int, compiled: bool) -> None:
    """A rank's word holds its check's number (mod 2**16) under the fingerprint's low 48 bits
    (a negative fingerprint as two's complement): the same number decides (equal word: the same
    call); the next number means that rank already agreed to this check; the previous means it
    has not posted yet; any other number is out of step. The compiled board and the Python
    rules alike."""
    if compiled and not divergence.COMPILED:
        pytest.skip("comm/_board.c is not built here")
    fp = 0x1234_5678_9ABC
    board = _board(3, count, compiled)
    words, one, two = board._words, divergence._LINE, 2 * divergence._LINE  # the other ranks' words

    def word(fingerprint: int, number: int) -> int:
        return ((fingerprint << 16) | (number & 0xFFFF)) & (2**64 - 1)

    before = word(fp, count - 1)  # each other rank's word from the previous check
    assert words[0] == word(0, count - 1)  # this rank's before its first post
    words[one] = words[two] = before
    board.post(fp)
    assert words[0] == word(fp, count)
    assert board.verdict() is None  # nobody else has posted
    words[one] = word(fp, count)
    assert board.verdict() is None  # one has
    words[two] = word(fp, count)
    assert board.verdict() is True
    words[two] = word(fp ^ 1, count)  # the same number, another call
    assert board.verdict() is False
    words[two] = word(fp ^ 1, count + 1)  # already agreed (to this word) and posted its next
    assert board.verdict() is True
    words[one] = word(fp, count - 1)  # one not posted, the other posted another call: decided
    words[two] = word(fp ^ 1, count)
    assert board.verdict() is False
    words[two] = word(fp, count + 5)  # out of step
    assert board.verdict() is False
    negative = -(fp << 20) - 3  # the next check: numbered count + 1, a negative fingerprint
    board.post(negative)
    assert words[0] == word(negative, count + 1)
    words[one] = words[two] = word(negative, count + 1)
    assert board.verdict() is True


def test_a_group_on_one_node_checks_on_the_board(mesh1d: dt.DeviceMesh, form: str) -> None:
    """In ``auto`` form exactly a group whose ranks share a node (tests/test_multihost.py runs
    this file across hosts too)."""
    from dtorch_mpi._mpi import node_id

    group = mesh1d.get_group(0)
    twin = divergence.twin_of(group)
    if SIZE == 1:
        assert twin is None  # a group of one checks nothing
    else:
        one_node = len(set(group.allgather(node_id()))) == 1
        assert twin is not None and (twin.board is not None) == (form == "board" and one_node)
