"""EMULATED DEVICE (test double): ``cupy.cuda`` - devices, streams and events of the emulated
device. A stream holds the NCCL operations queued on it (``cupy.cuda.nccl``: MPI requests
underneath); an event records what its stream held; ``query``/``synchronize`` test/wait them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from . import memory, runtime

_current_device = 0


class Device:
    """A device of the emulated node (``runtime.getDeviceCount()`` of them)."""

    def __init__(self, device: int | None = None) -> None:
        self.id = _current_device if device is None else int(device)
        if not 0 <= self.id < runtime.getDeviceCount():
            raise runtime.CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id} "
                                           f"(emulated device: {runtime.getDeviceCount()} device(s))")

    def use(self) -> None:
        global _current_device
        _current_device = self.id

    def synchronize(self) -> None:
        for s in list(_STREAMS.values()):
            s.synchronize()

    def __enter__(self) -> "Device":
        self._before = _current_device
        self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        Device(self._before).use()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id} (emulated)>"


class Pending(Protocol):
    """Queued device work (an emulated NCCL operation): ``test()`` advances it, never blocks."""

    def test(self) -> bool: ...


def _sync_limit() -> float:
    return float(os.environ.get("DTORCH_EMULATED_SYNC_LIMIT", "300"))


class Stream:
    """A stream: NCCL work queued in order; device operations run after it (stream order)."""

    _next = 1

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int | None = None) -> None:
        if ptr is None:
            ptr = 0 if null else Stream._next
            if not null:
                Stream._next += 1
        self.ptr = ptr
        self.pending: list[Pending] = []
        _STREAMS[ptr] = self

    def enqueue(self, op: Pending) -> None:
        self.pending.append(op)

    def _advance(self) -> bool:
        self.pending = _advance_in_order(self.pending)
        return not self.pending

    def query(self) -> bool:
        return self._advance()

    def _drain(self) -> None:
        if self.pending:
            wait_until(self._advance, "a stream synchronize")

    def synchronize(self) -> None:
        self._drain()

    def record(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def use(self) -> "Stream":
        global _current_stream
        _current_stream = self
        return self

    def __enter__(self) -> "Stream":
        self._before = get_current_stream()
        self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._before.use()


def _advance_in_order(ops: list[Pending]) -> list[Pending]:
    """Stream order: an operation starts only after every one queued before it has finished;
    the ones not finished yet, in order."""
    for i, op in enumerate(ops):
        if not op.test():
            return ops[i:]
    return []


def wait_until(ready: Any, what: str) -> None:
    """Poll ``ready()`` (a blocking GPU wait: the real one never returns if a peer never joins;
    this one gives up after DTORCH_EMULATED_SYNC_LIMIT seconds so a test run cannot hang)."""
    start, limit, polls = time.monotonic(), _sync_limit(), 0
    while not ready():
        polls += 1
        if polls % 16 == 0:
            os.sched_yield()
            if time.monotonic() - start > limit:
                raise RuntimeError(f"emulated device: {what} waited {limit:g}s for NCCL work that never "
                                   f"completed (a peer never joined)")


class Event:
    """Marks a point of a stream: done when everything queued before ``record`` is."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self._ops: list[Pending] = []
        self.ptr = id(self)

    def record(self, stream: Stream | None = None) -> None:
        self._ops = list((stream or get_current_stream()).pending)

    def query(self) -> bool:
        self._ops = _advance_in_order(self._ops)
        return not self._ops

    @property
    def done(self) -> bool:
        return self.query()

    def synchronize(self) -> None:
        if self._ops:
            wait_until(self.query, "an event synchronize")


_STREAMS: dict[int, Stream] = {}
Stream.null = Stream(null=True)  # type: ignore[attr-defined]
_current_stream: Stream = Stream.null  # type: ignore[attr-defined]


def get_current_stream() -> Stream:
    return _current_stream


def stream_at(ptr: int) -> Stream:
    """The stream whose ``ptr`` is ``ptr`` (NCCL calls name streams by pointer)."""
    try:
        return _STREAMS[int(ptr)]
    except KeyError:
        raise ValueError(f"emulated device: no stream at {ptr:#x}") from None


@contextmanager
def using_device(i: int) -> Iterator[None]:
    with Device(i):
        yield


def current_device_id() -> int:
    return _current_device


def is_available() -> bool:
    return runtime.getDeviceCount() > 0


__all__ = ["Device", "Event", "Stream", "get_current_stream", "memory", "runtime"]
