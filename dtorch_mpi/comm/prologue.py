"""The prologue every backend gets for free: ``backend_named`` hands out each registered
backend wrapped in ``Prologued``, so a backend's methods hold only what is its own (the calls
that move the data) and are entered only when something has to move.

Around every collective, in this order (one definition, the same for every backend):
1. A group of one rank moves nothing: ``send`` is copied into ``out``.
2. ``collective_starting()``: pending multi-step redistributes start their queued steps, so
   every rank starts collectives on a communicator in one order.
3. SPMD debug mode (``DTORCH_SPMD_DEBUG=1``): the group checks that every rank makes the same
   call (kind, group-wide shapes and sizes, and the backend's own call for them), raising
   ``SPMDDivergenceError`` instead of hanging.
4. All-empty buffers (a group-wide fact) move nothing.
5. ``counter.record`` once, with the payload bytes of the kind (padding excluded).
6. The backend's method; a blocking call (``async_op=False``) is waited here, so the wait is
   bounded by the collective deadline (``Handle.wait``: ``DTORCH_COLLECTIVE_TIMEOUT``).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import TYPE_CHECKING, Any

import numpy as np

from . import counter
from .config import spmd_debug
from .deadline import wait_request
from .group import Group
from .work import collective_starting, completed

if TYPE_CHECKING:
    from .backend import Backend, Handle

_DEBUG_BYTES = 512
_NO_FACTS: dict[str, Any] = {}  # the hot path builds no description


def check_same_call(group: Group, description: str) -> None:
    """SPMD debug mode: all ranks of ``group`` must be making the same collective call."""
    if group.size == 1:
        return
    mine = np.zeros(_DEBUG_BYTES, dtype=np.uint8)
    raw = description.encode()[:_DEBUG_BYTES]
    mine[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    table = np.empty((group.size, _DEBUG_BYTES), dtype=np.uint8)
    wait_request(group.comm.Iallgather(mine, table), "the SPMD debug check (Allgather)")
    calls = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in table]
    if len(set(calls)) > 1:
        from ..errors import SPMDDivergenceError

        dim = "" if group.mesh_dim is None else f" along mesh dim {group.mesh_dim}"
        raise SPMDDivergenceError(
            f"SPMD divergence{dim}: the ranks of one group are making different collective calls:\n"
            + "\n".join(f"  group rank {r}: {c}" for r, c in enumerate(calls))
            + "\nEvery rank must run the same sequence of collective operations."
        )


def _alone(send: Any, out: Any) -> Handle:
    """A group of one rank: the result is ``send`` itself."""
    if send is not out:
        out[...] = send
    return completed(out)


def _others(shape: Sequence[int], *axes: int) -> int:
    """Elements per unit of the moving axes: the product of every other dim (group-wide)."""
    return prod(n for i, n in enumerate(shape) if i not in axes)


class Prologued:
    """``inner`` with the prologue around each of its six collectives (see the module doc)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name

    def call_for(self, kind: str, send: Any, out: Any, facts: dict[str, Any]) -> tuple[str, bool]:
        return self.inner.call_for(kind, send, out, facts)

    def _check(self, group: Group, kind: str, shared: Any, send: Any, out: Any, facts: dict[str, Any]) -> None:
        """Step 3: the group-wide description of the call, compared across the group."""
        call, _ = self.inner.call_for(kind, send, out, facts)
        shape = "" if shared is None else f"{tuple(shared.shape)}:"
        more = "".join(f", {k}={v}" for k, v in facts.items())
        check_same_call(group, f"{kind}({shape}{out.dtype}{more}, {self.name}={call})")

    def _record(self, group: Group, kind: str, send: Any, out: Any, facts: dict[str, Any],
                sent: int, recv: int, async_op: bool) -> None:
        """Step 5 (only called while a CommCounter is on)."""
        counter.record(kind, group.mesh_dim, sent, recv, self.inner.call_for(kind, send, out, facts)[1], async_op)

    def _enter(self, group: Group, kind: str, shared: Any, send: Any, out: Any, facts: dict[str, Any],
               empty: bool) -> Handle | None:
        """Steps 2-4 (the caller did step 1): the finished handle when nothing moves, else None.
        ``facts`` is :data:`_NO_FACTS` exactly when neither the debug check nor a counter is on
        (the caller read both once)."""
        collective_starting()
        if facts is not _NO_FACTS and spmd_debug():
            self._check(group, kind, shared, send, out, facts)
        return completed(out) if empty else None

    @staticmethod
    def _finish(handle: Handle, async_op: bool) -> Handle:
        if not async_op:
            handle.wait()  # bounded by the collective deadline
        return handle

    def all_gather(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int],
                   async_op: bool = False) -> Handle:
        if group.size == 1:
            return _alone(send, out)
        facts = {"axis": axis, "sizes": tuple(sizes)} if counter._active or spmd_debug() else _NO_FACTS
        if (done := self._enter(group, "all_gather", out, send, out, facts, out.size == 0)) is not None:
            return done
        if counter._active:
            self._record(group, "all_gather", send, out, facts, send.nbytes, out.nbytes - send.nbytes, async_op)
        return self._finish(self.inner.all_gather(group, send, out, axis, sizes, async_op), async_op)

    def all_to_all(self, group: Group, send: Any, out: Any, split_axis: int, split_sizes: Sequence[int],
                   concat_axis: int, concat_sizes: Sequence[int], async_op: bool = False) -> Handle:
        if group.size == 1:
            return _alone(send, out)
        facts = {"split": split_axis, "concat": concat_axis, "split_sizes": tuple(split_sizes),
                 "concat_sizes": tuple(concat_sizes)} if counter._active or spmd_debug() else _NO_FACTS
        # all ranks' blocks empty (a group-wide fact); a non-empty ``send`` already says no
        empty = not send.size and not (sum(split_sizes) and sum(concat_sizes)
                                       and _others(send.shape, split_axis, concat_axis))
        if (done := self._enter(group, "all_to_all", None, send, out, facts, empty)) is not None:
            return done
        if counter._active:
            me = group.rank
            own_send = send.nbytes // max(send.shape[split_axis], 1) * split_sizes[me]
            own_recv = out.nbytes // max(out.shape[concat_axis], 1) * concat_sizes[me]
            self._record(group, "all_to_all", send, out, facts, send.nbytes - own_send, out.nbytes - own_recv,
                         async_op)
        return self._finish(self.inner.all_to_all(group, send, out, split_axis, split_sizes, concat_axis,
                                                  concat_sizes, async_op), async_op)

    def all_reduce(self, group: Group, send: Any, out: Any, reduce_op: str, async_op: bool = False) -> Handle:
        if group.size == 1:
            return _alone(send, out)
        facts = {"op": reduce_op} if counter._active or spmd_debug() else _NO_FACTS
        if (done := self._enter(group, "all_reduce", out, send, out, facts, out.size == 0)) is not None:
            return done
        if counter._active:
            self._record(group, "all_reduce", send, out, facts, send.nbytes, out.nbytes, async_op)
        return self._finish(self.inner.all_reduce(group, send, out, reduce_op, async_op), async_op)

    def reduce_scatter(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int],
                       reduce_op: str, async_op: bool = False) -> Handle:
        if group.size == 1:
            return _alone(send, out)
        facts = {"axis": axis, "op": reduce_op, "sizes": tuple(sizes)} if counter._active or spmd_debug() else _NO_FACTS
        if (done := self._enter(group, "reduce_scatter", send, send, out, facts, send.size == 0)) is not None:
            return done
        if counter._active:
            self._record(group, "reduce_scatter", send, out, facts, send.nbytes - out.nbytes,
                         (group.size - 1) * out.nbytes, async_op)
        return self._finish(self.inner.reduce_scatter(group, send, out, axis, sizes, reduce_op, async_op),
                            async_op)

    def broadcast(self, group: Group, buf: Any, root: int, async_op: bool = False) -> Handle:
        if group.size == 1:
            return completed(buf)
        facts = {"root": root} if counter._active or spmd_debug() else _NO_FACTS
        if (done := self._enter(group, "broadcast", buf, buf, buf, facts, buf.size == 0)) is not None:
            return done
        if counter._active:
            root_here = group.rank == root
            self._record(group, "broadcast", buf, buf, facts,
                         buf.nbytes * (group.size - 1) if root_here else 0, 0 if root_here else buf.nbytes,
                         async_op)
        return self._finish(self.inner.broadcast(group, buf, root, async_op), async_op)

    def scatter(self, group: Group, send: Any | None, out: Any, axis: int, sizes: Sequence[int], root: int,
                async_op: bool = False) -> Handle:
        if group.size == 1:
            return _alone(send, out)
        facts = {"axis": axis, "root": root, "sizes": tuple(sizes)} if counter._active or spmd_debug() else _NO_FACTS
        empty = not (sum(sizes) and _others(out.shape, axis))
        if (done := self._enter(group, "scatter", None, send, out, facts, empty)) is not None:
            return done
        if counter._active:
            root_here = group.rank == root
            self._record(group, "scatter", send, out, facts,
                         send.nbytes - out.nbytes if root_here and send is not None else 0,
                         0 if root_here else out.nbytes, async_op)
        return self._finish(self.inner.scatter(group, send, out, axis, sizes, root, async_op), async_op)

    def exchange(self, group: Group, send: Any, out: Any, layout: Any, async_op: bool = False) -> Handle:
        """Several mesh dims at once over the mesh communicator (redistribute's ``EXCHANGE``;
        ``layout``: traffic.ExchangeLayout). The caller never makes one for an empty tensor."""
        if group.size == 1:
            return _alone(send, out)
        facts = {"blocks": (len(layout.sends), len(layout.recvs))} if counter._active or spmd_debug() else _NO_FACTS
        self._enter(group, "exchange", None, send, out, _NO_FACTS, False)
        if counter._active:
            item = out.dtype.itemsize
            self._record(group, "exchange", send, out, facts,
                         item * sum(prod(b - a for a, b in r) for _, r in layout.sends),
                         item * sum(prod(b - a for a, b in r) for _, r in layout.recvs), async_op)
        return self._finish(self.inner.exchange(group, send, out, layout, async_op), async_op)  # type: ignore[attr-defined]
