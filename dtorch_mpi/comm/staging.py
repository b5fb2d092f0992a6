"""The GPU backends that carry device arrays over MPI: host staging (device -> host -> MPI ->
device; works with any MPI, the safe default) and CUDA-aware MPI (device buffers straight to
an MPI that takes them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .group import Group
from .mpi_backend import MPIBackend
from .work import Done, Work


class _Staged:
    """A host collective whose result is copied back to the device on completion."""

    def __init__(self, work: Work | Done, finish: Callable[[Any], Any]) -> None:
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

    def call_for(self, kind: str, send: Any, out: Any, facts: dict[str, Any]) -> tuple[str, bool]:
        return self.inner.call_for(kind, send, out, facts)

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
    device_buffers = True
    overlaps_check = False  # device memory left to an abandoned request: the check runs first


__all__ = ["CudaAwareMPIBackend", "DeviceAdapter", "HostStagingBackend", "cupy_adapter"]
