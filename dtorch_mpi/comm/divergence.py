"""The divergence check (SPEC 5): ranks that make different collective calls get an error,
never each other's wrong data.

Every communicator the library moves data on (a mesh's, built in ``DeviceMesh``) gets a
:class:`Twin` (:func:`attach`, collective where the mesh builds the communicator): a check
communicator (a ``Dup`` that carries nothing but checks, so a check can never be matched with
data traffic), a data communicator (a second ``Dup``, below) and the count of collectives the
prologue starts on the communicator (``seq``). A check compares a fingerprint of the call across
the group: the sequence number, kind, group-wide shape, dtype, op, sizes, the backend's own
call, and what the caller adds (:func:`call_context`: a packed bucket's ordered parameters,
``clip_grad_norm_``'s norm type). How the group compares them is decided at attach from
group-wide facts (``DTORCH_SPMD_CHECK_FORM``): where every rank of the group shares one node, on
a shared-memory board (:class:`_Board`: each rank posts one word and reads the others', no
collective; a check costs ~0.3 us where an all-reduce cost ~5); elsewhere one all-reduce of two
int64 (the least ``h`` and the least ``-h``) on the check communicator, a persistent one
started per check (``MPI_Allreduce_init`` at attach; ``Iallreduce`` where MPI has none). Either
is bounded by the collective deadline: equal on every rank, or every rank exchanges the calls'
texts (only then, on the check communicator) and raises ``SPMDDivergenceError`` naming each
rank's call.

When it runs: in debug mode (``DTORCH_SPMD_DEBUG=1``) for every collective, the fingerprint
then also holding the user's call site (:func:`user_site`); by default for every collective
whose group-wide payload (the whole tensor's bytes, computed by the prologue from the call's
group-wide facts, so every rank making the same call decides alike; at least what any rank
sends or receives as one buffer) is :data:`CHECK_FROM` or more, and for every call made inside
``call_context(..., every_size=True)`` (the data-parallel plans'), on a communicator with a twin.
Below the threshold on every rank the default adds only the count. ``DTORCH_SPMD_CHECK=0``
turns the default check off (for a benchmark of its cost; debug mode still checks).

Overlapped with the data (the default's cost, issue 23 item 12). A call the default check
covers moves its data on the twin's data communicator when its backend ``overlaps_check`` (the
MPI backend) and MPI survives mismatched collectives (:data:`OVERLAP`: MPICH; Open MPI 5's
libnbc crashes after one), every other call on the communicator itself: a function of group-wide facts, so
for matching programs each communicator sees the same calls in the same order on every rank.
A blocking such call that writes no caller's buffer in place (not ``send is out``: broadcast),
outside debug mode, starts its check, then its data (:func:`overlapped`), and waits for the
data while watching the check (``deadline.watch``: polled before each nap of the wait, so
only a wait that outlasts its spin polls it); a verdict of different calls ends that wait,
which may be for data that never comes, the data request abandoned (its buffers
kept for good in ``work._ABANDONED``, as a timed-out request's, and never tested again); after
the data completes the verdict is waited for before anything is returned, and a data call that
fails (a mismatched call's MPI error: the data communicator returns errors as exceptions)
waits for it too, raising ``SPMDDivergenceError`` when the calls differed. Every other checked
call runs its check before its data starts: nonblocking calls (no check stays pending across
other calls on the twin), in-place ones (the caller's buffer would be overwritten before the
verdict), debug mode, and backends without ``overlaps_check`` (a mismatched NCCL kernel hangs
its stream; device memory left to an abandoned request).

Why the data needs a communicator of its own: the check is decided per rank, so when calls
diverge one rank may check (its call is 64 KiB or more) while another's call is small and
unchecked; the checking rank's data is then in flight before its verdict, and on the
communicator the small call uses it could match it (wrong data, or a truncation error). On the
data communicator no unchecked call ever moves anything.

So a divergent call in which some rank moves that much is checked on that rank, which returns
no data before every rank's fingerprint at the same position has been compared: either the
others' calls fingerprint alike, or every rank raises with it (even where its data completed),
or (a side that made no checked call) the checking rank's check and data never complete and it
raises ``CollectiveTimeoutError`` at the deadline, while the other side's data call waits for a
data call that never comes. After a verdict of different calls every rank of the group is at
the same position on the check communicator (they all got the one verdict): they exchange the
texts there and replace the data communicator by an ``MPI_Comm_idup`` of the check
communicator (:meth:`Twin.renew_data`; the old one, which may hold abandoned requests and
messages no call will receive, is kept unfreed), so the mesh works on after the error. A check
that times out is abandoned like its data (the communicator is unusable after a timeout).

Not caught by any metadata check: a call identical in every fingerprinted fact (a different
tensor of the same shape, dtype and layout, or parameters of equal shapes swapped in a bucket).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from threading import get_ident, local
from typing import Any, NoReturn

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveTimeoutError
from . import issuer
from .config import check_form
from .deadline import allgather_bytes, user_frame, wait_request, wait_until, watch
from .group import Group
from .work import _ABANDONED, _InFlight

try:
    from ._board import Board as _CompiledBoard
except ImportError:  # not built (setup.py: optional): the same rules in Python
    _CompiledBoard = None

COMPILED = _CompiledBoard is not None
"""Whether the board's post and verdict run compiled (comm/_board.c)."""

CHECK_FROM = 64 << 10
"""Group-wide bytes from which the default check runs (SPEC 5: 64 KiB)."""


def _survives_mismatched_collectives() -> bool:
    """Whether this MPI keeps working after mismatched collectives on a communicator (what an
    overlapped check leaves behind when calls diverge: a truncated message, requests never
    completed). MPICH: yes (4-MiB-and-smaller gathers, all-to-alls, all-reduces and
    reduce-scatters against each other, 2-4 ranks, every comm path, each followed by a correct
    call). Open MPI 5.0: no, its nonblocking collectives' engine (libnbc) crashes (a segfault, a
    double free) in the next progress after a schedule failed with a truncation. Any other MPI:
    not known, so not assumed. The same on every rank (one MPI library)."""
    return MPI.Get_library_version().startswith("MPICH")


OVERLAP = _survives_mismatched_collectives()
"""Whether a backend with ``overlaps_check`` overlaps the default check with the data: only on
an MPI that survives mismatched collectives (elsewhere the check runs before the data)."""


class _Mismatch(Exception):
    """Raised out of a watched data wait (:meth:`Twin.poll`): the check completed and the calls
    differ, so the wait stops and its request is abandoned (``work.waited``)."""


Described = tuple[Callable[..., str], tuple[Any, ...]]
"""A checked call's text, written only on a mismatch: a function and its arguments."""

_RETIRED: list[MPI.Intracomm] = []
"""Data communicators replaced after a divergence: requests abandoned on them may still be
progressed by MPI, so they are never freed."""


def _data_comm(comm: MPI.Intracomm) -> MPI.Intracomm:
    """``comm`` (a fresh duplicate) set to return MPI errors as exceptions: a mismatched data
    call's error (a truncated message) must reach the check's verdict, not abort the job."""
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm


_COUNT = 0xFFFF  # the low 16 bits of a board word: the check's number (mod 2**16) on its twin
_WORD = (1 << 64) - 1
_LINE = 8  # uint64 words per rank on the board: each rank's word on a cache line of its own


class _Board:
    """The check of a group whose ranks share one node, without a collective: a shared-memory
    window (``MPI_Win_allocate_shared``) holding one 64-bit word per rank, each on its own cache
    line. A check posts this rank's word (the fingerprint's low 48 bits above the check's number
    on the twin, mod 2**16: one aligned store, never read torn) and reads the others': a word of
    the same number decides (equal: the same call); the next number means that rank already
    agreed to this one (it saw every word, this rank's too, equal); the previous number means
    that rank has not posted yet. No rank can be two numbers ahead of another (its check waits
    for the other's word), so one word per rank suffices and every rank reads the same words:
    every rank reaches one verdict. A word a rank posts precedes the data call it starts (the
    MPI library's own memory ordering makes it visible before that data is), so after the data
    completes the words of every rank that sent this rank data are there. A waiting check drives
    MPI's whole progress engine (it tests a receive that nothing matches: testing any incomplete
    request does, as comm/progress.py's thread does; ``Iprobe`` does not progress
    collectives): a peer may be waiting for this rank's side of an earlier nonblocking call
    before it reaches its check.

    Why: on one node a check's all-reduce costs about as much as 5 % of a 1 MiB redistribute
    (5 us at 2 ranks), a post and a read cost ~0.3 us (issue 23 item 12). A group across nodes
    keeps the all-reduce, where the data itself takes far longer."""

    __slots__ = ("post", "verdict", "_win", "_comm", "_words", "_me", "_others", "_count", "_mine")

    def __init__(self, comm: MPI.Intracomm) -> None:
        size, rank = comm.Get_size(), comm.Get_rank()
        self._win = MPI.Win.Allocate_shared(8 * _LINE * size if rank == 0 else 0, 8, comm=comm)
        buf, _ = self._win.Shared_query(0)
        self._win.Lock_all()  # one passive epoch for the window's life: loads and stores at will
        self._bind(buf.cast("Q"), _LINE * rank, [_LINE * r for r in range(size) if r != rank], 0, COMPILED)
        self._win.Sync()
        comm.Barrier()  # (at attach, where the twin's communicators are made) every word is set
        self._win.Sync()
        self._comm = comm

    def _bind(self, words: memoryview, me: int, others: list[int], count: int, compiled: bool) -> None:
        """Set this rank's word to "before check ``count``" and take the post and verdict of the
        compiled board (comm/_board.c: the same rules, ~2 us less per check than this Python
        after a 1 MiB copy has evicted the interpreter's caches) or of the Python below."""
        self._words, self._me, self._others = words, me, others  # (a memoryview item costs ~50 ns)
        self._count, self._mine = count, (count - 1) & _COUNT
        words[me] = self._mine
        if compiled:
            board = _CompiledBoard(words, me, others, count, self._mine)
            self.post, self.verdict = board.post, board.verdict
        else:
            self.post, self.verdict = self._post, self._verdict

    @classmethod
    def in_memory(cls, words: memoryview, me: int, others: list[int], count: int, compiled: bool) -> _Board:
        """A board on ``words`` (no window, no group): the rules alone, for their tests."""
        board = cls.__new__(cls)
        board._bind(words, me, others, count, compiled)
        return board

    def _post(self, fp: int) -> None:
        """This rank's word for its next check."""
        count = self._count
        self._count = count + 1
        mine = self._mine = ((fp << 16) | (count & _COUNT)) & _WORD
        self._words[self._me] = mine

    def _verdict(self) -> bool | None:
        """True: every rank posted the same word (or has agreed and moved on); False: some rank
        posted another; None: some rank has not posted yet."""
        words, mine = self._words, self._mine
        number = mine & _COUNT
        pending = False
        for i in self._others:
            word = words[i]
            if word == mine or word & _COUNT == (number + 1) & _COUNT:
                continue
            if word & _COUNT == (number - 1) & _COUNT:
                pending = True
                continue
            return False
        return None if pending else True

    def wait(self) -> bool:
        """Wait (under the deadline) until every rank's word for this check is there, driving
        MPI's progress meanwhile; the verdict. The receive it tests is from this rank on the
        check communicator, which carries no point-to-point message: nothing matches it, and
        it is cancelled when the wait ends."""
        never = self._comm.Irecv(bytearray(1), source=self._comm.Get_rank(), tag=0)

        def posted() -> bool:
            never.Test()
            return self.verdict() is not None

        try:
            wait_until(posted, "the SPMD divergence check (the node's shared-memory board)")
        finally:
            never.Cancel()
            never.Wait()
        return bool(self.verdict())

    def free(self) -> None:
        del self.post, self.verdict  # (the compiled board holds the window's memory: let it go first)
        self._win.Unlock_all()
        self._win.Free()


class Twin:
    """What the divergence check keeps per library communicator: ``comm``, the check twin (a
    ``Dup`` carrying only checks); ``data``, a second ``Dup`` on which the calls the default
    check covers move their data (backends with ``overlaps_check``: :func:`data_group`);
    ``seq``, the count of collectives started on the original communicator; and the check
    itself, one of two forms decided at attach from group-wide facts (so every check on a twin
    takes the same form on every rank): where the group shares one node, a shared-memory board
    (:class:`_Board`); elsewhere one all-reduce of 2 int64 (the least ``fp`` and the least
    ``-fp``) on ``comm``: a persistent one (``MPI_Allreduce_init``, started per check: a third
    of an ``Iallreduce``'s cost) where MPI has them, else an ``Iallreduce`` per check (a
    persistent collective matches only its own starts)."""

    __slots__ = ("comm", "data", "seq", "board", "start", "verdict", "overlapping", "_groups", "_buf",
                 "_request", "_pending")

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm.Dup()
        self.data = _data_comm(comm.Dup())
        self.seq = 0
        self._groups: dict[int | None, Group] = {}
        self.board = _Board(self.comm) if check_form() == "auto" and _one_node(self.comm) else None
        self._buf = np.zeros(4, dtype=np.int64)
        self._request: MPI.Prequest | None = None
        if self.board is None:
            try:
                self._request = self.comm.Allreduce_init(self._buf[:2], self._buf[2:], op=MPI.MIN)
            except (NotImplementedError, MPI.Exception):  # an MPI before 4.0: the same on every rank
                self._request = None
        self._pending: MPI.Request = MPI.REQUEST_NULL
        # (bound once, each a slot: a check calls them directly)
        self.start: Callable[[int], None] = self._start_allreduce if self.board is None else self.board.post
        """Start comparing ``fp`` across the group (every check on the twin starts here)."""
        self.verdict: Callable[[], bool | None] = self._allreduce_verdict if self.board is None else self.board.verdict
        """The started check's verdict if it has completed (every rank's ``fp`` the same or not),
        else None."""
        self.overlapping = 0  # the thread whose data wait a check of this twin overlaps now (overlapped)

    def data_group(self, group: Group) -> Group:
        """``group`` on the data communicator (one ``Group`` per mesh dim, made once)."""
        data = self._groups.get(group.mesh_dim)
        if data is None:
            data = self._groups[group.mesh_dim] = Group(self.data, group.mesh_dim)
        return data

    def _start_allreduce(self, fp: int) -> None:
        buf = self._buf
        buf[0] = fp
        buf[1] = -fp
        if self._request is not None:
            self._request.Start()
            self._pending = self._request
        else:
            self._pending = self.comm.Iallreduce(buf[:2], buf[2:], op=MPI.MIN)

    def _allreduce_verdict(self) -> bool | None:
        if not self._pending.Test():
            return None
        return bool(self._buf.item(2) == -self._buf.item(3))

    def settle(self) -> bool:
        """Wait for the started check (under the deadline; abandoned if it times out) and return
        its verdict."""
        board = self.board
        if board is not None:
            same = board.verdict()
            return board.wait() if same is None else same
        if not self._pending.Test():  # (an overlapped check has mostly completed by now)
            try:
                wait_request(self._pending, "the SPMD divergence check (Allreduce)")
            except BaseException:
                self.abandon()
                raise
        return bool(self._buf.item(2) == -self._buf.item(3))

    def poll(self) -> None:
        """Poll the check overlapping a data wait (:func:`_poll_overlapping`): once it has
        completed, it no longer overlaps, and :class:`_Mismatch` is raised if the calls differ."""
        same = self.verdict()
        if same is not None:
            self.overlapping = 0
            if not same:
                raise _Mismatch

    def abandon(self) -> None:
        """The started check will not complete: MPI may still write into its buffer, which is
        kept for good (``work._ABANDONED``, as a timed-out request's), and later checks on this
        twin use fresh buffers and ``Iallreduce`` (the communicator is unusable after a timeout:
        the others' next check is the persistent one). A board has nothing in flight."""
        if self.board is not None:
            return
        _ABANDONED.append(_InFlight(self._pending, (self._buf,)))
        self._pending = MPI.REQUEST_NULL
        self._request = None
        self._buf = np.zeros(4, dtype=np.int64)

    def renew_data(self) -> None:
        """After a divergence (every rank of the group is here, having seen the same verdict):
        the data communicator may hold abandoned requests and messages no call will receive,
        so it is replaced by a fresh duplicate of the check twin (``MPI_Comm_idup``, under the
        deadline), the old one kept unfreed (:data:`_RETIRED`)."""
        _RETIRED.append(self.data)
        data, request = self.comm.Idup()
        wait_request(request, "the SPMD divergence check (a new data communicator: MPI_Comm_idup)")
        self.data = _data_comm(data)
        self._groups.clear()

    def free(self) -> None:
        del self.start, self.verdict  # (bound to the board's: it lets go of the window's memory next)
        if self.board is not None:
            self.board.free()
        if self._request is not None:
            self._request.Free()
        self.comm.Free()
        self.data.Free()


def _one_node(comm: MPI.Intracomm) -> bool:
    """Whether every rank of ``comm`` shares one node (collective; the same answer on every
    rank: the node split partitions the group)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return bool(node.Get_size() == comm.Get_size())
    finally:
        node.Free()


_TWINS: dict[int, Twin] = {}
"""By ``id`` of the library's communicator object (the mesh holds it, and detaches it at free)."""

class _CallContext(local):
    """This thread's :func:`call_context` (per thread: a loader thread's small collective on
    another mesh, made while the training thread is inside a plan's context on some ranks and
    not on others, would be checked on some ranks only, and its check would pair with a later
    call's or wait out the deadline)."""

    describe: Callable[[], str] | None = None
    every_size = False
    """Whether the calls inside are checked by default whatever their size (the data-parallel
    plans' calls, ``every_size=True``)."""


_here = _CallContext()


def attach(comm: MPI.Intracomm) -> None:
    """Give ``comm`` its check twin and data communicator (collective over ``comm``; a group of
    one needs neither)."""
    if comm != MPI.COMM_NULL and comm.Get_size() > 1:
        _TWINS[id(comm)] = Twin(comm)


def detach(comm: MPI.Intracomm) -> None:
    """Free ``comm``'s twin (collective, where the mesh frees ``comm``), once the issue thread
    has started every call handed to it."""
    issuer.drain()
    twin = _TWINS.pop(id(comm), None)
    if twin is not None:
        issuer.forget(twin)
        twin.free()


def twin_of(comm: MPI.Intracomm) -> Twin | None:
    return _TWINS.get(id(comm))


def _poll_overlapping() -> None:
    """The data waits' watch (``deadline.watch``: polled before each nap, once a wait has spun):
    the check that overlaps this thread's data wait, if one does (:func:`overlapped`), raising
    :class:`_Mismatch` when it found different calls. Another thread's waits (a checkpoint
    save's writer) leave it alone. The twin carries the mark: a store into the twin, which the
    check touches anyway, costs little, where setting and clearing a watch around every data
    call cost ~0.8 us per call once a 1 MiB copy had left the watch's global cold (issue 23
    item 12)."""
    me = get_ident()
    for twin in list(_TWINS.values()):
        if twin.overlapping == me:
            twin.poll()


watch(_poll_overlapping)


@contextmanager
def call_context(describe: Callable[[], str], *, every_size: bool = False) -> Iterator[None]:
    """The collectives started inside carry ``describe()`` in their fingerprint (evaluated only
    when a check runs): what the call means beyond its shapes (a bucket's parameters).

    ``every_size``: the default check covers them whatever their payload, not only from
    :data:`CHECK_FROM`. fully_shard, replicate and ``reduce_gradients`` ask for it: their calls
    are few per step, and ranks whose forwards took different branches (an expert each) make
    calls of equal shapes that only the names tell apart, at any size."""
    here = _here
    outer, outer_size = here.describe, here.every_size
    here.describe, here.every_size = describe, every_size
    try:
        yield
    finally:
        here.describe, here.every_size = outer, outer_size


def current_context() -> str:
    describe = _here.describe
    return "" if describe is None else f" [{describe()}]"


def user_site() -> str:
    """The innermost frame outside dtorch_mpi as ``file:line`` (the file's name only: the same
    program may sit in different directories on different nodes). Debug mode compares it too,
    so a rank skipping a call before an identical one is caught."""
    frame = user_frame()
    if frame is None:
        return "unknown"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


_CODES: dict[str, int] = {}


def code(text: str) -> int:
    """A digest of ``text`` equal on every rank (``hash`` of a string is salted per process),
    cached: the kinds, dtypes, ops and call sites a program uses are few."""
    value = _CODES.get(text)
    if value is None:
        value = _CODES[text] = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        if len(_CODES) > 4096:
            _CODES.clear()
    return value


_CALLS: dict[tuple[Any, ...], int] = {}


def call_digest(call: tuple[Any, ...]) -> int:
    """Call ``call`` (``(kind, group-wide shape, dtype, *facts)``: ints, tuples of ints, digests,
    strings) as one int, equal on every rank for equal parts: the strings (and the dtype's
    ``str``) as :func:`code`, then Python's ``hash`` of the tuple (deterministic for ints and
    tuples of them, on every rank running one interpreter version; the mesh agrees settings).
    Computed once per distinct call and cached (a program makes the same few calls over and
    over; a compiled redistribute step keeps its own: prologue.py)."""
    static = _CALLS.get(call)
    if static is None:
        kind, shape, dtype, *facts = call
        static = hash((code(kind), shape, code(dtype.str), *[code(f) if isinstance(f, str) else f for f in facts]))
        if len(_CALLS) >= 4096:
            _CALLS.clear()
        _CALLS[call] = static
    return static


def fingerprint(seq: int, static: int, context: str, site: str) -> int:
    """The call digested as ``static`` (:func:`call_digest`), made as number ``seq`` on its
    communicator, with the caller's context and (debug mode) call site, as one int64."""
    if context or site:
        return hash((seq, static, code(context), code(site))) >> 1
    return hash((seq, static)) >> 1


_MINE = np.empty(2, dtype=np.int64)
_LOW = np.empty(2, dtype=np.int64)  # a communicator without a twin: waited before the next check


def compare(group: Group, twin: Twin | None, fp: int, describe: Described) -> None:
    """Every rank of ``group`` makes the call fingerprinted ``fp`` (checked on ``twin``, or on
    ``group.comm`` itself for a communicator the library did not build), or every rank raises
    ``SPMDDivergenceError`` naming each rank's call (``describe``, written only then). The
    synchronous check: nothing of the call has moved yet."""
    if twin is not None:
        twin.start(fp)
        if not twin.settle():
            diverged(group, twin.comm, twin, describe)
        return
    _MINE[0] = fp
    _MINE[1] = -fp
    wait_request(group.comm.Iallreduce(_MINE, _LOW, op=MPI.MIN), "the SPMD divergence check (Allreduce)")
    if _LOW[0] != -_LOW[1]:
        diverged(group, group.comm, None, describe)


def overlapped(twin: Twin, group: Group, fp: int, describe: Described, start: Callable[..., Any],
               moves: Group, args: tuple[Any, ...]) -> Any:
    """The default check overlapping a blocking data call: start the check, then the data call
    ``start(moves, *args)`` (``moves``: ``group`` on ``twin.data``; it waits for its request,
    watching the check), then wait for the verdict before returning ``start``'s handle. A
    verdict of different calls while the data is in flight ends the data wait (its request
    abandoned); every rank raises ``SPMDDivergenceError``. No data is returned before every
    rank's fingerprint has been compared."""
    twin.start(fp)
    twin.overlapping = get_ident()  # (this thread's data waits poll the check: _poll_overlapping)
    try:
        handle = start(moves, *args)
    except _Mismatch:  # (no longer overlapping: the poll that raised said so)
        diverged(group, twin.comm, twin, describe)
    except BaseException as exc:
        twin.overlapping = 0
        _failed(twin, group, describe, exc)
    twin.overlapping = 0
    # nearly always decided by now (a board's peers posted before their data)
    if twin.verdict() is not True and not twin.settle():
        diverged(group, twin.comm, twin, describe)
    return handle


def _failed(twin: Twin, group: Group, describe: Described, exc: BaseException) -> NoReturn:
    """The overlapped data call raised ``exc``: the check tells whether the calls differed (a
    mismatched data call may end in an MPI error, a truncated message), raising
    ``SPMDDivergenceError`` then and ``exc`` otherwise. A data wait that timed out (or was
    interrupted) already waited for the check as long as the deadline: one last look, then the
    check is abandoned with it."""
    if isinstance(exc, CollectiveTimeoutError) or not isinstance(exc, Exception):
        same = twin.verdict()
        if same is None:
            twin.abandon()
            raise exc
    else:
        same = twin.settle()
    if not same:
        diverged(group, twin.comm, twin, describe, exc)
    raise exc


def diverged(group: Group, comm: MPI.Intracomm, twin: Twin | None, describe: Described,
             cause: BaseException | None = None) -> NoReturn:
    """The check found different calls (every rank of the group is here): exchange the calls'
    texts and ``twin``'s call counts on ``comm``, give ``twin`` a fresh data communicator, and
    raise. The error's ``resume`` sets the count to the largest, once the program receives the
    error (``issuer.received``): the ranks may have counted different numbers of calls by then
    (a rank that handed the divergent call to the issue thread counted it and the refused calls
    after it; one that checked it inline did not; a divergent program makes what calls it
    makes), and a count left apart would fail every later check."""
    from ..errors import SPMDDivergenceError

    text, args = describe
    seq = -1 if twin is None else twin.seq
    posts = [r.decode(errors="replace").partition(" ") for r in allgather_bytes(comm, f"{seq} {text(*args)}".encode())]
    calls = [call for _, _, call in posts]
    if twin is not None:
        twin.renew_data()
    dim = "" if group.mesh_dim is None else f" along mesh dim {group.mesh_dim}"
    error = SPMDDivergenceError(
        f"SPMD divergence{dim}: the ranks of one group are making different collective calls:\n"
        + "\n".join(f"  group rank {r}: {c}" for r, c in enumerate(calls))
        + "\nEvery rank must run the same sequence of collective operations (#n: the call's number "
        "on its communicator; checked by default from 64 KiB and for the data-parallel plans' calls, every "
        "call with DTORCH_SPMD_DEBUG=1)."
    )
    if twin is not None:
        error.resume = partial(_count_from, twin, max(int(n) for n, _, _ in posts))
    raise error from cause


def _count_from(twin: Twin, seq: int) -> None:
    twin.seq = seq

