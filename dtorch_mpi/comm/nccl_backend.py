"""The NCCL backend (``cupy.cuda.nccl``): communicators per mesh-dim group, nonblocking work
polled under the collective deadline, and the pure wire/layout helpers it needs (unit-tested
without a GPU)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import CollectiveTimeoutError
from .deadline import wait_request
from .group import Group
from .layout import offsets, view3
from .lifetime import CommAttached
from .mpi_backend import _pack_by_destination
from .work import Work

NCCL_TYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
              "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
              "int64": "NCCL_INT64", "uint64": "NCCL_UINT64"}


def nccl_wire(dtype: Any, reducing: bool) -> tuple[np.dtype, int]:
    """``(dtype NCCL moves, elements per original element)``. bool moves as uint8; types NCCL
    lacks move as bytes, or (when reducing) widen: int16 -> int32, complex -> float pairs."""
    dt = np.dtype(dtype)
    if dt.name in NCCL_TYPES:
        return dt, 1
    if dt == np.bool_:
        return np.dtype(np.uint8), 1
    if dt.kind == "c":
        return np.dtype(np.float32 if dt.itemsize == 8 else np.float64), 2
    if reducing:
        return np.dtype(np.int32 if dt.kind == "i" else np.uint32), 1
    return np.dtype(np.uint8), dt.itemsize


def uid_to_bytes(uid: Any) -> bytes:
    """``get_unique_id()`` as 128 bytes (it is a tuple of ints in older CuPy, bytes in newer)."""
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes(int(v) & 0xFF for v in uid)


def uid_from_bytes(raw: bytes, like: Any) -> Any:
    """Back to the form ``NcclCommunicator`` takes (the form ``get_unique_id()`` returned)."""
    if isinstance(like, (bytes, bytearray)):
        return bytes(raw)
    return tuple(b - 256 if b > 127 else b for b in raw)


def padded_plan(sizes: Sequence[int], inner: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Equal-size collective layout: ``(block, [(rank's real count, offset in padded, offset
    in packed)])`` for pieces of ``sizes`` rows of ``inner`` elements (pure; NCCL uses it)."""
    block = max(sizes) * inner if sizes else 0
    return block, [(n * inner, i * block, o * inner) for i, (n, o) in enumerate(zip(sizes, offsets(sizes)))]


_NCCL_CALLS = {"all_gather": "allGather", "all_to_all": "send/recv", "all_reduce": "allReduce",
               "reduce_scatter": "reduceScatter", "broadcast": "bcast", "scatter": "send/recv"}


def _nccl_op(reduce_op: str, dtype: Any) -> Any:
    """The NCCL reduction for ``reduce_op`` on ``dtype`` (bool: any/all as max/min on uint8)."""
    from cupy.cuda import nccl

    if np.dtype(dtype) == np.bool_:
        return nccl.NCCL_MIN if reduce_op == "min" else nccl.NCCL_MAX
    return {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}[reduce_op]


def _averaged(total: Any, m: int, reduce_op: str, dtype: Any) -> Any:
    """``avg``: the sum divided by the group size (floored for integers, as NumPy's ``//``);
    a bool average travels as "any" (``_nccl_op``), which is already the result's truth value."""
    if reduce_op != "avg" or np.dtype(dtype) == np.bool_:
        return total
    return total // m if total.dtype.kind in "iu" else total / m


def _flat_blocks(a: Any, axis: int, sizes: Sequence[int]) -> list[Any]:
    """Block ``j`` (``sizes[j]`` long on ``axis``) of ``a`` as a contiguous 1-d array: a view
    when the blocks are contiguous already (nothing above ``axis``), else a copy."""
    import cupy

    outer, _, inner = view3(a.shape, axis)
    if outer == 1:
        flat = cupy.ascontiguousarray(a).reshape(-1)
        return [flat[o * inner : (o + n) * inner] for n, o in zip(sizes, offsets(sizes))]
    return [cupy.ascontiguousarray(a[(slice(None),) * axis + (slice(o, o + n),)]).reshape(-1)
            for n, o in zip(sizes, offsets(sizes))]


class _EventRequest:
    """A CUDA event as the deadline loop's request (comm/deadline.py): ``Test()`` queries it."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def Test(self) -> bool:
        return bool(self.event.query())


class NCCLWork(Work):
    """NCCL work enqueued on the current stream, completed when the event recorded after it
    has: polled by the MPI backend's deadline loop, so ``DTORCH_COLLECTIVE_TIMEOUT`` holds. A
    wait that times out aborts the NCCL communicator (``ncclCommAbort``, where CuPy has it):
    its kernels then end instead of spinning on the GPU for a peer that never comes."""

    __slots__ = ("_abort",)

    def __init__(self, event: Any, finish: Callable[[], Any], keep: tuple[Any, ...], what: str,
                 abort: Callable[[], None]) -> None:
        super().__init__(_EventRequest(event), finish, keep, what)  # type: ignore[arg-type]
        self._abort = abort

    def wait(self) -> Any:
        try:
            return super().wait()
        except CollectiveTimeoutError:
            self._abort()
            raise


class NCCLBackend:
    """NCCL through ``cupy.cuda.nccl``: one communicator per mesh-dim group (its unique id
    broadcast over MPI), work enqueued on the current stream and nonblocking: an event is
    recorded after the enqueue and the returned :class:`NCCLWork` polls it under the collective
    deadline; unpadding, the NaN restore and an average's division run when it completes.
    ``ncclAllGather`` and ``ncclReduceScatter`` pad uneven blocks to the largest; all-to-all
    and scatter are grouped ``ncclSend``/``ncclRecv`` of each block (no padding, no broadcast
    of the whole array)."""

    name = "nccl"

    def __init__(self) -> None:
        # attached to the group's MPI communicator: released when the mesh frees it, never
        # handed to a new communicator that MPI gives the freed one's handle
        self._comms: CommAttached[Any] = CommAttached("an NCCL communicator", lambda c: c.destroy())

    def call_for(self, kind: str, send: Any, out: Any, facts: dict[str, Any]) -> tuple[str, bool]:
        sizes = facts.get("sizes", ())
        return _NCCL_CALLS[kind], kind in ("all_gather", "reduce_scatter") and len(set(sizes)) > 1

    def _nccl(self, group: Group) -> Any:
        return self._comms.get(group.comm, lambda: self._create(group))

    @staticmethod
    def _create(group: Group) -> Any:
        """A new NCCL communicator over ``group`` (collective: rank 0's unique id is broadcast)."""
        from cupy.cuda import nccl

        uid = nccl.get_unique_id() if group.rank == 0 else None
        raw = np.zeros(128, dtype=np.uint8)
        if group.rank == 0:
            raw[:] = np.frombuffer(uid_to_bytes(uid), dtype=np.uint8)[:128]
        wait_request(group.comm.Ibcast(raw, root=0), "the NCCL communicator set-up (Bcast)")
        like = uid if uid is not None else nccl.get_unique_id()
        return nccl.NcclCommunicator(group.size, uid_from_bytes(raw.tobytes(), like), group.rank)

    @staticmethod
    def _stream() -> int:
        import cupy

        return cupy.cuda.get_current_stream().ptr

    def _started(self, group: Group, kind: str, finish: Callable[[], Any], keep: tuple[Any, ...]) -> NCCLWork:
        """The handle of what was just enqueued: an event recorded after it on the stream; the
        buffers in ``keep`` live until it completes (comm/work.py)."""
        import cupy

        event = cupy.cuda.Event(disable_timing=True)
        event.record(cupy.cuda.get_current_stream())
        comm = self._nccl(group)

        def abort() -> None:
            aborting = getattr(comm, "abort", None)  # CuPy >= 8 with NCCL >= 2.4
            if aborting is not None:
                aborting()

        return NCCLWork(event, finish, keep, f"NCCL {_NCCL_CALLS[kind]} ({kind})", abort)

    @staticmethod
    def _wire(a: Any, reducing: bool) -> tuple[Any, int]:
        from cupy.cuda import nccl

        wire, per = nccl_wire(a.dtype, reducing)
        flat = a.reshape(-1)
        if wire != a.dtype:  # bytes or float pairs are views; a reduction widens by a copy
            flat = flat.view(wire) if per > 1 or not reducing else flat.astype(wire)
        return flat, getattr(nccl, NCCL_TYPES[wire.name])

    @staticmethod
    def _unwire(wire: Any, dtype: Any) -> Any:
        """A reduced wire buffer back in ``dtype`` (complex pairs viewed, widened ints narrowed)."""
        return wire.view(dtype) if np.dtype(dtype).kind == "c" else wire.astype(dtype, copy=False)

    def all_gather(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int], async_op: bool = False) -> Any:
        import cupy

        m = group.size
        outer, length, inner = view3(out.shape, axis)
        block, plan = padded_plan(sizes, inner)
        pad_send = cupy.zeros((outer, block), dtype=out.dtype)
        pad_send[:, : send.size // max(outer, 1)] = cupy.ascontiguousarray(send).reshape(outer, -1)
        pad_out = cupy.empty((m, outer, block), dtype=out.dtype)
        s, st = self._wire(pad_send, False)
        r, _ = self._wire(pad_out, False)
        self._nccl(group).allGather(s.data.ptr, r.data.ptr, s.size, st, self._stream())

        def finish() -> Any:
            dst = out.reshape(outer, length, inner)
            for i, (count, _, _) in enumerate(plan):
                n = count // inner if inner else 0
                o = offsets(sizes)[i]
                dst[:, o : o + n, :] = pad_out[i, :, :count].reshape(outer, n, inner)
            return out

        return self._started(group, "all_gather", finish, (pad_send, pad_out, s, r))

    @staticmethod
    def _nan_mask(wire: Any, reduce_op: str, dtype: Any, count: int) -> tuple[Any, Any] | None:
        """NCCL's max/min drop NaN, NumPy's keep it: ``(send mask, receive mask)`` for a uint8
        max of where ``wire`` is NaN (``count`` results), made before anything is enqueued;
        None when not needed."""
        import cupy

        if reduce_op not in ("max", "min") or np.dtype(dtype).kind != "f":
            return None
        return cupy.isnan(wire).astype(np.uint8), cupy.empty(count, dtype=np.uint8)

    def all_reduce(self, group: Group, send: Any, out: Any, reduce_op: str, async_op: bool = False) -> Any:
        import cupy
        from cupy.cuda import nccl

        m = group.size
        src, code = self._wire(cupy.ascontiguousarray(send), True)
        dst = cupy.empty_like(src)
        nan = self._nan_mask(src, reduce_op, out.dtype, src.size)
        comm, stream = self._nccl(group), self._stream()
        comm.allReduce(src.data.ptr, dst.data.ptr, src.size, code, _nccl_op(reduce_op, out.dtype), stream)
        if nan is not None:
            comm.allReduce(nan[0].data.ptr, nan[1].data.ptr, src.size, nccl.NCCL_UINT8, nccl.NCCL_MAX, stream)

        def finish() -> Any:
            got = dst
            if nan is not None:
                got[nan[1].astype(bool)] = np.nan
            got = _averaged(got, m, reduce_op, out.dtype)
            out[...] = self._unwire(got, out.dtype).reshape(out.shape)
            return out

        return self._started(group, "all_reduce", finish, (src, dst, nan))

    def reduce_scatter(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int],
                       reduce_op: str, async_op: bool = False) -> Any:
        """``ncclReduceScatter`` on blocks padded to the largest (rank order along ``axis``)."""
        import cupy
        from cupy.cuda import nccl

        m, me = group.size, group.rank
        outer, length, inner = view3(send.shape, axis)
        width = max(sizes)
        if outer == 1 and len(set(sizes)) == 1:
            pack = cupy.ascontiguousarray(send).reshape(-1)  # already in destination order
        else:
            src3 = cupy.ascontiguousarray(send).reshape(outer, length, inner)
            pack = _pack_by_destination(src3, sizes, width, out.dtype)
        src, code = self._wire(pack, True)
        count = src.size // m
        dst = cupy.empty(count, dtype=src.dtype)
        nan = self._nan_mask(src, reduce_op, out.dtype, count)
        comm, stream = self._nccl(group), self._stream()
        comm.reduceScatter(src.data.ptr, dst.data.ptr, count, code, _nccl_op(reduce_op, out.dtype), stream)
        if nan is not None:
            comm.reduceScatter(nan[0].data.ptr, nan[1].data.ptr, count, nccl.NCCL_UINT8, nccl.NCCL_MAX, stream)

        def finish() -> Any:
            red = dst
            if nan is not None:
                red[nan[1].astype(bool)] = np.nan
            red = _averaged(red, m, reduce_op, out.dtype)
            got = self._unwire(red, out.dtype).reshape(outer, width, inner)[:, : sizes[me], :]
            out[...] = got.reshape(out.shape)
            return out

        return self._started(group, "reduce_scatter", finish, (pack, src, dst, nan))

    def all_to_all(self, group: Group, send: Any, out: Any, split_axis: int, split_sizes: Sequence[int],
                   concat_axis: int, concat_sizes: Sequence[int], async_op: bool = False) -> Any:
        """Grouped ``ncclSend``/``ncclRecv``: block ``j`` straight to rank ``j``; received
        blocks land in ``out`` directly when they are contiguous there."""
        import cupy
        from cupy.cuda import nccl

        me = group.rank
        sends = _flat_blocks(send, split_axis, split_sizes)
        direct = view3(out.shape, concat_axis)[0] == 1 and out.flags.c_contiguous
        per_row = out.size // max(out.shape[concat_axis], 1)
        recvs = _flat_blocks(out, concat_axis, concat_sizes) if direct else \
            [cupy.empty(n * per_row, dtype=out.dtype) for n in concat_sizes]
        recvs[me][...] = sends[me]  # own block: a device copy, not a message
        comm, stream = self._nccl(group), self._stream()
        nccl.groupStart()
        try:
            for j in range(group.size):
                if j != me and sends[j].size:
                    sb, st = self._wire(sends[j], False)
                    comm.send(sb.data.ptr, sb.size, st, j, stream)
                if j != me and recvs[j].size:
                    rb, rt = self._wire(recvs[j], False)
                    comm.recv(rb.data.ptr, rb.size, rt, j, stream)
        finally:
            nccl.groupEnd()

        def finish() -> Any:
            if not direct:
                for block, n, o in zip(recvs, concat_sizes, offsets(concat_sizes)):
                    shape = list(out.shape)
                    shape[concat_axis] = n
                    out[(slice(None),) * concat_axis + (slice(o, o + n),)] = block.reshape(shape)
            return out

        return self._started(group, "all_to_all", finish, (sends, recvs))

    def broadcast(self, group: Group, buf: Any, root: int, async_op: bool = False) -> Any:
        import cupy

        dense = buf if buf.flags.c_contiguous else cupy.ascontiguousarray(buf)  # NCCL fills memory in order
        flat, t = self._wire(dense, False)
        self._nccl(group).bcast(flat.data.ptr, flat.size, t, root, self._stream())

        def finish() -> Any:
            if dense is not buf:
                buf[...] = dense
            return buf

        return self._started(group, "broadcast", finish, (dense, flat))

    def scatter(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int], root: int,
                async_op: bool = False) -> Any:
        """Grouped ``ncclSend`` of block ``j`` from the root to rank ``j``."""
        import cupy
        from cupy.cuda import nccl

        me = group.rank
        mine = cupy.empty(out.size, dtype=out.dtype)
        comm, stream = self._nccl(group), self._stream()
        if me == root:
            blocks = _flat_blocks(send, axis, sizes)
            mine[...] = blocks[me]
        nccl.groupStart()
        try:
            if me == root:
                for j, block in enumerate(blocks):
                    if j != me and block.size:
                        sb, st = self._wire(block, False)
                        comm.send(sb.data.ptr, sb.size, st, j, stream)
            elif mine.size:
                rb, rt = self._wire(mine, False)
                comm.recv(rb.data.ptr, rb.size, rt, root, stream)
        finally:
            nccl.groupEnd()

        def finish() -> Any:
            out[...] = mine.reshape(out.shape)
            return out

        return self._started(group, "scatter", finish, (mine, send))



__all__ = ["NCCLBackend", "NCCLWork", "nccl_wire", "padded_plan", "uid_from_bytes", "uid_to_bytes"]
