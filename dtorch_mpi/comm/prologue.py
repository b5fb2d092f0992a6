"""The prologue every backend gets for free: ``backend_named`` hands out each registered
backend wrapped in ``Prologued``, so a backend's methods hold only what is its own (the calls
that move the data) and are entered only when something has to move.

Around every collective, in this order (one definition, the same for every backend):
1. A group of one rank moves nothing: ``send`` is copied into ``out``.
2. ``collective_starting()``: pending multi-step redistributes start their queued steps, so
   every rank starts collectives on a communicator in one order.
3. The divergence check (comm/divergence.py): by default when the call's group-wide payload
   (the whole tensor's bytes, from facts every rank making the same call shares) is 64 KiB or
   more or the call is made inside ``call_context(..., every_size=True)`` (fully_shard's,
   replicate's and ``reduce_gradients``' calls), before every call in SPMD debug mode
   (``DTORCH_SPMD_DEBUG=1``): the group compares the call (its number on the communicator,
   kind, group-wide shape, dtype, sizes, op, the backend's own call for them, the caller's
   context), raising ``SPMDDivergenceError`` on every
   rank instead of returning data of different calls. A call the default check covers moves
   its data on the communicator's data twin when the backend ``overlaps_check``, and if it is
   blocking and not in place (outside debug mode) the check overlaps its data: started here,
   its verdict waited for after step 6's wait (which watches it), before anything is returned.
4. All-empty buffers (a group-wide fact) move nothing; any other call is counted on its
   communicator (the number step 3 compares).
5. ``counter.record`` once, with the payload bytes of the kind (padding excluded).
6. The backend's method; a blocking call (``async_op=False``) is waited here, so the wait is
   bounded by the collective deadline (``Handle.wait``: ``DTORCH_COLLECTIVE_TIMEOUT``).

A nonblocking call the default check covers, made inside ``issuer.deferred()`` (fully_shard's
and replicate's overlap paths) with a backend that ``overlaps_check``, is numbered,
fingerprinted and counted here in program order, and its check and step 6 run on the issue
thread (comm/issuer.py); every other call first waits until that thread has started everything
handed to it, so the calls on each communicator keep one order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod
from typing import TYPE_CHECKING, Any

from ..errors import SPMDDivergenceError
from . import counter, divergence, issuer
from .config import spmd_check, spmd_debug
from .divergence import (
    _TWINS,
    CHECK_FROM,
    OVERLAP,
    Described,
    Twin,
    call_digest,
    compare,
    current_context,
    fingerprint,
    overlapped,
    user_site,
)
from .group import Group
from .layout import by_identity
from .work import collective_starting, completed

if TYPE_CHECKING:
    from .backend import Backend, Handle

_NO_FACTS: dict[str, Any] = {}  # the hot path builds no description


def _alone(send: Any, out: Any) -> Handle:
    """A group of one rank: the result is ``send`` itself."""
    if send is not out:
        out[...] = send
    return completed(out)


@by_identity(256)
def _total(sizes: Sequence[int]) -> int:
    """``sum(sizes)``, cached (a plan's sizes are one tuple object per call, and summing every
    rank's entry is O(ranks): 27 µs per call at 4,096 ranks)."""
    return sum(sizes)


@by_identity(256)
def _digest(sizes: tuple[int, ...]) -> int:
    return hash(sizes)  # ints hash alike in every process (no per-process salt)


def _long_digest(value: Any) -> Any:
    """A fact as the fingerprint takes it: a long tuple (every rank's sizes) as its cached hash,
    so a checked call does not hash O(ranks) integers each time."""
    return _digest(value) if type(value) is tuple and len(value) > 16 else value


def _others(shape: Sequence[int], *axes: int) -> int:
    """Elements per unit of the moving axes: the product of every other dim (group-wide)."""
    return prod(n for i, n in enumerate(shape) if i not in axes)


def _with(shape: Sequence[int], axis: int, n: int) -> tuple[int, ...]:
    """``shape`` with ``n`` at ``axis`` (a list edit: a generator over the dims cost 0.8 us of
    a checked all-to-all's 2.3 us of Python)."""
    dims = list(shape)
    dims[axis] = n
    return tuple(dims)


def _wants_facts(nbytes: int) -> bool:
    """Whether the call's description may be needed: a counter, debug mode, or the default
    check's size or context (its on/off switch is read only then)."""
    return bool(counter._active) or nbytes >= CHECK_FROM or divergence._here.every_size or spmd_debug()


def _all_to_all_traffic(group: Group, send: Any, out: Any, split_axis: int, split_sizes: Sequence[int],
                        concat_axis: int, concat_sizes: Sequence[int], async_op: bool) -> tuple[int, int]:
    """Every block but this rank's own: its own block neither leaves nor arrives."""
    me = group.rank
    own_send = send.nbytes // max(send.shape[split_axis], 1) * split_sizes[me]
    own_recv = out.nbytes // max(out.shape[concat_axis], 1) * concat_sizes[me]
    return send.nbytes - own_send, out.nbytes - own_recv


def _exchange_traffic(group: Group, send: Any, out: Any, layout: Any, async_op: bool) -> tuple[int, int]:
    """The blocks of ``layout`` (traffic.ExchangeLayout) this rank sends and receives."""
    item = out.dtype.itemsize
    return (item * sum(prod(b - a for a, b in r) for _, r in layout.sends),
            item * sum(prod(b - a for a, b in r) for _, r in layout.recvs))


# Step 5: the payload bytes (sent, received) on this rank, per kind, from the backend method's
# own arguments (``group, send, out, ..., async_op``; a broadcast's ``group, buf, root, async_op``).
_TRAFFIC: dict[str, Callable[..., tuple[int, int]]] = {
    "all_gather": lambda group, send, out, *_: (send.nbytes, out.nbytes - send.nbytes),
    "all_to_all": _all_to_all_traffic,
    "all_reduce": lambda group, send, out, *_: (send.nbytes, out.nbytes),
    "reduce_scatter": lambda group, send, out, *_: (send.nbytes - out.nbytes, (group.size - 1) * out.nbytes),
    "broadcast": lambda group, buf, root, _: (
        (buf.nbytes * (group.size - 1), 0) if group.rank == root else (0, buf.nbytes)),
    "scatter": lambda group, send, out, axis, sizes, root, _: (
        (send.nbytes - out.nbytes if send is not None else 0, 0) if group.rank == root else (0, out.nbytes)),
    "exchange": _exchange_traffic,
}


def _checked_start(group: Group, twin: Twin, fp: int, describe: Described, start: Callable[..., Handle],
                   args: tuple[Any, ...], stamp: int) -> Handle:
    """On the issue thread: the check, then the data, on the twin's data communicator as it is
    now (a divergence found by an earlier check replaces it); a call numbered after a divergent
    one, before the program received its error, is refused (issuer.refusal)."""
    refused = issuer.refusal(twin, stamp)
    if refused is not None:
        raise refused
    try:
        compare(group, twin, fp, describe)
    except SPMDDivergenceError as exc:
        issuer.found(twin, stamp, exc)
        raise
    return start(twin.data_group(group), *args)


class Prologued:
    """``inner`` with the prologue around each of its six collectives (see the module doc)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self.overlaps = bool(getattr(inner, "overlaps_check", False)) and OVERLAP

    def call_for(self, kind: str, send: Any, out: Any, facts: dict[str, Any]) -> tuple[str, bool]:
        return self.inner.call_for(kind, send, out, facts)

    def _fingerprint(self, group: Group, twin: Twin | None, kind: str, shape: Callable[[], tuple[int, ...]],
                     send: Any, out: Any, facts: dict[str, Any], debug: bool,
                     digest: list[int | None] | None) -> tuple[int, Described]:
        """Step 3's fingerprint of the call, and how to write its text (only on a mismatch: a
        function and its arguments, not a closure, whose cells every checked call would pay).
        ``digest``: a compiled redistribute step's cell for its call's digest (the step makes
        the same call every time: its group, arguments, shapes and dtype are fixed when it
        compiles), filled at its first check; None: digested from the arguments, through
        :func:`call_digest`'s cache."""
        seq = -1 if twin is None else twin.seq
        context = current_context()
        site = user_site() if debug else ""
        static = None if digest is None else digest[0]
        if static is None:
            if group.size <= 16:  # every size tuple is one entry per rank: short, hashed as it is
                call = (kind, shape(), out.dtype, *facts.values())
            else:
                call = (kind, shape(), out.dtype, *map(_long_digest, facts.values()))
            static = call_digest(call)
            if digest is not None:
                digest[0] = static
        return fingerprint(seq, static, context, site), (self._describe, (kind, shape, send, out, facts, seq, context, site))

    def _describe(self, kind: str, shape: Callable[[], tuple[int, ...]], send: Any, out: Any,
                  facts: dict[str, Any], seq: int, context: str, site: str) -> str:
        """A checked call's text, as the divergence error shows each rank's (``seq`` -1: a
        communicator without a twin, whose calls are not numbered)."""
        name, _ = self.inner.call_for(kind, send, out, facts)
        more = "".join(f", {k}={v}" for k, v in facts.items())
        number = "" if seq < 0 else f" #{seq}"
        at = f" at {site}" if site else ""
        return f"{kind}({shape()}:{out.dtype}{more}, {self.name}={name}){number}{context}{at}"

    def _record(self, kind: str, group: Group, send: Any, out: Any, facts: dict[str, Any], async_op: bool,
                args: tuple[Any, ...]) -> None:
        """Step 5 (a counter is on)."""
        sent, recv = _TRAFFIC[kind](group, *args)
        counter.record(kind, group.mesh_dim, sent, recv, self.inner.call_for(kind, send, out, facts)[1], async_op)

    def _run(self, group: Group, kind: str, shape: Callable[[], tuple[int, ...]], send: Any, out: Any,
             facts: dict[str, Any], empty: bool, nbytes: int, async_op: bool, digest: list[int | None] | None,
             start: Callable[..., Handle], *args: Any) -> Handle:
        """Steps 2-6 (the caller did step 1): ``start(group, *args)`` is the backend's method with
        the call's arguments. ``facts`` is :data:`_NO_FACTS` exactly when neither a check nor a
        counter can be on (:func:`_wants_facts`); ``shape()`` and ``nbytes`` are the call's
        group-wide shape and payload bytes.

        A call the default check covers (64 KiB or more, or inside an ``every_size`` context,
        on a communicator with a twin) moves its data on the twin's data communicator when the
        backend ``overlaps_check`` (a function of group-wide facts: the same on every rank for
        the same call), and the check overlaps the data when the call is blocking and writes no
        caller's buffer in place (``send is out``: broadcast); otherwise, and in debug mode, the
        check runs before the data starts. Only a call of 64 KiB or more is handed to the issue
        thread.

        A call that cannot be checked (no twin, debug mode off) runs the same lines whatever its
        size (tests/test_scale_percall.py counts them at 64 and 4,096 ranks)."""
        collective_starting()
        twin = _TWINS.get(id(group.comm))
        moves = group  # the group the data moves on
        overlap = False
        if facts is not _NO_FACTS and (twin is not None or spmd_debug()):
            debug = twin is None or spmd_debug()  # (no twin: here only in debug mode)
            default = twin is not None and (nbytes >= CHECK_FROM or divergence._here.every_size) and spmd_check()
            if default or debug:
                # (a call checked only for its context stays here: a small call's check and start
                # cost less than the issue thread's wake-up, +4 ms a step of 48 such calls)
                defer = (async_op and default and nbytes >= CHECK_FROM and self.overlaps and not (debug or empty)
                         and issuer.deferring())
                if issuer._outstanding and not defer:  # (after every call handed to the issue thread)
                    issuer.drain()
                if twin is not None and issuer._refusing and not defer:  # (one handed over: the thread
                    refused = issuer.refusal(twin, issuer.epoch)  # refuses it in order, counted alike)
                    if refused is not None:  # after a divergent handed-over call (issuer.refusal)
                        twin.seq += 1
                        if async_op:
                            return issuer.refused(refused)
                        issuer.received(refused)
                        raise refused
                if default and self.overlaps:
                    assert twin is not None
                    moves = twin.data_group(group)
                    overlap = not (debug or async_op or send is out)
                if digest is not None and digest[0] is not None and not debug and divergence._here.describe is None:
                    # a compiled step's call outside debug mode and any context (the hot path:
                    # fingerprint(seq, digest, "", "") without the calls; a test holds them equal)
                    assert twin is not None
                    seq = twin.seq
                    fp = hash((seq, digest[0])) >> 1
                    describe = (self._describe, (kind, shape, send, out, facts, seq, "", ""))
                else:
                    fp, describe = self._fingerprint(group, twin, kind, shape, send, out, facts, debug, digest)
                if defer:
                    assert twin is not None
                    return self._defer(group, twin, kind, send, out, facts, fp, describe, start, args)
                if not overlap:
                    try:
                        compare(group, twin, fp, describe)
                    except SPMDDivergenceError as exc:
                        issuer.received(exc)  # (raised at the call: the program has it now)
                        raise
        if empty:
            return completed(out)
        if twin is not None and not overlap:
            twin.seq += 1
        if counter._active:
            self._record(kind, group, send, out, facts, async_op, args)
        if overlap:  # the check overlaps the data, whose handle comes back finished (blocking)
            assert twin is not None
            try:
                handle = overlapped(twin, group, fp, describe, start, moves, args)
            except SPMDDivergenceError as exc:
                issuer.received(exc)
                raise
            twin.seq += 1
        else:
            handle = start(moves, *args)
        if counter.on_started is not None:  # a trace is on (dtorch_mpi/timeline.py)
            handle = counter.on_started(handle, async_op)
        if not async_op:
            handle.wait()  # bounded by the collective deadline
        return handle

    def _defer(self, group: Group, twin: Twin, kind: str, send: Any, out: Any, facts: dict[str, Any], fp: int,
               describe: Described, start: Callable[..., Handle], args: tuple[Any, ...]) -> Handle:
        """Steps 3-6 of a nonblocking checked call handed to the issue thread (comm/issuer.py):
        numbered, fingerprinted and counted here, in program order; checked and started there."""
        twin.seq += 1
        if counter._active:
            self._record(kind, group, send, out, facts, True, args)
        handle: Handle = issuer.submit(_checked_start, group, twin, fp, describe, start, args, issuer.epoch)
        if counter.on_started is not None:
            handle = counter.on_started(handle, True)
        return handle

    def all_gather(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int],
                   async_op: bool = False, *, digest: list[int | None] | None = None) -> Handle:
        if group.size == 1:
            return _alone(send, out)
        nbytes = out.nbytes
        facts = {"axis": axis, "sizes": tuple(sizes)} if _wants_facts(nbytes) else _NO_FACTS
        return self._run(group, "all_gather", lambda: out.shape, send, out, facts, out.size == 0, nbytes,
                         async_op, digest, self.inner.all_gather, send, out, axis, sizes, async_op)

    def all_to_all(self, group: Group, send: Any, out: Any, split_axis: int, split_sizes: Sequence[int],
                   concat_axis: int, concat_sizes: Sequence[int], async_op: bool = False, *,
                   digest: list[int | None] | None = None) -> Handle:
        if group.size == 1:
            return _alone(send, out)
        rows = send.shape[concat_axis]  # this rank's concat_sizes entry
        total = _total(concat_sizes)
        nbytes = (send.nbytes // rows * total if rows else
                  out.itemsize * _total(split_sizes) * total * _others(send.shape, split_axis, concat_axis))
        facts = {"split": split_axis, "concat": concat_axis, "split_sizes": tuple(split_sizes),
                 "concat_sizes": tuple(concat_sizes)} if _wants_facts(nbytes) else _NO_FACTS
        # all ranks' blocks empty (a group-wide fact); a non-empty ``send`` already says no
        empty = not send.size and not nbytes
        return self._run(group, "all_to_all", lambda: _with(send.shape, concat_axis, total), send, out,
                         facts, empty, nbytes, async_op, digest, self.inner.all_to_all,
                         send, out, split_axis, split_sizes, concat_axis, concat_sizes, async_op)

    def all_reduce(self, group: Group, send: Any, out: Any, reduce_op: str, async_op: bool = False, *,
                   digest: list[int | None] | None = None) -> Handle:
        if group.size == 1:
            return _alone(send, out)
        nbytes = out.nbytes
        facts = {"op": reduce_op} if _wants_facts(nbytes) else _NO_FACTS
        return self._run(group, "all_reduce", lambda: out.shape, send, out, facts, out.size == 0, nbytes,
                         async_op, digest, self.inner.all_reduce, send, out, reduce_op, async_op)

    def reduce_scatter(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int],
                       reduce_op: str, async_op: bool = False, *,
                       digest: list[int | None] | None = None) -> Handle:
        if group.size == 1:
            return _alone(send, out)
        nbytes = send.nbytes
        facts = {"axis": axis, "op": reduce_op, "sizes": tuple(sizes)} if _wants_facts(nbytes) else _NO_FACTS
        return self._run(group, "reduce_scatter", lambda: send.shape, send, out, facts, send.size == 0, nbytes,
                         async_op, digest, self.inner.reduce_scatter, send, out, axis, sizes, reduce_op, async_op)

    def broadcast(self, group: Group, buf: Any, root: int, async_op: bool = False) -> Handle:
        if group.size == 1:
            return completed(buf)
        nbytes = buf.nbytes
        facts = {"root": root} if _wants_facts(nbytes) else _NO_FACTS
        return self._run(group, "broadcast", lambda: buf.shape, buf, buf, facts, buf.size == 0, nbytes,
                         async_op, None, self.inner.broadcast, buf, root, async_op)

    def scatter(self, group: Group, send: Any | None, out: Any, axis: int, sizes: Sequence[int], root: int,
                async_op: bool = False) -> Handle:
        if group.size == 1:
            return _alone(send, out)
        nbytes = out.itemsize * _total(sizes) * _others(out.shape, axis)
        facts = {"axis": axis, "root": root, "sizes": tuple(sizes)} if _wants_facts(nbytes) else _NO_FACTS
        return self._run(group, "scatter", lambda: _with(out.shape, axis, _total(sizes)), send, out, facts,
                         not nbytes, nbytes, async_op, None, self.inner.scatter, send, out, axis, sizes, root, async_op)

    def exchange(self, group: Group, send: Any, out: Any, layout: Any, shared: tuple[Any, ...] = (),
                 async_op: bool = False, *, digest: list[int | None] | None = None) -> Handle:
        """Several mesh dims at once over the mesh communicator (redistribute's ``EXCHANGE``;
        ``layout``: traffic.ExchangeLayout, this rank's blocks; ``shared``: what every rank of
        the call shares, ``(global shape, source placements, target placements)``, which the
        divergence check fingerprints: the block counts differ per rank by design). The caller
        never makes one for an empty tensor."""
        if group.size == 1:
            return _alone(send, out)
        shape = tuple(shared[0]) if shared else tuple(out.shape)
        nbytes = out.itemsize * prod(shape)
        facts = ({"src": shared[1], "dst": shared[2]} if shared else {}) if _wants_facts(nbytes) else _NO_FACTS
        return self._run(group, "exchange", lambda: shape, send, out, facts, False, nbytes,
                         async_op, digest, self.inner.exchange, send, out, layout, async_op)  # type: ignore[attr-defined]
