"""GPU backends: NCCL, CUDA-aware MPI, and host staging; chosen automatically or by
``DTORCH_GPU_BACKEND`` (``auto`` | ``nccl`` | ``cuda-aware-mpi`` | ``host-staging``).

``auto`` takes NCCL when ``cupy.cuda.nccl`` is importable and every rank of the node has a GPU
of its own (NCCL refuses two ranks on one GPU), else CUDA-aware MPI when the MPI library says
it is (``DTORCH_CUDA_AWARE_MPI=1`` forces it), else host staging: device -> host -> MPI ->
device, the safe default. All three take the same calls as the MPI backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from .._mpi import library_world, ranks_on_node
from .backend import backends_for
from .counter import record
from .group import Group
from .layout import offsets, view3, with_dim
from .lifetime import CommAttached
from .mpi_backend import MPIBackend
from .work import Work, completed, moves_nothing


# --- selection -----------------------------------------------------------------------------
def choose_backend(requested: str, nccl_available: bool, ranks_on_node: int, gpus_on_node: int,
                   cuda_aware_mpi: bool) -> str:
    """The backend to use (pure: unit-tested without a GPU)."""
    if requested not in gpu_backend_names():
        raise ValueError(f"DTORCH_GPU_BACKEND={requested!r} is not one of {', '.join(gpu_backend_names())}")
    if requested == "nccl":
        if not nccl_available:
            raise RuntimeError("DTORCH_GPU_BACKEND=nccl but cupy.cuda.nccl is not available")
        if ranks_on_node > gpus_on_node:
            raise RuntimeError(f"NCCL needs one GPU per rank: {ranks_on_node} ranks share {gpus_on_node} GPU(s) "
                               f"on this node; use DTORCH_GPU_BACKEND=host-staging")
        return "nccl"
    if requested != "auto":
        return requested
    if nccl_available and ranks_on_node <= gpus_on_node:
        return "nccl"
    return "cuda-aware-mpi" if cuda_aware_mpi else "host-staging"


def gpu_backend_names() -> tuple[str, ...]:
    """The values ``DTORCH_GPU_BACKEND`` accepts: ``auto`` and every registered cuda backend."""
    return ("auto", *backends_for("cuda"))


def mpi_is_cuda_aware() -> bool:
    flag = os.environ.get("DTORCH_CUDA_AWARE_MPI")
    if flag is not None:
        return flag not in ("", "0")
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:
        return False


def agreed_facts(world: MPI.Intracomm, requested: str, nccl_available: bool, ranks_on_node: int,
                 gpus_on_node: int, cuda_aware_mpi: bool) -> tuple[bool, int, int, bool]:
    """The selection facts every rank shares: NCCL and CUDA-aware MPI only where every rank
    has them, the most crowded node's ranks and the fewest GPUs, so every rank picks the same
    backend (one rank in NCCL while another calls MPI would hang)."""
    names = gpu_backend_names()
    code = names.index(requested) if requested in names else len(names)
    local = np.array([code, -code, -int(nccl_available), ranks_on_node, -gpus_on_node, -int(cuda_aware_mpi)],
                     dtype=np.int64)
    worst = np.empty_like(local)
    world.Allreduce(local, worst, op=MPI.MAX)
    if worst[0] != -worst[1]:
        raise ValueError("DTORCH_GPU_BACKEND differs between ranks; set the same value on every rank")
    return bool(-worst[2]), int(worst[3]), int(-worst[4]), bool(-worst[5])


_selected: str | None = None


def selected_backend() -> str:
    """The name of the process's GPU backend, chosen once from facts agreed over the library's
    world (a collective of every world rank: cuda ``DeviceMesh`` construction calls it first)."""
    global _selected
    if _selected is None:
        try:
            import cupy

            gpus = int(cupy.cuda.runtime.getDeviceCount())
        except Exception:  # a rank without CuPy or a GPU takes part with none
            gpus = 0
        try:
            from cupy.cuda import nccl  # noqa: F401

            have_nccl = True
        except ImportError:
            have_nccl = False
        world = library_world()
        requested = os.environ.get("DTORCH_GPU_BACKEND", "auto")
        facts = agreed_facts(world, requested, have_nccl, ranks_on_node(), gpus, mpi_is_cuda_aware())
        _selected = choose_backend(requested, *facts)
    return _selected


# --- host staging --------------------------------------------------------------------------
class _Staged:
    """A host collective whose result is copied back to the device on completion."""

    def __init__(self, work: Work, finish: Callable[[Any], Any]) -> None:
        self._work, self._finish, self._result, self._done = work, finish, None, False

    def done(self) -> bool:
        if not self._done and self._work.done():
            self._result, self._done = self._finish(self._work.wait()), True
        return self._done

    def wait(self) -> Any:
        if not self._done:
            self._result, self._done = self._finish(self._work.wait()), True
        return self._result


@dataclass
class DeviceAdapter:
    """How staging moves arrays: ``to_host(a) -> numpy``, ``to_device(host, like) -> array``."""

    to_host: Callable[[Any], np.ndarray]
    to_device: Callable[[np.ndarray, Any], Any]


def cupy_adapter() -> DeviceAdapter:
    import cupy

    return DeviceAdapter(lambda a: cupy.asnumpy(a), lambda h, like: cupy.asarray(h))


class HostStagingBackend:
    """Device -> host -> MPI -> device. Works with any MPI; the safe default."""

    name = "host-staging"

    def __init__(self, adapter: DeviceAdapter | None = None, inner: MPIBackend | None = None) -> None:
        self.adapter = adapter or cupy_adapter()
        self.inner = inner or MPIBackend()

    def _host_out(self, out: Any) -> np.ndarray:
        return np.empty(out.shape, dtype=out.dtype)

    def _back(self, out: Any) -> Callable[[Any], Any]:
        def finish(host: np.ndarray) -> Any:
            out[...] = self.adapter.to_device(np.asarray(host), out)
            return out
        return finish

    def all_gather(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int], async_op: bool = False) -> Any:
        w = self.inner.all_gather(group, self.adapter.to_host(send), self._host_out(out), axis, sizes, async_op)
        return _Staged(w, self._back(out))

    def all_to_all(self, group: Group, send: Any, out: Any, split_axis: int, split_sizes: Sequence[int],
                   concat_axis: int, concat_sizes: Sequence[int], async_op: bool = False) -> Any:
        w = self.inner.all_to_all(group, self.adapter.to_host(send), self._host_out(out), split_axis,
                                  split_sizes, concat_axis, concat_sizes, async_op)
        return _Staged(w, self._back(out))

    def all_reduce(self, group: Group, send: Any, out: Any, reduce_op: str, async_op: bool = False) -> Any:
        w = self.inner.all_reduce(group, self.adapter.to_host(send), self._host_out(out), reduce_op, async_op)
        return _Staged(w, self._back(out))

    def reduce_scatter(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int],
                       reduce_op: str, async_op: bool = False) -> Any:
        w = self.inner.reduce_scatter(group, self.adapter.to_host(send), self._host_out(out), axis, sizes,
                                      reduce_op, async_op)
        return _Staged(w, self._back(out))

    def broadcast(self, group: Group, buf: Any, root: int, async_op: bool = False) -> Any:
        host = self.adapter.to_host(buf)
        w = self.inner.broadcast(group, host, root, async_op)
        return _Staged(w, self._back(buf))

    def scatter(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int], root: int,
                async_op: bool = False) -> Any:
        host = self.adapter.to_host(send) if send is not None else None
        w = self.inner.scatter(group, host, self._host_out(out), axis, sizes, root, async_op)
        return _Staged(w, self._back(out))


class CudaAwareMPIBackend(MPIBackend):
    """CuPy buffers straight to a CUDA-aware MPI (after a stream synchronize)."""

    name = "cuda-aware-mpi"


# --- NCCL ----------------------------------------------------------------------------------
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


class NCCLBackend:
    """NCCL through ``cupy.cuda.nccl``: one communicator per mesh-dim group (its unique id
    broadcast over MPI), equal-size collectives with padding, work on the current stream."""

    name = "nccl"

    def __init__(self) -> None:
        # attached to the group's MPI communicator: released when the mesh frees it, never
        # handed to a new communicator that MPI gives the freed one's handle
        self._comms: CommAttached[Any] = CommAttached("an NCCL communicator", lambda c: c.destroy())

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
        group.comm.Bcast(raw, root=0)
        like = uid if uid is not None else nccl.get_unique_id()
        return nccl.NcclCommunicator(group.size, uid_from_bytes(raw.tobytes(), like), group.rank)

    @staticmethod
    def _stream() -> int:
        import cupy

        return cupy.cuda.get_current_stream().ptr

    @staticmethod
    def _wire(a: Any, reducing: bool) -> tuple[Any, int]:
        from cupy.cuda import nccl

        wire, _ = nccl_wire(a.dtype, reducing)
        flat = a.reshape(-1)
        if wire != a.dtype:
            flat = flat.view(wire) if wire.itemsize != a.dtype.itemsize or not reducing else flat.astype(wire)
        return flat, getattr(nccl, NCCL_TYPES[wire.name])

    def all_gather(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int], async_op: bool = False) -> Any:
        import cupy

        m = group.size
        if (done := moves_nothing(m, send, out, out.size == 0)) is not None:
            return done
        outer, length, inner = view3(out.shape, axis)
        record("all_gather", group.mesh_dim, send.nbytes, out.nbytes - send.nbytes, len(set(sizes)) > 1, async_op)
        block, plan = padded_plan(sizes, inner)
        pad_send = cupy.zeros((outer, block), dtype=out.dtype)
        pad_send[:, : send.size // max(outer, 1)] = cupy.ascontiguousarray(send).reshape(outer, -1)
        pad_out = cupy.empty((m, outer, block), dtype=out.dtype)
        s, st = self._wire(pad_send, False)
        r, _ = self._wire(pad_out, False)
        self._nccl(group).allGather(s.data.ptr, r.data.ptr, s.size, st, self._stream())
        dst = out.reshape(outer, length, inner)
        for i, (count, _, _) in enumerate(plan):
            n = count // inner if inner else 0
            o = offsets(sizes)[i]
            dst[:, o : o + n, :] = pad_out[i, :, :count].reshape(outer, n, inner)
        return completed(out)

    def all_reduce(self, group: Group, send: Any, out: Any, reduce_op: str, async_op: bool = False) -> Any:
        import cupy
        from cupy.cuda import nccl

        m = group.size
        if (done := moves_nothing(m, send, out, out.size == 0)) is not None:
            return done
        record("all_reduce", group.mesh_dim, send.nbytes, out.nbytes, False, async_op)
        wire, _ = nccl_wire(out.dtype, True)
        src = cupy.ascontiguousarray(send).astype(wire, copy=False) if out.dtype.kind != "c" else \
            cupy.ascontiguousarray(send).view(wire)
        dst = cupy.empty_like(src)
        op = {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}[reduce_op]
        if out.dtype == np.bool_:
            op = {"sum": nccl.NCCL_MAX, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN, "avg": nccl.NCCL_MAX}[reduce_op]
        self._nccl(group).allReduce(src.data.ptr, dst.data.ptr, src.size,
                                    getattr(nccl, NCCL_TYPES[wire.name]), op, self._stream())
        if reduce_op in ("max", "min") and out.dtype.kind == "f":  # NCCL max/min drop NaN; NumPy keeps it
            nan = cupy.isnan(src).astype(np.uint8)
            self._nccl(group).allReduce(nan.data.ptr, nan.data.ptr, nan.size, nccl.NCCL_UINT8, nccl.NCCL_MAX,
                                        self._stream())
            dst[nan.astype(bool)] = np.nan
        if reduce_op == "avg":
            dst = dst // m if dst.dtype.kind in "iu" else dst / m
        out[...] = (dst.view(out.dtype) if out.dtype.kind == "c" else dst.astype(out.dtype)).reshape(out.shape)
        return completed(out)

    def reduce_scatter(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int],
                       reduce_op: str, async_op: bool = False) -> Any:
        import cupy

        full = cupy.empty(send.shape, dtype=send.dtype)
        self.all_reduce(group, send, full, reduce_op)
        o = offsets(sizes)[group.rank]
        out[...] = full[(slice(None),) * axis + (slice(o, o + sizes[group.rank]),)]
        return completed(out)

    def all_to_all(self, group: Group, send: Any, out: Any, split_axis: int, split_sizes: Sequence[int],
                   concat_axis: int, concat_sizes: Sequence[int], async_op: bool = False) -> Any:
        from cupy.cuda import nccl

        m = group.size
        if (done := moves_nothing(m, send, out)) is not None:
            return done
        record("all_to_all", group.mesh_dim, send.nbytes, out.nbytes, True, async_op)
        comm = self._nccl(group)
        stream = self._stream()
        send_blocks, recv_blocks = [], []
        for n, o in zip(split_sizes, offsets(split_sizes)):
            send_blocks.append(send[(slice(None),) * split_axis + (slice(o, o + n),)].copy())
        for n in concat_sizes:
            recv_blocks.append(out[(slice(None),) * concat_axis + (slice(0, n),)].copy())
        nccl.groupStart()
        for j in range(m):
            sb, st = self._wire(send_blocks[j], False)
            rb, rt = self._wire(recv_blocks[j], False)
            comm.send(sb.data.ptr, sb.size, st, j, stream)
            comm.recv(rb.data.ptr, rb.size, rt, j, stream)
        nccl.groupEnd()
        for j, (n, o) in enumerate(zip(concat_sizes, offsets(concat_sizes))):
            out[(slice(None),) * concat_axis + (slice(o, o + n),)] = recv_blocks[j]
        return completed(out)

    def broadcast(self, group: Group, buf: Any, root: int, async_op: bool = False) -> Any:
        if (done := moves_nothing(group.size, buf, buf, buf.size == 0)) is not None:
            return done
        flat, t = self._wire(buf, False)
        self._nccl(group).bcast(flat.data.ptr, flat.size, t, root, self._stream())
        return completed(buf)

    def scatter(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int], root: int,
                async_op: bool = False) -> Any:
        import cupy

        full = send if group.rank == root else cupy.empty(with_dim(out.shape, axis, sum(sizes)), dtype=out.dtype)
        self.broadcast(group, full, root)
        o = offsets(sizes)[group.rank]
        out[...] = full[(slice(None),) * axis + (slice(o, o + sizes[group.rank]),)]
        return completed(out)


__all__ = ["CudaAwareMPIBackend", "DeviceAdapter", "HostStagingBackend", "NCCLBackend", "agreed_facts", "choose_backend",
           "gpu_backend_names", "selected_backend", "mpi_is_cuda_aware", "nccl_wire", "padded_plan",
           "uid_from_bytes", "uid_to_bytes"]
