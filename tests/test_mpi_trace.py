"""Every rank of a group makes the same MPI-level call with matching counts (issue 18).

A tracing layer over each mesh-dim communicator records every collective each rank makes
(the mpi4py method and the bytes of every buffer argument) and passes the call on unchanged to
the real communicator. After every redistribute pair the traces of the ranks of each group are
compared: same methods in the same order, equal counts for the equal-size collectives, and for
the ``v``/``w`` collectives counts that match across ranks (what rank i sends to j is what j
receives from i). scripts/run_tests.py runs this on every comm path.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import SIZE, WORLD, Checker, lengths_for
from helpers import P1, P2, make_pieces
from helpers import local_of as local_piece
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.comm import Group, divergence, issuer
from dtorch_mpi.split import split_sizes

Call = tuple[str, tuple[Any, ...], Any]  # (method, bytes per buffer argument, root or counts)


def _bytes(arg: Any) -> Any:
    """The bytes an mpi4py buffer argument moves: an int, or a tuple per rank for ``v``/``w``."""
    if isinstance(arg, np.ndarray):
        return arg.nbytes
    if not isinstance(arg, (list, tuple)):
        return None
    buf, *rest = arg
    if len(rest) == 1:  # [buf, datatype]
        return np.asarray(buf).nbytes
    count, types = rest
    if isinstance(count, tuple):  # (counts, displs)
        counts = count[0]
        sizes = [t.Get_size() for t in types] if isinstance(types, list) else [types.Get_size()] * len(counts)
        return tuple(int(c) * s for c, s in zip(counts, sizes))
    return int(count) * types.Get_size()


def _is_buffer(arg: Any) -> bool:
    return isinstance(arg, np.ndarray) or (isinstance(arg, list) and isinstance(arg[0], np.ndarray))


class TracingComm:
    """Wraps a communicator: records each upper-case (buffer) collective, then delegates."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._comm = comm
        self.calls: list[Call] = []
        self.started: list[str] = []  # the mpi4py methods as called (``calls`` names I-forms by their collective)
        self.data: TracingComm | None = None  # a mesh communicator's: its twin's data communicator, traced

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._comm, name)
        if not name[0].isupper() or name.startswith(("Get_", "Free", "Set_")):
            return target

        method = name[1].upper() + name[2:] if name[0] == "I" and name[1].islower() else name

        def traced(*args: Any, **kwargs: Any) -> Any:
            self.started.append(name)
            extra = kwargs.get("root")
            if method == "Reduce_scatter":
                extra = tuple(args[2])
            self.calls.append((method, tuple(_bytes(a) for a in args if _is_buffer(a)), extra))
            return target(*args, **kwargs)

        return traced


def _mismatch(method: str, calls: list[Call]) -> str | None:
    """Why the calls of the ranks of one group (in group-rank order) do not match, if they don't."""
    if len({c[0] for c in calls}) > 1:
        return "different methods: " + ", ".join(c[0] for c in calls)
    if len({repr(c[2]) for c in calls}) > 1:
        return f"different roots/counts: {[c[2] for c in calls]}"
    sends = [c[1][0] for c in calls]
    recvs = [c[1][-1] for c in calls]
    if method in ("Alltoallv", "Alltoallw"):
        m = len(calls)
        bad = [(i, j) for i in range(m) for j in range(m) if sends[i][j] != recvs[j][i]]
        return f"send/recv counts disagree for (from, to) {bad}" if bad else None
    if method == "Allgatherv":
        if len(set(recvs)) > 1:
            return f"different recvcounts {recvs}"
        bad = [i for i in range(len(calls)) if sends[i] != recvs[0][i]]
        return f"ranks {bad} send other than the others receive" if bad else None
    if method == "Reduce_scatter":  # equal counts (compared above) and equal send buffers
        return None if len(set(sends)) == 1 else f"different send buffers {sends}"
    if method == "Scatterv":  # the root's per-rank send counts are what each rank receives
        counts = calls[calls[0][2]][1][0]
        bad = [i for i in range(len(calls)) if counts[i] != recvs[i]]
        return f"ranks {bad} receive other than the root sends them ({counts} vs {recvs})" if bad else None
    if method in ("Scatter", "Bcast"):
        return None if len(set(map(repr, recvs))) == 1 else f"different counts {recvs}"
    return None if len({repr(c[1]) for c in calls}) == 1 else f"different counts {[c[1] for c in calls]}"


@contextlib.contextmanager
def tracing(mesh: dt.DeviceMesh) -> Iterator[list[TracingComm]]:
    """Every mesh-dim communicator of ``mesh`` behind a :class:`TracingComm` while inside. The
    divergence check's twin of each (made with the mesh) follows it to its wrapper, so the calls
    the check covers stay checked and move on the twin's data communicator as they would; that
    communicator is traced too (the wrapper's ``data``: a trace of its own, since calls on two
    communicators may interleave differently on different ranks, started on two threads)."""
    raw = list(mesh._groups)
    wrapped = [TracingComm(g) for g in raw]
    mesh._groups = wrapped  # type: ignore[assignment]
    saved = []
    for r, w in zip(raw, wrapped):
        twin = divergence._TWINS.pop(id(r), None)
        if twin is not None:
            divergence._TWINS[id(w)] = twin
            saved.append((twin, twin.data, twin._groups))
            w.data = TracingComm(twin.data)
            twin.data, twin._groups = w.data, {}  # type: ignore[assignment]
    try:
        yield wrapped
    finally:
        issuer.drain()
        for twin, data, groups in saved:
            if isinstance(twin.data, TracingComm):  # (else a divergence inside renewed it: kept)
                twin.data, twin._groups = data, groups
        for r, w in zip(raw, wrapped):
            if id(w) in divergence._TWINS:
                divergence._TWINS[id(r)] = divergence._TWINS.pop(id(w))
        mesh._groups = raw


@pytest.fixture
def traced_mesh(request: pytest.FixtureRequest) -> Iterator[dt.DeviceMesh]:
    mesh = dt.init_device_mesh("cpu", request.param)
    with tracing(mesh):
        yield mesh
    mesh.free()


def _traces(mesh: dt.DeviceMesh) -> list[TracingComm]:
    """The traced communicators of ``mesh``: each mesh dim's, then its data twin's (where made)."""
    comms: list[TracingComm] = list(mesh._groups)  # type: ignore[arg-type]
    return comms + [g.data if g.data is not None else TracingComm(MPI.COMM_NULL) for g in comms]


def traced_count(mesh: dt.DeviceMesh) -> int:
    """How many calls the traced communicators of ``mesh`` hold now."""
    return sum(len(t.calls) for t in _traces(mesh))


def _compare_groups(mesh: dt.DeviceMesh, what: str, check: Checker) -> None:
    """Compare the traces of the ranks of every group, on each mesh dim's communicator and on
    its data twin (one world all-gather of the traces), and clear them."""
    coord = mesh.get_coordinate()
    traced = _traces(mesh)
    mine = [list(t.calls) for t in traced]
    for t in traced:
        t.calls.clear()
    everyone = WORLD.allgather((coord, mine))
    for j in range(len(traced)):
        k, on = j % mesh.ndim, ("" if j < mesh.ndim else " (data twin)")
        groups: dict[tuple[int, ...], list[tuple[int, list[Call]]]] = {}
        for c, traces in everyone:
            rest = tuple(v for i, v in enumerate(c) if i != k)
            groups.setdefault(rest, []).append((c[k], traces[j]))
        for rest, members in groups.items():
            members.sort()
            seqs = [t for _, t in members]
            if len({len(s) for s in seqs}) > 1:
                check.true(False, f"{what} mesh dim {k}{on} group {rest}: call counts {[len(s) for s in seqs]}")
                continue
            for n, calls in enumerate(zip(*seqs)):
                why = _mismatch(calls[0][0], list(calls))
                check.true(why is None, f"{what} mesh dim {k}{on} group {rest} call {n} ({calls[0][0]}): {why}")


def _run_traced(mesh: dt.DeviceMesh, layouts: list[list[dt.Placement]], shapes: list[tuple[int, ...]],
                check: Checker) -> int:
    calls = 0
    for shape in shapes:
        full = np.random.default_rng(sum(shape)).integers(-50, 50, size=shape).astype(np.float64)
        for src, dst in itertools.product(layouts, layouts):
            x = dt.DTensor.from_local(make_pieces(full, mesh, src), mesh, src, shape=shape)
            for async_op in (False, True):
                y = x.redistribute(placements=dst, async_op=async_op)
                check.equal(y.to_torch(), full, f"{shape} {src} -> {dst} async={async_op}")
            calls += traced_count(mesh)
            _compare_groups(mesh, f"{shape} {src} -> {dst}", check)
    return calls


@pytest.mark.parametrize("traced_mesh", [(SIZE,)], indirect=True)
def test_every_rank_makes_the_same_mpi_calls_1d(traced_mesh: dt.DeviceMesh, check: Checker) -> None:
    shapes = [(n, 3) for n in lengths_for(SIZE)] + [(3, n) for n in lengths_for(SIZE)] + [(1, 2), (1, 3)]
    calls = _run_traced(traced_mesh, [[p] for p in P1], shapes, check)
    check.true(SIZE == 1 or calls > 0, "the tracing layer saw no calls")
    check.done()


@pytest.mark.parametrize("traced_mesh", [{1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}.get(SIZE, (SIZE, 1))],
                         indirect=True)
def test_every_rank_makes_the_same_mpi_calls_2d(traced_mesh: dt.DeviceMesh, check: Checker) -> None:
    layouts = [list(p) for p in itertools.product(P2, repeat=2)]
    calls = _run_traced(traced_mesh, layouts, [(5, 3), (1, 2), (3, 1)], check)
    check.true(SIZE == 1 or calls > 0, "the tracing layer saw no calls")
    check.done()


@pytest.mark.parametrize("traced_mesh", [(SIZE,), {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}.get(SIZE, (SIZE, 1))],
                         indirect=True)
def test_distribute_tensor_moves_through_the_backend_in_matching_calls(traced_mesh: dt.DeviceMesh,
                                                                      check: Checker) -> None:
    """distribute_tensor's scatter runs on the backend's collectives over the mesh-dim groups
    (the traced communicators see it), with the same calls on every rank of each group."""
    mesh = traced_mesh
    layouts = [list(p) for p in itertools.product(P2, repeat=mesh.ndim)]
    moved = 0
    for shape in [(n, 3) for n in lengths_for(SIZE)] + [(3, 2 * SIZE + 1)]:
        full = np.random.default_rng(sum(shape)).integers(-50, 50, size=shape).astype(np.float64)
        for placements, root in itertools.product(layouts, sorted({0, SIZE - 1})):
            x = dt.distribute_tensor(full if WORLD.Get_rank() == root else None, mesh, placements, src_data_rank=root)
            what = f"{shape} {placements} from {root}"
            moved += traced_count(mesh)
            _compare_groups(mesh, what, check)
            if not any(isinstance(p, dt.Partial) for p in placements):
                check.equal(x.to_local(), local_piece(full, mesh, placements), what + " piece")
            check.equal(x.to_torch(), full, what)
            _compare_groups(mesh, what + " to_torch", check)
    check.true(SIZE == 1 or moved > 0, "distribute_tensor made no call on the mesh-dim groups")
    check.done()


def test_the_issue_18_reproducer_makes_one_call_kind(mesh1d: dt.DeviceMesh) -> None:
    """(1, 2) at 3 ranks and (1, 3) at 4: a rank moving nothing used to call Alltoall while the
    others called Alltoallv (Intel MPI and Open MPI 4.1 hang)."""
    comm = TracingComm(mesh1d.get_group(0))
    full = np.arange(float(max(SIZE - 1, 1))).reshape(1, -1)
    mine = local_piece(full, mesh1d, [dt.Shard(0)])
    out = np.empty(local_piece(full, mesh1d, [dt.Shard(1)]).shape)
    got = dt.comm.backend_named("mpi").all_to_all(Group(comm, 0), mine, out, 1, split_sizes(full.shape[1], SIZE),  # type: ignore[arg-type]
                                                  0, split_sizes(1, SIZE)).wait()
    kinds = WORLD.allgather([c[0] for c in comm.calls])
    assert SIZE == 1 or kinds[0], "no MPI call traced"
    assert all(k == kinds[0] for k in kinds), kinds
    assert np.array_equal(got, local_piece(full, mesh1d, [dt.Shard(1)]))


@pytest.mark.skipif(SIZE != 4, reason="needs a 2x2 mesh: a two-step plan whose later step shares a group")
@pytest.mark.parametrize("traced_mesh", [(2, 2)], indirect=True)
def test_later_async_steps_start_in_one_order_on_every_rank(traced_mesh: dt.DeviceMesh, check: Checker) -> None:
    """A two-step async redistribute (S0,S0)->(R,R): gather along mesh dim 1, then along mesh
    dim 0. Rank 0 polls ``done()`` while its first step finishes; the others go straight on to
    a blocking redistribute along mesh dim 0. The queued second step must start at the same
    point on every rank (before the blocking one), whatever the polling did."""
    mesh = traced_mesh
    S0, R = dt.Shard(0), dt.Replicate()
    full = np.arange(5.0 * 3).reshape(5, 3)
    other = np.arange(7.0)
    x = dt.DTensor.from_local(make_pieces(full, mesh, [S0, S0]), mesh, [S0, S0], shape=full.shape)
    y = dt.DTensor.from_local(make_pieces(other, mesh, [S0, R]), mesh, [S0, R], shape=other.shape)
    handle = x.redistribute(placements=[R, R], async_op=True)
    if mesh.get_coordinate() == (0, 0):
        pending = handle._pending  # the CompiledHandle behind the async result
        assert pending is not None
        for _ in range(20000):  # the first step finishes while rank 0 polls
            if pending.done():
                break
    check.equal(y.redistribute(placements=[R, R]).to_local(), other, "blocking redistribute meanwhile")
    check.equal(handle.to_local(), full, "two-step async redistribute")
    _compare_groups(mesh, "two-step async + blocking", check)
    check.done()


@pytest.mark.parametrize("traced_mesh", [(SIZE,)], indirect=True)
def test_every_collective_starts_nonblocking_with_the_deadline_on_or_off(traced_mesh: dt.DeviceMesh,
                                                                           deadline: float, check: Checker) -> None:
    """Blocking redistributes of every kind, even and uneven: each MPI call is the nonblocking
    I-form, polled to completion, whether the collective deadline is on or off (MPICH's blocking
    forms run other, slower algorithms; docs/performance.md)."""
    for shape in ((2 * SIZE, 3), (2 * SIZE + 1, SIZE + 1)):
        full = np.arange(float(np.prod(shape))).reshape(shape)
        for src, dst in (([dt.Shard(0)], [dt.Replicate()]), ([dt.Shard(1)], [dt.Replicate()]),
                         ([dt.Shard(0)], [dt.Shard(1)]), ([dt.Partial()], [dt.Replicate()]),
                         ([dt.Partial()], [dt.Shard(0)])):
            x = dt.DTensor.from_local(make_pieces(full, traced_mesh, src), traced_mesh, src, shape=shape)
            check.equal(x.redistribute(placements=dst).to_torch(), full, f"{shape} {src} -> {dst}")
    started = [name for g in traced_mesh._groups for name in g.started]  # type: ignore[attr-defined]
    check.true(SIZE == 1 or len(started) >= 10, f"too few calls traced: {started}")
    check.true(all(n[0] == "I" and n[1].islower() for n in started), f"blocking MPI calls made: {started}")
    check.done()


UNEVEN_GATHER_CALLS = {  # mesh-dim axis gathered -> comm path -> the MPI call made
    0: {"auto": "Iallgatherv", "variable": "Iallgatherv", "padded": "Iallgather"},
    1: {"auto": "Ialltoallw", "variable": "Ialltoallw", "padded": "Iallgather"},
}


@pytest.mark.parametrize("traced_mesh", [(SIZE,)], indirect=True)
def test_uneven_gathers_make_their_route_call_at_every_length(traced_mesh: dt.DeviceMesh, deadline: float,
                                                              check: Checker) -> None:
    """An uneven contiguous gather is one ``Allgatherv`` (padded path: the padded ``Allgather``,
    compacted), an uneven inner-axis gather one ``Alltoallw`` (padded: strided), at every length,
    with the deadline on and off: the call each rank makes, traced, and the values."""
    path = dt.comm.comm_path()
    for n, axis in itertools.product(lengths_for(SIZE), (0, 1)):
        full = np.arange(5.0 * n).reshape((n, 5) if axis == 0 else (5, n))
        x = dt.DTensor.from_local(make_pieces(full, traced_mesh, [dt.Shard(axis)]), traced_mesh, [dt.Shard(axis)],
                                  shape=full.shape)
        for g in traced_mesh._groups:
            g.started.clear()  # type: ignore[attr-defined]
        with dt.CommCounter() as c:
            y = x.redistribute(placements=[dt.Replicate()])
        started = [name for g in traced_mesh._groups for name in g.started]  # type: ignore[attr-defined]
        check.equal(y.to_local(), full, f"{full.shape} Shard({axis}) -> Replicate")
        if SIZE > 1 and n % SIZE:
            want = UNEVEN_GATHER_CALLS[axis][path]
            check.true(started == [want], f"{full.shape} Shard({axis}): made {started}, expected [{want!r}]")
            check.true(c.records[0].padded == (path == "padded"), f"{full.shape}: padded flag {c.records[0].padded}")
    _compare_groups(traced_mesh, "uneven gathers", check)
    check.done()
