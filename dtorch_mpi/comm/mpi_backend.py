"""MPI backend: host buffers moved by mpi4py's buffer (upper-case) collectives.

Pieces split along a tensor axis are described with derived datatypes (vectors, subarrays),
so a gather along an inner axis or an all-to-all writes straight into its output with no
re-layout temporaries. Unequal pieces use the ``v``/``w`` collectives, or, on the padded path
(the one NCCL needs), equal-size collectives with padding added and removed here. The counts,
displacements and per-shape plans come from comm/layout.py (pure), the routes from
comm/routes.py; this module makes the MPI calls, the derived datatypes they use (cached, freed
with ``free_cached_types``) and the NumPy packs and unpacks around them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
from mpi4py import MPI

from ..dtypes import WIDENED, element_type, reduction_type
from . import pool
from .config import comm_path
from .group import Group
from .layout import (
    a2a_layout,
    destination_runs,
    exchange_plan,
    gather_layout,
    gather_v_spec,
    offsets,
    padded_rows,
    padded_runs,
    size_facts,
    view3,
    with_dim,
)
from .reduce_ops import nan_aware_op
from .routes import Route, all_to_all_route
from .work import Done, Work, progress_in_background, reap, waited

_TYPE_CACHE: "OrderedDict[tuple[Any, ...], MPI.Datatype]" = OrderedDict()
_TYPE_CACHE_SIZE = 512


def free_cached_types() -> None:
    """Free every cached datatype (at ``DeviceMesh.free()``; MPI keeps one alive for an operation
    still using it, and the next call makes it again)."""
    while _TYPE_CACHE:
        _TYPE_CACHE.popitem()[1].Free()
    while _W_TYPES:
        for t in _W_TYPES.popitem()[1][1]:
            t.Free()


def _strided_block_type(itemsize: int, outer: int, block: int, stride: int) -> MPI.Datatype:
    """``outer`` runs of ``block`` elements, ``stride`` elements apart, extent one ``block``:
    made and committed once (the cache keeps the last ``_TYPE_CACHE_SIZE``, freeing older ones)."""
    key = (itemsize, outer, block, stride)
    t = _TYPE_CACHE.get(key)
    if t is not None:
        _TYPE_CACHE.move_to_end(key)
        return t
    vec = element_type(itemsize).Create_vector(outer, block, stride)
    t = vec.Create_resized(0, block * itemsize)
    vec.Free()
    t.Commit()
    _TYPE_CACHE[key] = t
    if len(_TYPE_CACHE) > _TYPE_CACHE_SIZE:
        _TYPE_CACHE.popitem(last=False)[1].Free()  # MPI keeps it alive for any operation still using it
    return t


# the routes the backend compares per call, as module globals: reading ``Route.X`` costs
# ~0.15 us on Python 3.11 (an enum member is a descriptor on its class)
_GATHER_EQUAL, _GATHER_PADDED_COMPACT, _GATHER_PADDED_STRIDED, _GATHER_V = (
    Route.GATHER_EQUAL, Route.GATHER_PADDED_COMPACT, Route.GATHER_PADDED_STRIDED, Route.GATHER_V)
_A2A_EQUAL, _A2A_PADDED = Route.A2A_EQUAL, Route.A2A_PADDED

ALLTOALLV_FROM = 1 << 20
"""From this tensor size on (bytes, all ranks' pieces together) an all-to-all uses ``Alltoallv``
with the own block copied by NumPy, not packed, sent to itself and unpacked: 0.6-1.6x a raw
``Alltoall`` into a reused buffer vs 1.3-2.2x with the own block in the call (4-128 MB, 2 and 4
ranks, MPICH 5); below it the equal-block ``Alltoall`` is cheaper per call."""

STRIDED_A2A_BELOW = 32 << 10
"""Below this tensor size (bytes, all ranks' pieces together) an equal-block ``Alltoall`` reads
a non-contiguous send side and writes a non-contiguous output straight through a vector
datatype (cached, ``_strided_block_type``) instead of a NumPy pack and unpack: 0.75-0.95x the
pack + ``Alltoall`` + unpack at 1-25 KB; from 36 KB MPICH 5's datatype engine on the send side
is 2.2-3.3x, on the receive side 0.95-1.3x (2 ranks)."""

def _xp(a: Any) -> Any:
    """The array module of ``a`` (CuPy buffers go to a CUDA-aware MPI as they are)."""
    if type(a) is np.ndarray:
        return np
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def _sync_device(buffers: tuple[Any, ...]) -> None:
    """Finish queued GPU work before MPI reads device memory (mpi4py's DLPack export does not
    synchronise streams)."""
    for b in buffers:
        if type(b) is not np.ndarray and type(b).__module__.startswith("cupy"):
            import cupy

            cupy.cuda.get_current_stream().synchronize()
            return


def _empty(like: Any, shape: Any, dtype: Any) -> Any:
    """A temporary of ``like``'s array module, reused across calls (comm/pool.py)."""
    return pool.empty(_xp(like), shape, dtype)


def _contiguous(a: Any) -> Any:
    return a if a.flags.c_contiguous else _xp(a).ascontiguousarray(a)


def _gather_call(send: Any, out: Any, facts: dict[str, Any], path: str) -> tuple[str, bool]:
    route = gather_layout(path, out.shape, facts["axis"], tuple(facts["sizes"]), out.dtype.itemsize)[3]
    return route.value, route.padded


def _all_to_all_call(send: Any, out: Any, facts: dict[str, Any], path: str) -> tuple[str, bool]:
    route = all_to_all_route(path, send.shape, facts["split"], facts["split_sizes"], facts["concat"],
                             facts["concat_sizes"], out.dtype.itemsize, ALLTOALLV_FROM)
    return route.value, route.padded


def _reduce_scatter_call(send: Any, out: Any, facts: dict[str, Any], path: str) -> tuple[str, bool]:
    block = path == "padded" and len(set(facts["sizes"])) > 1
    return ("Reduce_scatter_block", True) if block else ("Reduce_scatter", False)


_CALLS: dict[str, Callable[[Any, Any, dict[str, Any], str], tuple[str, bool]]] = {
    "all_gather": _gather_call,
    "all_to_all": _all_to_all_call,
    "all_reduce": lambda send, out, facts, path: ("Allreduce", False),
    "reduce_scatter": _reduce_scatter_call,
    "broadcast": lambda send, out, facts, path: ("Bcast", False),
    "scatter": lambda send, out, facts, path: ("Scatter", True) if path == "padded" else ("Scatterv", False),
    "exchange": lambda send, out, facts, path: ("Alltoallv", False),
}


class MPIBackend:
    """Collectives over one mesh dim's communicator on NumPy buffers. Entered through the
    prologue (comm/prologue.py): groups of two or more ranks with something to move."""

    name = "mpi"
    device_buffers = False  # whether MPI is handed GPU memory (CudaAwareMPIBackend)
    overlaps_check = True
    """The default divergence check overlaps this backend's blocking calls, whose data moves on
    the communicator's data twin (comm/divergence.py): a mismatched call's request can be
    abandoned (its buffers kept), and MPI errors come back as exceptions. Backends without it
    (NCCL: a mismatched kernel hangs its stream; device buffers) keep the check before the data."""

    def call_for(self, kind: str, send: Any, out: Any, facts: dict[str, Any]) -> tuple[str, bool]:
        """The MPI call (route) made for a collective and whether it pads (comm/routes.py)."""
        return _CALLS[kind](send, out, facts, comm_path())

    # -- helpers -------------------------------------------------------------------------
    def _run(
        self,
        what: str,
        async_op: bool,
        start: Callable[..., MPI.Request],
        args: tuple[Any, ...],
        finish: Callable[[], Any],
        keep: tuple[Any, ...],
        **kwargs: Any,
    ) -> Work | Done:
        """Start the collective ``start(*args, **kwargs)`` (an mpi4py ``I`` method): a handle
        progressed in the background when ``async_op``, else waited here at once (bounded by the
        collective deadline when it is on). Never MPI's blocking form: the same calls whatever
        the deadline, and polled nonblocking calls are as fast or faster with MPICH (comm/deadline.py).
        (Methods and arguments, not closures: made on every call.)"""
        reap()
        if self.device_buffers:
            _sync_device(keep)
        if async_op:
            work = Work(start(*args, **kwargs), finish, keep, what)
            progress_in_background()
            return work
        return waited(start(*args, **kwargs), finish, keep, what)

    # -- all-gather ----------------------------------------------------------------------
    def all_gather(
        self,
        group: Group,
        send: np.ndarray,
        out: np.ndarray,
        axis: int,
        sizes: Sequence[int],
        async_op: bool = False,
    ) -> Work | Done:
        """Concatenate every rank's ``send`` (``sizes[i]`` long on ``axis``) into ``out``."""
        m = group.size
        item = out.dtype.itemsize
        sizes = tuple(sizes)  # (the same object when a tuple: the layout caches key long ones by identity)
        outer, length, inner, route, offs = gather_layout(comm_path(), out.shape, axis, sizes, item)
        send = _contiguous(send)
        etype = element_type(item)
        comm = group.comm
        if route is _GATHER_EQUAL:
            count = sizes[0] * inner
            return self._run(
                _what("all_gather", group.mesh_dim, group.size),
                async_op,
                comm.Iallgather, ([send, count, etype], [out, count, etype]),
                lambda: out, (send, out),
            )
        if route is _GATHER_PADDED_COMPACT:
            return self._gather_padded_in_place(group, send, out, sizes, inner, async_op)
        if route is _GATHER_PADDED_STRIDED:
            mx = size_facts(sizes)[1]
            pad_send = _xp(out).zeros(with_dim(send.shape, axis, mx), dtype=out.dtype)
            pad_send[tuple(slice(0, n) for n in send.shape)] = send
            pad_out = _empty(out, with_dim(out.shape, axis, m * mx), out.dtype)
            count = outer * mx * inner
            rtype = etype if outer == 1 else _strided_block_type(item, outer, mx * inner, m * mx * inner)
            rcount = count if outer == 1 else 1

            runs = padded_runs(sizes, mx)

            def finish() -> np.ndarray:  # the kept rows, run by run (no loop over ranks)
                src3, out3 = pad_out.reshape(outer, m * mx, inner), out.reshape(outer, length, inner)
                for at, k, n, to in runs:
                    out3[:, to : to + k * n, :] = src3[:, at : at + k * mx, :].reshape(
                        outer, k, mx, inner)[:, :, :n, :].reshape(outer, k * n, inner)
                return out

            return self._run(
                _what("all_gather", group.mesh_dim, group.size),
                async_op,
                comm.Iallgather, ([pad_send, count, etype], [pad_out, rcount, rtype]),
                finish, (pad_send, pad_out, out),
            )
        if route is _GATHER_V:
            spec = [out, gather_v_spec(sizes, inner), etype]
            return self._run(
                _what("all_gather", group.mesh_dim, group.size),
                async_op,
                comm.Iallgatherv, ([send, send.size, etype], spec),
                lambda: out, (send, out),
            )
        # the own block is NumPy's strided copy, the others MPI's datatype engine writes in
        # place (1.0-1.1x a raw contiguous Allgather into a reused buffer at 64-128 MB, 2 and 4
        # ranks; with the own block in the Alltoallw too: 1.4-1.65x)
        me = group.rank
        out.reshape(outer, length, inner)[:, offs[me] : offs[me] + sizes[me], :] = send.reshape(outer, -1, inner)
        sspecs, rspecs, rtypes = _gather_w_specs(item, outer, length, inner, sizes, me, send.size)[0]
        sspec = [send, *sspecs]
        rspec = [out, *rspecs]
        return self._run(
            _what("all_gather", group.mesh_dim, group.size),
            async_op,
            comm.Ialltoallw, (sspec, rspec),
            lambda: out, (send, out, rtypes),
        )

    def _gather_padded_in_place(
        self, group: Group, send: np.ndarray, out: np.ndarray, sizes: Sequence[int], inner: int,
        async_op: bool,
    ) -> Work | Done:
        """Uneven contiguous gather on the equal-size ``Allgather`` (the padded path): gather
        padded blocks into a buffer ``m * max`` long, then slide the short blocks down in place
        (faster than gathering into a temporary and copying out). The result is a view of that buffer (at most ``m`` rows
        longer than ``out``); ``out`` itself is not used."""
        m = group.size
        mx = size_facts(sizes)[1] * inner
        etype = element_type(out.dtype.itemsize)
        buf = _empty(out, m * mx, out.dtype)
        pad_send = _empty(out, mx, out.dtype)
        pad_send[: send.size] = send.reshape(-1)
        comm = group.comm

        width = mx // inner if inner else 0
        host = _xp(out) is np  # NumPy copies overlapping ranges correctly; on a device, gather first

        def finish() -> np.ndarray:  # the kept rows slid down (a few strided copies, no loop over ranks)
            if not inner:
                return out
            rows = buf.reshape(-1, inner)
            if not host:
                keep = padded_rows(sizes, width)
                rows[: len(keep)] = rows[keep]
                return rows[: len(keep)].reshape(out.shape)
            for at, k, n, to in padded_runs(tuple(sizes), width):
                if at != to or (k > 1 and n < width):
                    rows[to : to + k * n] = rows[at : at + k * width].reshape(k, width, inner)[:, :n].reshape(k * n, inner)
            return rows[: out.size // inner].reshape(out.shape)

        return self._run(
            _what("all_gather", group.mesh_dim, group.size),
            async_op,
            comm.Iallgather, ([pad_send, mx, etype], [buf, mx, etype]),
            finish, (pad_send, buf),
        )

    # -- all-to-all ----------------------------------------------------------------------
    def all_to_all(
        self,
        group: Group,
        send: np.ndarray,
        out: np.ndarray,
        split_axis: int,
        split_sizes: Sequence[int],
        concat_axis: int,
        concat_sizes: Sequence[int],
        async_op: bool = False,
    ) -> Work | Done:
        """Block ``j`` of ``send`` along ``split_axis`` goes to rank ``j``; the blocks received
        from rank ``j`` fill block ``j`` of ``out`` along ``concat_axis``."""
        item = out.dtype.itemsize
        lay = a2a_layout(comm_path(), send.shape, out.shape, split_axis, tuple(split_sizes), concat_axis,
                         tuple(concat_sizes), item, ALLTOALLV_FROM, STRIDED_A2A_BELOW, group.size, group.rank)
        send = _contiguous(send)
        etype = element_type(item)
        comm = group.comm
        if lay.own is not None:  # the own block: one NumPy copy, not pack + MPI + unpack
            out[lay.own[1]] = send[lay.own[0]]
        # (``send`` and ``out`` are C-contiguous: MPI reads and writes them in place)
        pack = _empty(out, lay.pack_len, out.dtype) if lay.pack_len is not None else send
        unpack = _empty(out, lay.unpack_len, out.dtype) if lay.unpack_len is not None else out
        if lay.packs:
            _copy_runs(lay.packs, pack, send.reshape(lay.send3), True)

        def finish() -> np.ndarray:
            if lay.unpacks:
                whole = out if out.flags.c_contiguous else _xp(out).empty(out.shape, out.dtype)
                _copy_runs(lay.unpacks, unpack, whole.reshape(lay.recv3), False)
                if whole is not out:
                    out[...] = whole
            return out

        if lay.route is _A2A_PADDED or lay.route is _A2A_EQUAL:
            n = lay.width
            sbuf = [pack, n, etype] if lay.send_vector is None else \
                [send, 1, _strided_block_type(item, *lay.send_vector)]
            rbuf = [unpack, n, etype] if lay.recv_vector is None else \
                [out, 1, _strided_block_type(item, *lay.recv_vector)]
            return self._run(
                _what("all_to_all", group.mesh_dim, group.size),
                async_op,
                comm.Ialltoall, (sbuf, rbuf),
                finish, (pack, unpack, send, out, sbuf, rbuf),
            )
        sspec = [pack, lay.send_spec, etype]
        rspec = [unpack, lay.recv_spec, etype]
        return self._run(
            _what("all_to_all", group.mesh_dim, group.size),
            async_op,
            comm.Ialltoallv, (sspec, rspec),
            finish, (pack, unpack, send, out),
        )

    # -- exchange (several mesh dims at once) ---------------------------------------------
    def exchange(self, group: Group, send: np.ndarray, out: np.ndarray, layout: Any,
                 async_op: bool = False) -> Work | Done:
        """Each rank sends the blocks ``layout.sends`` names to their peers and receives the
        blocks ``layout.recvs`` names (redistribute/traffic.py ``ExchangeLayout``); the own
        block is one NumPy copy. One ``Alltoallv`` over the mesh communicator, counts and
        displacements prepared once per layout (``exchange_plan``)."""
        plan = exchange_plan(layout, group.size)
        send = _contiguous(send)
        etype = element_type(out.dtype.itemsize)
        if plan.own is not None:
            out[plan.own[1]] = send[plan.own[0]]
        pack = _empty(out, plan.pack_len, out.dtype)
        unpack = _empty(out, plan.unpack_len, out.dtype)
        for at, stop, where in plan.packs:
            pack[at:stop] = send[where].reshape(-1)
        unpacks = plan.unpacks

        def finish() -> np.ndarray:
            for at, stop, shape, where in unpacks:
                out[where] = unpack[at:stop].reshape(shape)
            return out

        return self._run(
            _what("exchange", None, group.size),
            async_op,
            group.comm.Ialltoallv, ([pack, plan.send_spec, etype], [unpack, plan.recv_spec, etype]),
            finish, (pack, unpack, send, out),
        )

    # -- reductions ----------------------------------------------------------------------
    def all_reduce(
        self, group: Group, send: np.ndarray, out: np.ndarray, reduce_op: str,
        async_op: bool = False,
    ) -> Work | Done:
        """``out`` = reduction of every rank's ``send`` (``avg`` divides the sum). ``send is out``
        reduces in place (``MPI_IN_PLACE``: no copy of ``send`` into ``out`` when it starts)
        where ``out`` is contiguous and of a dtype MPI reduces as it is."""
        m = group.size
        wide = WIDENED.get(out.dtype)
        in_place = send is out and wide is None and out.flags.c_contiguous
        dst = out if wide is None else _empty(out, out.shape, wide)
        mtype, op = _reduction(dst.dtype, reduce_op, _xp(out) is np)
        comm = group.comm
        sendbuf: Any = MPI.IN_PLACE
        keep: tuple[Any, ...] = (dst, out)
        if not in_place:
            src = _xp(out).ascontiguousarray(send, dtype=wide or out.dtype)
            sendbuf, keep = [src, mtype], (src, dst, out)

        def finish() -> np.ndarray:
            if reduce_op == "avg":
                _divide(dst, m)
            if dst is not out:
                out[...] = dst
            return out

        return self._run(
            _what("all_reduce", group.mesh_dim, group.size),
            async_op,
            comm.Iallreduce, (sendbuf, [dst, mtype]),
            finish, keep, op=op,
        )

    def reduce_scatter(
        self,
        group: Group,
        send: np.ndarray,
        out: np.ndarray,
        axis: int,
        sizes: Sequence[int],
        reduce_op: str,
        async_op: bool = False,
    ) -> Work | Done:
        """Reduce every rank's ``send``; rank ``i`` keeps block ``i`` along ``axis`` in ``out``."""
        m, me = group.size, group.rank
        outer, length, inner = view3(send.shape, axis)
        wide = WIDENED.get(out.dtype)
        dtype = wide or out.dtype
        mtype, op = _reduction(dtype, reduce_op, _xp(out) is np)
        uneven, largest = size_facts(sizes)
        padded = comm_path() == "padded" and uneven
        width = largest if padded else None
        src3 = _contiguous(send).reshape(outer, length, inner)
        if outer == 1 and not padded:
            pack = _xp(out).ascontiguousarray(send, dtype=dtype).reshape(-1)
        else:
            pack = _pack_by_destination(src3, sizes, width, dtype)
        direct = wide is None and not padded and out.flags.c_contiguous
        dst = out if direct else _empty(out, outer * (width or sizes[me]) * inner, dtype)
        comm = group.comm
        counts = gather_v_spec(sizes, outer * inner)[0]

        def finish() -> np.ndarray:
            if reduce_op == "avg":
                _divide(dst, m)
            if dst is not out:
                got = dst.reshape(outer, width or sizes[me], inner)[:, : sizes[me], :]
                out[...] = got.reshape(out.shape)
            return out

        if width is not None:
            count = outer * width * inner
            start: Callable[..., MPI.Request] = comm.Ireduce_scatter_block
            args: tuple[Any, ...] = ([pack, mtype], [dst, count, mtype])
        else:
            start = comm.Ireduce_scatter
            args = ([pack, mtype], [dst, mtype], counts)
        return self._run(_what("reduce_scatter", group.mesh_dim, group.size), async_op, start, args, finish,
                         (pack, dst, out), op=op)

    # -- one-to-all ----------------------------------------------------------------------
    def broadcast(self, group: Group, buf: np.ndarray, root: int, async_op: bool = False) -> Work | Done:
        """Copy ``buf`` from group rank ``root`` to every rank, in place."""
        etype = element_type(buf.dtype.itemsize)
        comm = group.comm
        return self._run(
            _what("broadcast", group.mesh_dim, group.size),
            async_op,
            comm.Ibcast, ([buf, buf.size, etype],),
            lambda: buf, (buf,), root=root,
        )

    def scatter(
        self,
        group: Group,
        send: np.ndarray | None,
        out: np.ndarray,
        axis: int,
        sizes: Sequence[int],
        root: int,
        async_op: bool = False,
    ) -> Work | Done:
        """Rank ``i`` receives block ``i`` along ``axis`` of the root's ``send``."""
        me = group.rank
        item = out.dtype.itemsize
        etype = element_type(item)
        padded = comm_path() == "padded"
        width = size_facts(sizes)[1]
        if me == root:
            assert send is not None
            outer, length, inner = view3(send.shape, axis)
            src3 = _xp(out).ascontiguousarray(send).reshape(outer, length, inner)
            pack = src3.reshape(-1) if outer == 1 and not padded else \
                _pack_by_destination(src3, sizes, width if padded else None, out.dtype)  # blocks in rank order already
        else:
            outer, _, inner = view3(out.shape, axis)
            pack = _xp(out).empty(0, dtype=out.dtype)
        recv = _empty(out, outer * (width if padded else sizes[me]) * inner, out.dtype)
        comm = group.comm

        def finish() -> np.ndarray:
            got = recv.reshape(outer, width if padded else sizes[me], inner)[:, : sizes[me], :]
            out[...] = got.reshape(out.shape)
            return out

        if padded:
            count = outer * width * inner
            start: Callable[..., MPI.Request] = comm.Iscatter
            args: tuple[Any, ...] = ([pack, count, etype], [recv, count, etype])
        else:
            sspec = [pack, gather_v_spec(sizes, outer * inner), etype]
            start = comm.Iscatterv
            args = (sspec, [recv, recv.size, etype])
        return self._run(_what("scatter", group.mesh_dim, group.size), async_op, start, args, finish,
                         (pack, recv, out), root=root)


@lru_cache(maxsize=256)
def _what(kind: str, mesh_dim: int | None, size: int) -> str:
    """The collective's name in a timeout error, made once per (kind, mesh dim, size)."""
    dim = "" if mesh_dim is None else f" along mesh dim {mesh_dim}"
    return f"{kind}{dim} ({size} ranks)"


def _pack_by_destination(src3: Any, sizes: Sequence[int], width: int | None, dtype: Any) -> Any:
    """Copy the ``(outer, length, inner)`` source into one buffer ordered by destination rank:
    rank ``i``'s ``sizes[i]`` rows, each block ``width`` rows long (zero-padded) when given."""
    outer, _, inner = src3.shape
    runs, total = destination_runs(tuple(sizes), outer * inner, width)
    xp = _xp(src3)
    pack = xp.zeros(total, dtype=dtype) if width else pool.empty(xp, total, dtype)
    _copy_runs(runs, pack, src3, True, rows_padded=width is not None)
    return pack


@lru_cache(maxsize=256)
def _reduction(dtype: np.dtype, reduce_op: str, host: bool) -> tuple[MPI.Datatype, MPI.Op]:
    """The MPI datatype and op reducing ``dtype`` by ``reduce_op`` (made once per triple)."""
    return reduction_type(dtype), nan_aware_op(dtype, reduce_op, host)


_W_TYPES: "OrderedDict[tuple[Any, ...], tuple[Any, list[MPI.Datatype]]]" = OrderedDict()


def _gather_w_specs(item: int, outer: int, length: int, inner: int, sizes: tuple[int, ...], me: int,
                    send_size: int) -> tuple[Any, list[MPI.Datatype]]:
    """The ``Alltoallw`` specs of an all-gather along an inner axis, made once per layout:
    ``((send (counts, displs), types), (recv (counts, displs), types))`` and the datatypes it
    owns (freed with the entry; MPI keeps one alive for an operation still using it)."""
    key = (item, outer, length, inner, id(sizes) if len(sizes) > 16 else sizes, me, send_size)
    hit = _W_TYPES.get(key)
    if hit is not None:  # (a long ``sizes`` by id: the entry keeps it alive)
        return hit[0][:3], hit[1]
    m = len(sizes)
    etype = element_type(item)
    strided = outer > 1
    owned: dict[int, MPI.Datatype] = {}

    def block_type(n: int) -> MPI.Datatype:
        t = owned.get(n)
        if t is None:
            vec = etype.Create_vector(outer, n * inner, length * inner)
            t = owned[n] = vec.Create_resized(0, n * inner * item)
            vec.Free()
            t.Commit()
        return t

    rtypes = [block_type(n) if strided and n and i != me else etype for i, n in enumerate(sizes)]
    rcounts = [0 if i == me else 1 if strided and n else n * inner for i, n in enumerate(sizes)]
    rdispls = [o * inner * item for o in offsets(sizes)]
    sspec = (([0 if i == me else send_size for i in range(m)], [0] * m), [etype] * m)
    specs = (sspec, ((rcounts, rdispls), rtypes), rtypes, sizes)
    _W_TYPES[key] = (specs, list(owned.values()))
    if len(_W_TYPES) > 64:
        for t in _W_TYPES.popitem(last=False)[1][1]:
            t.Free()
    return specs[:3], list(owned.values())


_RUN_AS = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
"""A run of this many bytes copied as one unsigned integer: NumPy's strided copy costs per run,
so a (2, 2P) float32 piece's S0 -> S1 pack (P runs of 2 elements per row) took 58 us at
P = 4,096 element by element and 24 us as uint64s."""


def _copy_runs(runs: tuple[tuple[int, int, int, int, int], ...], flat: Any, view3: Any, packing: bool,
               rows_padded: bool = False) -> None:
    """Copy between ``view3`` (rows, axis, inner) and the by-destination buffer ``flat``: each
    block contiguous at its slot's start, or with ``rows_padded`` each of its rows padded to
    the slot's width (``_pack_by_destination``'s layout)."""
    rows, _, inner = view3.shape
    if not rows or not inner:
        return
    item = view3.dtype.itemsize
    for at, k, n, o, stride in runs:
        wide = _RUN_AS.get(n * inner * item) if n * inner > 1 and not rows_padded else None
        if wide is not None and flat.dtype == view3.dtype and view3.flags.c_contiguous and _xp(flat) is np:
            # each run one wider element (not where the buffer is of another dtype: a widened
            # reduction casts as it copies; ``view3`` C-ordered, so the merged view is no copy)
            slots2 = flat[at : at + k * stride].reshape(k, stride)[:, : rows * n * inner].view(wide)
            blocks2 = view3[:, o : o + k * n, :].reshape(rows, k * n * inner).view(wide).T
            if packing:
                slots2[...] = blocks2
            else:
                blocks2[...] = slots2
            continue
        if rows_padded:
            slots = flat[at : at + k * stride].reshape(k, rows, stride // (rows * inner), inner)[:, :, :n, :]
        else:
            slots = flat[at : at + k * stride].reshape(k, stride)[:, : rows * n * inner].reshape(k, rows, n, inner)
        blocks = view3[:, o : o + k * n, :].reshape(rows, k, n, inner).transpose(1, 0, 2, 3)
        if packing:
            slots[...] = blocks
        else:
            blocks[...] = slots


def _divide(buf: np.ndarray, m: int) -> None:
    if buf.dtype.kind in "iu":
        np.floor_divide(buf, m, out=buf)
    elif buf.dtype.kind != "b":
        np.divide(buf, m, out=buf)
