"""The issue thread (comm/issuer.py): the library's overlapped collectives checked and started
off the computing thread give the same calls, results and divergence errors as inline.

Handed over are nonblocking calls of 64 KiB or more made inside ``issuer.deferred()`` where the
divergence check's data moves on a communicator of its own (``Prologued.overlaps``: MPICH) and
MPI runs at ``MPI_THREAD_MULTIPLE``, outside SPMD debug mode (which checks every call before it
starts); elsewhere every call stays inline and the tests check that nothing was handed over."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import RANK, SIZE, Checker
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi import nn, settings
from dtorch_mpi.comm import divergence, issuer
from dtorch_mpi.comm.config import spmd_debug
from dtorch_mpi.comm.divergence import CHECK_FROM
from dtorch_mpi.comm.work import Done
from dtorch_mpi.nn import functional as F

R, S0 = dt.Replicate(), dt.Shard(0)
DEFERS = (dt.comm.backend_named("mpi").overlaps and MPI.Query_thread() == MPI.THREAD_MULTIPLE
          and not spmd_debug())  # where the thread takes calls when the mode is "thread" (debug mode: none)
ranks = pytest.mark.skipif(SIZE == 1, reason="nothing is communicated at one rank")
ROWS = 2 * SIZE + 1  # uneven rows
COLS = CHECK_FROM // 8  # one row is 64 KiB of float64: every call below is checked


@pytest.fixture(params=["thread", "inline"])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    with issuer.issuing(request.param):
        yield request.param


@pytest.fixture(params=["board", "allreduce"])
def mesh(request: pytest.FixtureRequest) -> Iterator[dt.DeviceMesh]:
    """Both forms of the check the thread runs (DTORCH_SPMD_CHECK_FORM)."""
    from dtorch_mpi.comm import config

    before = config.check_form()
    config.set_check_form("auto" if request.param == "board" else "allreduce")
    mesh = dt.init_device_mesh("cpu", (SIZE,))
    yield mesh
    mesh.free()
    config.set_check_form(before)


def _handed(before: int, calls: int, mode: str) -> None:
    """``calls`` calls were handed to the thread since ``before`` exactly where they may be."""
    expected = calls if (DEFERS and mode == "thread") else 0
    assert issuer.issued - before == expected, (issuer.issued - before, expected)


@ranks
def test_deferred_calls_and_blocking_ones_keep_one_order(mesh: dt.DeviceMesh, mode: str) -> None:
    """Deferred gathers and reductions, a blocking gather between them (it waits until the thread
    has started every call handed over) and small unchecked calls: every result is NumPy's."""
    rng = np.random.default_rng(7)
    full = [rng.standard_normal((ROWS, COLS)) for _ in range(4)]
    xs = [dt.distribute_tensor(f, mesh, [S0]) for f in full]
    small = dt.distribute_tensor(np.arange(3.0 * SIZE), mesh, [S0])
    partial = dt.DTensor.from_local(full[3] * (RANK + 1), mesh, [dt.Partial("sum")])
    twin = divergence.twin_of(mesh.get_group(0))
    assert twin is not None
    before, numbered = issuer.issued, twin.seq
    with issuer.deferred():
        pending = [xs[0].redistribute(placements=[R], async_op=True),
                   xs[1].redistribute(placements=[R], async_op=True)]
        tiny = small.redistribute(placements=[R], async_op=True)  # below the check: inline
    blocking = xs[2].redistribute(placements=[R])
    with issuer.deferred():
        pending.append(partial.redistribute(placements=[S0], async_op=True))  # a reduce-scatter
    _handed(before, 3, mode)
    assert twin.seq == numbered + 5  # every call numbered in program order, handed over or not
    np.testing.assert_array_equal(blocking.to_local(), full[2])
    np.testing.assert_array_equal(tiny.to_local(), np.arange(3.0 * SIZE))
    np.testing.assert_array_equal(pending[0].to_local(), full[0])
    np.testing.assert_array_equal(pending[1].to_local(), full[1])
    total = full[3] * (SIZE * (SIZE + 1) // 2)
    np.testing.assert_allclose(pending[2].full_tensor(), total, rtol=1e-15)


@ranks
def test_a_divergent_deferred_call_raises_at_its_wait_on_every_rank(mesh: dt.DeviceMesh, mode: str) -> None:
    """Rank 0 gathers one shape, the others another: the check the thread runs finds it, and
    every rank raises SPMDDivergenceError when it waits (inline: at the call). The mesh works on."""
    x = dt.distribute_tensor(np.ones((ROWS, COLS)), mesh, [S0])
    y = dt.distribute_tensor(np.ones((ROWS + 1, COLS)), mesh, [S0])
    before = issuer.issued
    with pytest.raises(dt.SPMDDivergenceError, match="different collective calls") as err:
        with issuer.deferred():
            pending = (x if RANK == 0 else y).redistribute(placements=[R], async_op=True)
        _handed(before, 1, mode)
        pending.to_local()
    assert str((ROWS, COLS)) in str(err.value) and str((ROWS + 1, COLS)) in str(err.value)
    assert not any(twin.overlapping for twin in divergence._TWINS.values())
    with issuer.deferred():
        again = x.redistribute(placements=[R], async_op=True)
    np.testing.assert_array_equal(again.to_local(), np.ones((ROWS, COLS)))


@ranks
@pytest.mark.parametrize("case", ["modes", "extra"])
def test_after_a_caught_divergence_every_rank_counts_its_calls_alike_again(mesh: dt.DeviceMesh, case: str) -> None:
    """The ranks count different numbers of calls up to the error: ``modes``, rank 0 hands the
    divergent call to the issue thread (counted when handed over) while the others check it
    inline (an inline check that raises counts nothing); ``extra``, rank 0 makes one more
    checked call before its wait (refused, but counted). The count enters every check, so
    before the ranks agreed on it at the error, every later checked call on the mesh raised
    SPMDDivergenceError again. Now the program catches the error and the mesh works on."""
    x = dt.distribute_tensor(np.ones((ROWS, COLS)), mesh, [S0])
    y = dt.distribute_tensor(np.ones((ROWS + 1, COLS)), mesh, [S0])
    if case == "modes":
        how = "thread" if RANK == 0 else "inline"
    else:
        how = "thread"
    with issuer.issuing(how):
        with pytest.raises(dt.SPMDDivergenceError, match="different collective calls"):
            with issuer.deferred():
                pending = (x if RANK == 0 else y).redistribute(placements=[R], async_op=True)
                if case == "extra" and RANK == 0:
                    x.redistribute(placements=[R], async_op=True)  # (refused: never waited for)
            pending.to_local()
        twin = divergence.twin_of(mesh._groups[0])
        assert twin is not None
        counts = MPI.COMM_WORLD.allgather(twin.seq)
        assert len(set(counts)) == 1, counts
        with issuer.deferred():
            again = x.redistribute(placements=[R], async_op=True)
        np.testing.assert_array_equal(again.to_local(), np.ones((ROWS, COLS)))
        np.testing.assert_array_equal(x.redistribute(placements=[R]).to_local(), np.ones((ROWS, COLS)))


class _Experts(nn.Module):
    """Two experts of one shape, then a shared layer, without biases, ``width`` square: at 128
    every weight is 128 KiB of float64, at 32 8 KiB, below the size from which the default check
    covers a call (the plans' calls are checked at any size). ``route`` names the experts that
    run; ``first`` whether they come before the shared layer (their reductions are then the
    backward's last calls) or after it (the shared layer's reduction follows the one that
    differs, before anything waits for it). Every call of the divergent step is checked (a lone
    unchecked one would wait at exit for its partner until the deadline)."""

    def __init__(self, mesh: dt.DeviceMesh, first: bool, width: int) -> None:
        super().__init__()
        self.first = first
        self.c = nn.Linear(width, width, bias=False, device_mesh=mesh, dtype=np.float64)
        self.d = nn.Linear(width, width, bias=False, device_mesh=mesh, dtype=np.float64)
        self.shared = nn.Linear(width, width, bias=False, device_mesh=mesh, dtype=np.float64)
        self.route = "cd"

    def forward(self, x: dt.DTensor) -> dt.DTensor:
        if not self.first:
            x = self.shared(x)
        outs = [getattr(self, name)(x) for name in self.route]
        y = outs[0] + outs[1] if len(outs) == 2 else outs[0]
        return self.shared(y) if self.first else y


@ranks
@pytest.mark.parametrize("first", [True, False], ids=["experts-first", "shared-first"])
@pytest.mark.parametrize("plan", ["fsdp", "replicate"])
@pytest.mark.parametrize("width", [128, 32], ids=["128KiB", "8KiB"])
@pytest.mark.parametrize("uniform_first", [True, False], ids=["after-a-step", "from-the-start"])
def test_ranks_routing_to_different_experts_raise_instead_of_mixing_them(mesh: dt.DeviceMesh, mode: str, plan: str,
                                                                          first: bool, width: int,
                                                                          uniform_first: bool) -> None:
    """Rank 0 routes to expert ``c``, the others to ``d``, of equal shapes, after a step where
    every rank ran both (the bucket layout fixed, fully_shard's forward order recorded: its
    forward prefetches along it, the same calls on every rank, and the error comes in
    backward), or from the first step (fully_shard's forward raises). The collectives pair up by shape alone, so
    before the check compared what they carry, every rank finished with the other expert's
    shards (fully_shard) or its gradient summed into its own (replicate's bucket). Now every
    rank raises SPMDDivergenceError naming what each carried, promptly: a checked call made
    after the divergent one handed to the issue thread, before the program waited for it, is
    refused on every rank (issuer.refusal) rather than waiting in its check for ranks that
    refuse it, until the collective deadline (without the refusal, the thread-mode replicate
    cases with the shared layer first waited there). Weights of 8 KiB were paired silently
    until the plans' calls were checked at any size."""
    def build() -> nn.Module:
        dt.manual_seed(0)
        model = _Experts(mesh, first, width)
        if plan == "fsdp":
            for name in ("c", "d", "shared"):
                dt.fully_shard(model.get_submodule(name), mesh=mesh)
            return dt.fully_shard(model, mesh=mesh)
        return dt.replicate(model, mesh=mesh, bucket_bytes=0)

    model, fresh = build(), build()
    x = dt.distribute_tensor(np.random.default_rng(0).standard_normal((2 * SIZE, width)), mesh, [S0])
    (fresh(x) ** 2).sum().backward()
    if uniform_first:
        (model(x) ** 2).sum().backward()
        for p in model.parameters():
            p.grad = None
    model.route = "c" if RANK == 0 else "d"
    with pytest.raises(dt.SPMDDivergenceError, match="different collective calls") as err:
        (model(x) ** 2).sum().backward()
    text = str(err.value)
    if plan == "fsdp":
        assert "c.weight (fully_shard unit Linear, root #" in text or "d.weight (fully_shard unit Linear, root #" in text, text
    else:
        # (the first bucket that differs: one rank holds the expert's gradient, another makes a
        # checked call of nothing, whose text names the expert and find_unused_parameters)
        named = [e for e in ("c.weight", "d.weight") if f"(_Experts) bucket of {e}" in text]
        assert named and f"no gradient here for {named[0]}" in text and "find_unused_parameters=True" in text, text
    # the next steps on the same model drop what the failed one left in flight (a refused
    # call raises its error again: not raised twice) and compute as a fresh model does; a
    # fully_shard model also forgets the forward order the ranks recorded apart, and a forward
    # that raised forgets its gathers (before, every later step raised again)
    model.route = "cd"
    for step in range(2):
        for p in model.parameters():
            p.grad = None
        (model(x) ** 2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            np.testing.assert_array_equal(p.grad.to_local(), q.grad.to_local(), err_msg=f"step {step}: {name}")


def _model(plan: str, mesh: dt.DeviceMesh, seed: int) -> nn.Module:
    """Three Linear(96, 96) float64 layers (72 KiB each: every call checked) under ``plan``:
    fully_shard per layer and on the root, or replicate with one bucket per layer."""
    dt.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(96, 96, device_mesh=mesh, dtype=np.float64) for _ in range(3)])
    if plan == "fsdp":
        for layer in model:
            dt.fully_shard(layer, mesh=mesh)
        dt.fully_shard(model, mesh=mesh)
    else:
        dt.replicate(model, mesh=mesh, bucket_bytes=96 * 96 * 8)
    return model


@ranks
def test_fully_shard_and_replicate_train_bitwise_alike_on_the_thread_and_inline(mesh: dt.DeviceMesh) -> None:
    """Three steps of each plan with every call inline and with the thread: the same loss and
    parameters to the bit, and the thread did take the overlapped calls."""
    def train(plan: str, how: str) -> tuple[list[float], list[np.ndarray]]:
        with issuer.issuing(how):
            model = _model(plan, mesh, seed=3)
            opt = dt.optim.SGD(model.parameters(), lr=0.1)
            x = dt.distribute_tensor(np.random.default_rng(4).standard_normal((4 * SIZE, 96)), mesh, [S0])
            losses = []
            before = issuer.issued
            for _ in range(3):
                opt.zero_grad()
                loss = F.mse_loss(model(x), x)
                loss.backward()
                opt.step()
                losses.append(float(loss.full_tensor()))
            handed = issuer.issued - before
            if how == "thread" and DEFERS:  # the prefetches and reductions of every step (the last
                assert handed >= 3 * (len(model) - 1), handed  # reduction starts inline: see below)
            else:
                assert handed == 0, handed
            return losses, [p.full_tensor() for p in model.parameters()]

    for plan in ("fsdp", "replicate"):
        inline, threaded = train(plan, "inline"), train(plan, "thread")
        assert inline[0] == threaded[0], (plan, inline[0], threaded[0])
        for a, b in zip(inline[1], threaded[1]):
            np.testing.assert_array_equal(a, b)


def _sharded_as(layout: str, mesh: dt.DeviceMesh, seed: int) -> nn.Module:
    """Three Linear(96, 96) layers under fully_shard: every layer a unit under a root without
    parameters (``blocks``), the last layer left to the root (``head``: its gradients complete
    first in backward), or every layer a unit and no root (``no root``: a group each)."""
    dt.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(96, 96, device_mesh=mesh, dtype=np.float64) for _ in range(3)])
    for layer in (model if layout != "head" else model[:2]):
        dt.fully_shard(layer, mesh=mesh)
    if layout != "no root":
        dt.fully_shard(model, mesh=mesh)
    return model


@ranks
def test_the_last_reduction_of_a_backward_starts_on_the_computing_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reduction of a backward but its last is handed to the thread; the last, waited for
    at once by the end of backward, is started inline (``deferred(beside_work=False)``): the
    thread's wake-up would come between it and its wait. The last is the group's last unit to
    reduce (a root's own head reduces first); units sharded without a root are groups that know
    nothing of each other, and never count as last. Recorded per reduction started (a weight's
    and a bias's each): whether it may be handed over now (``issuer.deferring()``)."""
    import sys

    from dtorch_mpi.nn import fsdp
    replicate = sys.modules["dtorch_mpi.nn.replicate"]  # (the package exports the function of that name)

    seen: list[bool] = []
    start_reduce = fsdp._start_reduce

    def recording_start_reduce(*args: object) -> object:
        seen.append(issuer.deferring())
        return start_reduce(*args)

    class RecordingBackend:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def all_reduce(self, *args: object, **kwargs: object) -> object:
            seen.append(issuer.deferring())
            return self.inner.all_reduce(*args, **kwargs)  # type: ignore[attr-defined]

    real_backend_for = replicate.backend_for
    monkeypatch.setattr(fsdp, "_start_reduce", recording_start_reduce)
    monkeypatch.setattr(replicate, "backend_for", lambda kind: RecordingBackend(real_backend_for(kind)))
    mesh = dt.init_device_mesh("cpu", (SIZE,))
    inline_at_end = {"blocks": 2, "head": 2, "no root": 0, "replicate": 1}  # (replicate: one bucket per parameter)
    try:
        with issuer.issuing("thread"):
            beside = issuer.issue_mode() == "thread"  # (debug mode and Open MPI still start them inline)
            for plan, last in inline_at_end.items():
                model = _model(plan, mesh, seed=7) if plan == "replicate" else _sharded_as(plan, mesh, seed=7)
                x = dt.distribute_tensor(np.random.default_rng(8).standard_normal((4 * SIZE, 96)), mesh, [S0])
                for step in range(2):
                    seen.clear()
                    F.mse_loss(model(x), x).backward()
                    assert seen == [beside] * (6 - last) + [False] * last, (plan, step, seen)
    finally:
        mesh.free()


@ranks
def test_a_root_without_parameters_starts_the_first_units_gather_on_the_computing_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward prefetch is handed to the thread, beside the unit's compute; a root without
    parameters has none, and its blocks' first unit waits for the gather at once, so it starts
    inline. Recorded per gather started in forward: which block, and ``issuer.deferring()``."""
    from dtorch_mpi.nn import fsdp

    mesh = dt.init_device_mesh("cpu", (SIZE,))
    model = _model("fsdp", mesh, seed=9)
    blocks = {id(layer): k for k, layer in enumerate(model)}
    seen: list[tuple[int, bool]] = []
    start_gather = fsdp._Unit.start_gather

    def recording_start_gather(unit: fsdp._Unit) -> None:
        if unit.state == "free" and id(unit.module) in blocks:
            seen.append((blocks[id(unit.module)], issuer.deferring()))
        start_gather(unit)

    monkeypatch.setattr(fsdp._Unit, "start_gather", recording_start_gather)
    x = dt.distribute_tensor(np.random.default_rng(8).standard_normal((4 * SIZE, 96)), mesh, [S0])
    try:
        with issuer.issuing("thread"):
            beside = issuer.issue_mode() == "thread"  # (inline still where MPI is below THREAD_MULTIPLE)
            for step in range(3):  # (the first forward has no order to prefetch in yet)
                seen.clear()
                loss = F.mse_loss(model(x), x)
                assert step == 0 or seen == [(0, False), (1, beside), (2, beside)], (step, seen)
                loss.backward()
    finally:
        mesh.free()


@ranks
def test_every_rank_makes_the_same_mpi_calls_on_the_thread_and_inline(mode: str, check: Checker) -> None:
    """The MPI-call trace (tests/test_mpi_trace.py) of two steps of fully_shard and replicate,
    on the mesh's communicator and on the divergence check's data communicator, where the
    checked calls the thread starts move: the same calls, in the same order, with matching
    counts on every rank, whichever thread made them."""
    from test_mpi_trace import _compare_groups, tracing

    mesh = dt.init_device_mesh("cpu", (SIZE,))
    try:
        with tracing(mesh):
            moved = 0
            for plan in ("fsdp", "replicate"):
                model = _model(plan, mesh, seed=5)
                x = dt.distribute_tensor(np.random.default_rng(6).standard_normal((4 * SIZE, 96)), mesh, [S0])
                before = issuer.issued
                for step in range(2):
                    F.mse_loss(model(x), x).backward()
                    issuer.drain()
                    moved += sum(len(g.data.calls) for g in mesh._groups)  # type: ignore[attr-defined]
                    _compare_groups(mesh, f"{plan} step {step} ({mode})", check)
                handed = issuer.issued - before
                if DEFERS and mode == "thread":
                    check.true(handed >= 2 * (len(model) - 1), f"{plan}: the thread took only {handed} calls")
                else:
                    check.true(handed == 0, f"{plan}: {handed} calls handed over ({mode})")
            check.true(moved > 0 or not dt.comm.backend_named("mpi").overlaps,
                       "no checked call moved on a data communicator")
    finally:
        mesh.free()
    check.done()


def test_the_issue_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="issue mode 'sideways': use one of thread, inline"):
        issuer.set_issue_mode("sideways")
    assert settings.parse("DTORCH_ASYNC_ISSUE", "inline") == "inline"
    with pytest.raises(ValueError, match="DTORCH_ASYNC_ISSUE='x': use one of thread, inline"):
        settings.parse("DTORCH_ASYNC_ISSUE", "x")


@pytest.fixture
def held_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """A fresh issue thread that takes no call until the event is set (so a test decides who
    starts what), or 30 s have passed (a broken helper then fails the test, not hangs it);
    afterwards it is stopped and the next call starts a normal one."""
    issuer.stop()
    release = threading.Event()
    fallback = threading.Timer(30.0, release.set)
    fallback.start()
    real_run = issuer._run

    def held_run() -> None:
        release.wait()
        real_run()

    monkeypatch.setattr(issuer, "_run", held_run)
    try:
        yield release
    finally:
        fallback.cancel()
        release.set()
        issuer.stop()


def _recording(log: list[tuple[str, str]], name: str, fails: bool = False) -> Callable[[], Done]:
    def issue() -> Done:
        log.append((name, threading.current_thread().name))
        if fails:
            raise RuntimeError(f"{name} failed to start")
        return Done(name)
    return issue


@pytest.mark.rank_independent
@pytest.mark.path_independent
def test_a_waiter_starts_the_calls_queued_before_its_own_in_order(held_thread: threading.Event) -> None:
    """Waiting for a call the thread has not taken yet starts it on the waiting thread, after
    every call queued before it (in order; an earlier call's failure stays its own); calls
    queued after it are left to the thread."""
    log: list[tuple[str, str]] = []
    a = issuer.submit(_recording(log, "a", fails=True))
    b = issuer.submit(_recording(log, "b"))
    c = issuer.submit(_recording(log, "c"))
    assert b.wait() == "b"
    main = threading.current_thread().name
    assert log == [("a", main), ("b", main)] and not c.done()
    with pytest.raises(RuntimeError, match="a failed to start"):
        a.wait()
    held_thread.set()
    assert c.wait() == "c"
    assert log[2][0] == "c"
    issuer.drain()
    assert issuer._outstanding == 0


@pytest.mark.rank_independent
@pytest.mark.path_independent
def test_drain_starts_the_queued_calls_itself(held_thread: threading.Event) -> None:
    """A call made outside ``deferred()`` first waits for every call handed over to start
    (``drain``): it starts them itself rather than wait for the thread to wake."""
    log: list[tuple[str, str]] = []
    handles = [issuer.submit(_recording(log, name)) for name in "xyz"]
    issuer.drain()
    main = threading.current_thread().name
    assert log == [(name, main) for name in "xyz"] and issuer._outstanding == 0
    assert [h.wait() for h in handles] == list("xyz")


@pytest.mark.rank_independent
@pytest.mark.path_independent
def test_an_interrupt_while_helping_reaches_the_caller_and_loses_no_call(held_thread: threading.Event) -> None:
    """Ctrl-C landing while the waiting thread runs an earlier queued call: that call counts as
    started (its wait raises the interrupt), the waiter sees the interrupt at once, and the
    rest of the queue still starts, on the thread, in order."""
    log: list[tuple[str, str]] = []

    def interrupted() -> Done:
        log.append(("a", threading.current_thread().name))
        raise KeyboardInterrupt

    a = issuer.submit(interrupted)
    b = issuer.submit(_recording(log, "b"))
    with pytest.raises(KeyboardInterrupt):
        b.wait()
    assert [name for name, _ in log] == ["a"] and not b.done()
    with pytest.raises(KeyboardInterrupt):
        a.wait()
    held_thread.set()
    assert b.wait() == "b" and log[1][0] == "b"
    issuer.drain()
    assert issuer._outstanding == 0
