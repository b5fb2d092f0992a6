"""EMULATED DEVICE (test double): ``cupy.cuda.nccl`` implemented over MPI with NCCL's
documented semantics, so the library's NCCL backend runs where no GPU is. Not NCCL: nothing
run on it is "verified on GPU".

- ``get_unique_id()`` makes an id naming its creator (it must be a member of the communicator,
  as the library's set-up always has); ``NcclCommunicator(ndev, uid, rank)`` is collective over
  the ``ndev`` members, which meet at the creator (MPI point-to-point) and refuse, on every
  member, a size that differs between them, a rank given twice, or two ranks on one device
  (``ncclInvalidUsage``).
- Collectives (``allReduce``, ``reduceScatter``, ``allGather``, ``bcast``, ``broadcast``,
  ``reduce``) and ``send``/``recv`` are queued on the given stream (by its pointer) and return
  at once; they run as MPI nonblocking operations, in stream order, and complete when the
  stream or an event recorded on it is queried or synchronized. Inside ``groupStart()`` /
  ``groupEnd()`` they are held and start at ``groupEnd``.
- Every collective first compares its call across the ranks (one small all-gather on a
  communicator of its own): a different count, type, op or root raises ``NcclError`` on every
  rank, where real NCCL would hang or corrupt memory. ``send``/``recv`` counts must match.
- Buffers are pointers (``.data.ptr``) resolved to the emulated allocations behind them (an
  unknown pointer or a count past the allocation raises); only NCCL's data types are taken.
- ``max``/``min`` on floating types drop NaN (``fmax``/``fmin``), as NCCL's may: the library
  must restore NumPy's NaN-propagating result itself.
- ``abort()`` (ncclCommAbort) ends the communicator: its pending operations stop counting as
  pending (their MPI requests are kept, never freed) and it takes no new ones.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from typing import Any

import numpy as np
from mpi4py import MPI

from . import current_device_id, memory, stream_at, wait_until

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_CHAR, NCCL_INT, NCCL_HALF, NCCL_FLOAT, NCCL_DOUBLE = NCCL_INT8, NCCL_INT32, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

_DTYPES = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_UINT32: np.uint32,
           NCCL_INT64: np.int64, NCCL_UINT64: np.uint64, NCCL_FLOAT16: np.float16,
           NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
_OPS = {NCCL_SUM: "sum", NCCL_PROD: "prod", NCCL_MAX: "max", NCCL_MIN: "min", NCCL_AVG: "avg"}
_KINDS = ("allReduce", "reduceScatter", "allGather", "bcast", "broadcast", "reduce")
_WORLD = MPI.COMM_WORLD
_TAG_BASE = 0x6E00  # the set-up's point-to-point tags on COMM_WORLD


class NcclError(RuntimeError):
    def __init__(self, status: int, msg: str) -> None:
        self.status = status
        super().__init__(f"emulated NCCL: {msg}")


NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE = 4, 5


def get_version() -> int:
    return 21805


_serial = 0


def get_unique_id() -> tuple[int, ...]:
    """128 signed bytes (the tuple form older CuPy returns): the creator's world rank, a serial."""
    global _serial
    _serial += 1
    head = np.array([_WORLD.Get_rank(), _serial, os.getpid()], dtype=np.int64).view(np.uint8)
    raw = np.zeros(128, dtype=np.uint8)
    raw[: head.size] = head
    raw[head.size :] = np.random.default_rng().integers(0, 256, 128 - head.size, dtype=np.uint8)
    return tuple(int(b) - 256 if b > 127 else int(b) for b in raw)


def _parse_uid(uid: Any) -> tuple[int, int]:
    raw = bytes(uid) if isinstance(uid, (bytes, bytearray)) else bytes(int(v) & 0xFF for v in uid)
    if len(raw) != 128:
        raise NcclError(NCCL_INVALID_ARGUMENT, f"a unique id is 128 bytes, got {len(raw)}")
    head = np.frombuffer(raw[:24], dtype=np.int64)
    return int(head[0]), int(head[1])


def _element(dtype: int) -> np.dtype:
    if dtype not in _DTYPES:
        raise NcclError(NCCL_INVALID_ARGUMENT, f"datatype {dtype} is not an NCCL type emulated here "
                        f"({sorted(_DTYPES)}: int8..uint64, float16..float64)")
    return np.dtype(_DTYPES[dtype])


_MPI_TYPES: dict[int, MPI.Datatype] = {}
_MPI_OPS: dict[tuple[str, str], MPI.Op] = {}


def _mpi_type(dt: np.dtype) -> MPI.Datatype:
    t = _MPI_TYPES.get(dt.itemsize)
    if t is None:
        t = _MPI_TYPES[dt.itemsize] = MPI.BYTE.Create_contiguous(dt.itemsize).Commit()
    return t


def _mpi_op(op: str, dt: np.dtype) -> MPI.Op:
    """NCCL's reduction on ``dt``: max/min drop NaN on floating types (fmax/fmin)."""
    key = (op, dt.str)
    found = _MPI_OPS.get(key)
    if found is not None:
        return found
    floating = dt.kind == "f"
    fn = {"sum": np.add, "avg": np.add, "prod": np.multiply,
          "max": np.fmax if floating else np.maximum, "min": np.fmin if floating else np.minimum}[op]

    def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        a = np.frombuffer(inbuf, dtype=dt)
        b = np.frombuffer(inoutbuf, dtype=dt)
        fn(a, b, out=b)

    found = _MPI_OPS[key] = MPI.Op.Create(reduce, commute=True)
    return found


# --- groups --------------------------------------------------------------------------------
_group_depth = 0
_held: list[tuple["NcclCommunicator", str, tuple[Any, ...], int]] = []


def groupStart() -> None:
    global _group_depth
    _group_depth += 1


def groupEnd() -> None:
    global _group_depth
    if _group_depth == 0:
        raise NcclError(NCCL_INVALID_USAGE, "groupEnd() without groupStart()")
    _group_depth -= 1
    if _group_depth:
        return
    held, _held[:] = list(_held), []
    p2p: dict[int, tuple[NcclCommunicator, int, list[tuple[str, tuple[Any, ...]]]]] = {}
    for comm, kind, args, stream in held:
        if kind in ("send", "recv"):
            p2p.setdefault(id(comm), (comm, stream, []))[2].append((kind, args))
        else:  # a collective made (its call compared) at the call, started in order from here
            comm._enqueue(args[0], stream)
    for comm, stream, calls in p2p.values():
        comm._enqueue(_PointToPoint(comm, calls), stream)


# --- queued operations ---------------------------------------------------------------------
class _Op:
    """An NCCL operation queued on a stream: ``test()`` advances it and never blocks."""

    def __init__(self, comm: "NcclCommunicator") -> None:
        self.comm = comm
        self.requests: list[MPI.Request] = []
        self.started = False
        self.finished = False
        self.keep: tuple[Any, ...] = ()

    def ready_to_start(self) -> bool:
        return True

    def start(self) -> None:
        raise NotImplementedError

    def complete(self) -> None:
        """After the data requests finish (checks, a division)."""

    def test(self) -> bool:
        if self.finished:
            return True
        if self.comm.aborted:
            self.finished = True
            _ABANDONED.append(self)
            return True
        if not self.started:
            if not (self.comm._queue and self.comm._queue[0] is self and self.ready_to_start()):
                return False
            self.comm._queue.popleft()
            self.started = True
            self.start()
        try:
            done = MPI.Request.Testall(self.requests) if self.requests else True
        except MPI.Exception as e:
            self.finished = True
            raise NcclError(NCCL_INVALID_USAGE, f"{self.comm._name}: {e.Get_error_string()} (mismatched "
                                                f"send/recv counts?)") from None
        if done:
            self.finished = True
            self.complete()
            self.keep = ()
        return self.finished


_ABANDONED: list[_Op] = []


class _Collective(_Op):
    """A collective: the call compared across ranks first, then the MPI nonblocking collective."""

    def __init__(self, comm: "NcclCommunicator", kind: str, send: int, recv: int, count: int, dtype: int,
                 op: int, root: int) -> None:
        super().__init__(comm)
        self.kind, self.count, self.op, self.root = kind, int(count), op, int(root)
        self.dt = _element(dtype)
        if count < 0:
            raise NcclError(NCCL_INVALID_ARGUMENT, f"{kind}: count {count} < 0")
        if op not in _OPS:
            raise NcclError(NCCL_INVALID_ARGUMENT, f"{kind}: reduction op {op} is not an NCCL op")
        if kind in ("bcast", "broadcast", "reduce") and not 0 <= root < comm._size:
            raise NcclError(NCCL_INVALID_ARGUMENT, f"{kind}: root {root} is not a rank of {comm._size}")
        m, item = comm._size, self.dt.itemsize
        send_n, recv_n = {"allReduce": (count, count), "reduceScatter": (count * m, count),
                          "allGather": (count, count * m), "bcast": (0, count), "broadcast": (count, count),
                          "reduce": (count, count)}[kind]
        if kind in ("broadcast", "reduce") and comm._rank != root:
            send_n = 0 if kind == "broadcast" else send_n
        if kind == "reduce" and comm._rank != root:
            recv_n = 0
        # the allocations stay alive until the operation ends (CuPy's pool reuses a freed block
        # only for work queued after it on the stream; here host code would reuse it at once)
        self.send, owner_s = memory.resolve(send, send_n * item, f"{kind} send buffer") if send_n else (None, None)
        self.recv, owner_r = memory.resolve(recv, recv_n * item, f"{kind} receive buffer") if recv_n else (None, None)
        self.keep = (owner_s, owner_r)
        self.send_ptr, self.recv_ptr = int(send), int(recv)
        self.meta = np.array([_KINDS.index(kind), count, dtype, op, root], dtype=np.int64)
        self.metas = np.empty((m, self.meta.size), dtype=np.int64)
        self.meta_request = comm._meta.Iallgather(self.meta, self.metas)

    def ready_to_start(self) -> bool:
        if not self.meta_request.Test():
            return False
        if (self.metas != self.meta).any():
            self.finished = True
            self.comm._queue.popleft()
            rows = ", ".join(f"rank {r}: {_KINDS[int(k)]}(count={c}, type={t}, op={_OPS.get(int(o), o)}, root={ro})"
                             for r, (k, c, t, o, ro) in enumerate(self.metas.tolist()))
            raise NcclError(NCCL_INVALID_USAGE, f"{self.comm._name}: ranks made different calls ({rows}); "
                                                f"NCCL would hang or corrupt memory")
        return True

    def start(self) -> None:
        comm, t = self.comm._data, _mpi_type(self.dt)
        n, kind = self.count, self.kind
        op = _mpi_op(_OPS[self.op], self.dt)
        inplace = self.send is not None and self.send_ptr == self.recv_ptr
        send = MPI.IN_PLACE if inplace else [self.send, n, t]
        if kind == "allReduce":
            self.requests = [comm.Iallreduce(send, [self.recv, n, t], op=op)]
        elif kind == "reduceScatter":
            if inplace:
                raise NcclError(NCCL_INVALID_ARGUMENT, "reduceScatter in place is not emulated")
            self.requests = [comm.Ireduce_scatter_block([self.send, n, t], [self.recv, n, t], op=op)]
        elif kind == "allGather":
            if self.send_ptr == self.recv_ptr + self.comm._rank * n * self.dt.itemsize:
                send = MPI.IN_PLACE
            self.requests = [comm.Iallgather(send, [self.recv, n, t])]
        elif kind in ("bcast", "broadcast"):
            if kind == "broadcast" and self.comm._rank == self.root and not inplace:
                self.recv[...] = self.send
            self.requests = [comm.Ibcast([self.recv, n, t], root=self.root)]
        else:  # reduce
            recv = [self.recv, n, t] if self.comm._rank == self.root else None
            self.requests = [comm.Ireduce(send, recv, op=op, root=self.root)]

    def complete(self) -> None:
        if _OPS[self.op] == "avg" and self.recv is not None:
            v = self.recv.view(self.dt)
            if self.dt.kind == "f":
                v /= self.comm._size
            else:
                v //= self.comm._size


class _PointToPoint(_Op):
    """The sends and receives of one group on one communicator, started together at ``groupEnd``."""

    def __init__(self, comm: "NcclCommunicator", calls: list[tuple[str, tuple[Any, ...]]]) -> None:
        super().__init__(comm)
        self.calls = []
        for kind, (ptr, count, dtype, peer) in calls:
            dt = _element(dtype)
            if not 0 <= peer < comm._size:
                raise NcclError(NCCL_INVALID_ARGUMENT, f"{kind}: peer {peer} is not a rank of {comm._size}")
            buf, owner = memory.resolve(ptr, int(count) * dt.itemsize, f"{kind} buffer")
            self.calls.append((kind, buf, int(count) * dt.itemsize, peer))
            self.keep += (owner,)
        self.statuses: list[MPI.Status] = []

    def start(self) -> None:
        for kind, buf, nbytes, peer in self.calls:
            if kind == "send":
                self.requests.append(self.comm._data.Isend([buf, nbytes, MPI.BYTE], peer, tag=1))
            else:
                self.requests.append(self.comm._data.Irecv([buf, nbytes, MPI.BYTE], peer, tag=1))

    def test(self) -> bool:
        if self.started and not self.finished and not self.comm.aborted:
            statuses = [MPI.Status() for _ in self.requests]
            try:
                done = MPI.Request.Testall(self.requests, statuses)
            except MPI.Exception as e:
                self.finished = True
                raise NcclError(NCCL_INVALID_USAGE, f"{self.comm._name}: send/recv counts differ "
                                                    f"({e.Get_error_string()})") from None
            if not done:
                return False
            self.finished, self.keep = True, ()
            for (kind, _, nbytes, peer), st in zip(self.calls, statuses):
                if kind == "recv" and st.Get_count(MPI.BYTE) != nbytes:
                    raise NcclError(NCCL_INVALID_USAGE, f"{self.comm._name}: recv of {nbytes} bytes from rank "
                                                        f"{peer} got a send of {st.Get_count(MPI.BYTE)}")
            return True
        return super().test()


# --- the communicator ----------------------------------------------------------------------
class NcclCommunicator:
    """``NcclCommunicator(ndev, commId, rank)``: collective over the ``ndev`` members."""

    def __init__(self, ndev: int, commId: Any, rank: int) -> None:
        creator, serial = _parse_uid(commId)
        tag = _TAG_BASE + serial % 4096
        me = (_WORLD.Get_rank(), int(rank), int(ndev), socket.gethostname(), current_device_id())
        sent = _WORLD.isend(me, dest=creator, tag=tag)
        if _WORLD.Get_rank() == creator:
            members = [_WORLD.recv(source=MPI.ANY_SOURCE, tag=tag) for _ in range(int(ndev))]
            verdict = _check_members(members, int(ndev))
            for who in members:
                _WORLD.send(verdict, dest=who[0], tag=tag)
        request = _WORLD.irecv(source=creator, tag=tag)
        got: list[Any] = []

        def arrived() -> bool:
            flag, msg = request.test()
            if flag:
                got.append(msg)
            return bool(flag)

        wait_until(arrived, "NcclCommunicator set-up")
        sent.wait()
        ok, detail = got[0]
        if not ok:
            raise NcclError(NCCL_INVALID_USAGE, detail)
        group = _WORLD.Get_group().Incl(detail)
        self._data = _WORLD.Create_group(group, tag=tag)
        group.Free()
        self._meta = self._data.Dup()
        self._rank, self._size, self._device = int(rank), int(ndev), current_device_id()
        self._queue: deque[_Op] = deque()
        self._name = f"communicator of {ndev} (world ranks {detail})"
        self.aborted = False
        self.destroyed = False

    def _usable(self) -> None:
        if self.aborted or self.destroyed:
            raise NcclError(NCCL_INVALID_USAGE, f"{self._name} was {'aborted' if self.aborted else 'destroyed'}")

    def _enqueue(self, op: _Op, stream: int) -> None:
        self._queue.append(op)
        stream_at(stream).enqueue(op)

    def _call(self, kind: str, args: tuple[Any, ...], stream: Any) -> None:
        self._usable()
        ptr = int(stream.ptr if hasattr(stream, "ptr") else stream)
        if _group_depth:
            if kind not in ("send", "recv"):
                args = (_Collective(self, kind, *args),)
                _held.append((self, "op", args, ptr))
                return
            _held.append((self, kind, args, ptr))
            return
        if kind in ("send", "recv"):
            self._enqueue(_PointToPoint(self, [(kind, args)]), ptr)
        else:
            self._enqueue(_Collective(self, kind, *args), ptr)

    # CuPy's signatures
    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: Any) -> None:
        self._call("allReduce", (sendbuf, recvbuf, count, datatype, op, 0), stream)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int,
                      stream: Any) -> None:
        self._call("reduceScatter", (sendbuf, recvbuf, recvcount, datatype, op, 0), stream)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: Any) -> None:
        self._call("allGather", (sendbuf, recvbuf, count, datatype, NCCL_SUM, 0), stream)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: Any) -> None:
        self._call("bcast", (buff, buff, count, datatype, NCCL_SUM, root), stream)

    def broadcast(self, sendbuf: int, recvbuf: int, count: int, datatype: int, root: int, stream: Any) -> None:
        self._call("broadcast", (sendbuf, recvbuf, count, datatype, NCCL_SUM, root), stream)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int,
               stream: Any) -> None:
        self._call("reduce", (sendbuf, recvbuf, count, datatype, op, root), stream)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: Any) -> None:
        self._call("send", (sendbuf, count, datatype, peer), stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: Any) -> None:
        self._call("recv", (recvbuf, count, datatype, peer), stream)

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def device_id(self) -> int:
        return self._device

    def getAsyncError(self) -> int:
        return 0

    def abort(self) -> None:
        """ncclCommAbort: pending operations end (their MPI requests are kept, never freed)."""
        self.aborted = True

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        if not self.aborted and self._queue:
            raise NcclError(NCCL_INVALID_USAGE, f"{self._name} destroyed with {len(self._queue)} operation(s) "
                                                f"never started")
        if not self.aborted:
            self._meta.Free()
            self._data.Free()

    @staticmethod
    def initAll(devices: Any) -> list["NcclCommunicator"]:
        raise NotImplementedError("emulated NCCL: initAll (one process, several devices) is not emulated")


def _check_members(members: list[tuple[int, int, int, str, int]], ndev: int) -> tuple[bool, Any]:
    """At the creator: the members' facts agree, or the reason every member raises."""
    sizes = {m[2] for m in members}
    if sizes != {ndev}:
        return False, f"ncclCommInitRank: ranks gave different communicator sizes {sorted(sizes)}"
    ranks = sorted(m[1] for m in members)
    if ranks != list(range(ndev)):
        return False, f"ncclCommInitRank: ranks {ranks} are not 0..{ndev - 1} once each"
    seen: dict[tuple[str, int], int] = {}
    for _world, rank, _, host, device in members:
        if (host, device) in seen:
            return False, (f"ncclCommInitRank: ranks {seen[(host, device)]} and {rank} use the same device "
                           f"{device} on {host} (ncclInvalidUsage: duplicate GPU)")
        seen[(host, device)] = rank
    return True, [m[0] for m in sorted(members, key=lambda m: m[1])]


__all__ = ["NCCL_FLOAT32", "NCCL_MAX", "NCCL_MIN", "NCCL_SUM", "NcclCommunicator", "NcclError", "get_unique_id",
           "groupEnd", "groupStart"]
