"""A timeline of what ran when: collectives, backward nodes and user spans, as Chrome
trace-event JSON (chrome://tracing, https://ui.perfetto.dev).

``with dt.trace("trace.json"):`` (or ``DTORCH_TRACE=trace.json`` for the whole program, written
at exit) writes one file per rank, ``trace.rank<r>.json``: no collective is needed to write it,
so a rank that fails still leaves its file. ``python -m dtorch_mpi.timeline merge trace.rank*.json
-o trace.json`` merges them into one file (the ranks' clocks are the host's monotonic clock, so
on one host they line up; across hosts each rank's track is right on its own).

Every event is a complete event (``"ph": "X"``, ``ts``/``dur`` in microseconds), ``pid`` = the
rank, ``tid`` = a lane per kind (:data:`LANES`): user spans (``with dt.trace_span("name"):``),
backward (one event per ``backward()`` and one per node inside it), blocking collectives, and
nonblocking collectives, each in the first lane free when it started (they overlap each other
and compute). A collective's event runs from just before the backend starts it to when the
library learns it finished (its ``wait()``, a ``done()`` that returned True, or the test the
trace itself makes of every collective in flight at the end of each span and backward node, so
an event ends within one node of the real completion; this adds ``MPI_Test`` calls, and so
some progress, only while tracing); ``args``
holds its kind, mesh dim, bytes sent/received, padded and nonblocking: the same records a
``CommCounter`` gets (the trace is one), so the counts agree. Off (the default) costs one
``None`` test per backward node and per collective, and records nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from . import settings
from .comm import counter

LANES = {"spans": 1, "backward": 2, "comm": 3}
"""The fixed lanes (``tid``); nonblocking collectives use ``ASYNC_LANE + k``."""
ASYNC_LANE = 10


def _now_us() -> float:
    return time.perf_counter_ns() / 1000.0


class _Stamped(list):  # type: ignore[type-arg]
    """A CommCounter's record list that notes when each record was made (the collective's
    start: the prologue records just before the backend starts it)."""

    def __init__(self, owner: "Trace") -> None:
        super().__init__()
        self.owner = owner

    def append(self, rec: Any) -> None:
        super().append(rec)
        self.owner.pending = (rec, _now_us())


class _Traced:
    """A collective's handle that closes its event when it completes."""

    __slots__ = ("_inner", "_close")

    def __init__(self, inner: Any, close: Any) -> None:
        self._inner, self._close = inner, close

    def done(self) -> bool:
        finished = bool(self._inner.done())
        if finished and self._close is not None:
            self._close()
            self._close = None
        return finished

    def wait(self) -> Any:
        result = self._inner.wait()
        if self._close is not None:
            self._close()
            self._close = None
        return result


class Trace:
    """One rank's events while a trace is on."""

    def __init__(self, path: str) -> None:
        from mpi4py import MPI

        self.rank = MPI.COMM_WORLD.Get_rank()
        self.path = rank_path(path, self.rank)
        self.events: list[dict[str, Any]] = []
        self.pending: tuple[Any, float] | None = None
        self.busy: set[int] = set()
        self.unfinished: dict[int, tuple[Any, float, int]] = {}  # id -> (record, start, lane) of unwaited
        self.handles: dict[int, _Traced] = {}  # the same collectives' handles, tested by poll()
        self.counter = counter.CommCounter()
        self.counter.records = _Stamped(self)

    def event(self, name: str, cat: str, tid: int, start: float, end: float, args: dict[str, Any] | None = None) -> None:
        ev = {"name": name, "cat": cat, "ph": "X", "ts": start, "dur": max(end - start, 0.0), "pid": self.rank,
              "tid": tid}
        if args:
            ev["args"] = args
        self.events.append(ev)

    def started(self, handle: Any, nonblocking: bool) -> Any:
        """The prologue's backend call returned ``handle``: pair it with the record made just
        before and close the event when it completes."""
        pending, self.pending = self.pending, None
        if pending is None:
            return handle
        rec, start = pending
        lane = LANES["comm"]
        if nonblocking:
            lane = next(k for k in range(ASYNC_LANE, ASYNC_LANE + len(self.busy) + 1) if k not in self.busy)
            self.busy.add(lane)
        key = id(rec)
        self.unfinished[key] = (rec, start, lane)

        def close() -> None:
            self.unfinished.pop(key, None)
            self.handles.pop(key, None)
            self.busy.discard(lane)
            self.event(rec.kind, "comm", lane, start, _now_us(), _args(rec))

        traced = _Traced(handle, close)
        if nonblocking:
            self.handles[key] = traced
        return traced

    def poll(self) -> None:
        """Test every collective in flight (at the end of each span and backward node), so
        its event ends within one node of its completion rather than at its ``wait()``."""
        for traced in list(self.handles.values()):
            traced.done()

    def write(self) -> str:
        """Write the rank's file (unfinished collectives end at the write, marked
        ``"waited": false``); returns its path."""
        end = _now_us()
        events = list(self.events)
        for rec, start, lane in self.unfinished.values():
            events.append({"name": rec.kind, "cat": "comm", "ph": "X", "ts": start, "dur": end - start,
                           "pid": self.rank, "tid": lane, "args": {**_args(rec), "waited": False}})
        meta: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                                       "args": {"name": f"rank {self.rank}"}}]
        lanes = {**{v: k for k, v in LANES.items()},
                 **{e["tid"]: f"comm in flight {e['tid'] - ASYNC_LANE}" for e in events if e["tid"] >= ASYNC_LANE}}
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": t, "args": {"name": n}}
                 for t, n in sorted(lanes.items())]
        with open(self.path, "w") as f:
            json.dump({"traceEvents": meta + sorted(events, key=lambda e: e["ts"]), "displayTimeUnit": "ms"}, f)
        return self.path


def _args(rec: Any) -> dict[str, Any]:
    return {"mesh_dim": rec.mesh_dim, "bytes_sent": rec.bytes_sent, "bytes_recv": rec.bytes_recv,
            "padded": rec.padded, "nonblocking": rec.nonblocking}


current: Trace | None = None
"""The trace being recorded (None: tracing is off)."""


def rank_path(path: str, rank: int) -> str:
    """``trace.json`` -> ``trace.rank<rank>.json``."""
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def start(path: str) -> Trace:
    """Start recording into ``path`` (per rank: :func:`rank_path`); one trace at a time."""
    global current
    if current is not None:
        raise RuntimeError(f"a trace is already being recorded (into {current.path}); stop it first")
    current = Trace(path)
    counter._active.append(current.counter)
    counter.on_started = current.started
    return current


def stop() -> str:
    """Stop recording and write the rank's file; returns its path."""
    global current
    t = current
    if t is None:
        raise RuntimeError("no trace is being recorded")
    current = None
    counter.on_started = None
    if t.counter in counter._active:
        counter._active.remove(t.counter)
    return t.write()


@contextlib.contextmanager
def trace(path: str) -> Iterator[Trace]:
    """``with dt.trace("trace.json") as t:`` records the block; each rank writes
    ``trace.rank<r>.json`` at its end (``t.path``)."""
    t = start(path)
    try:
        yield t
    finally:
        stop()


@contextlib.contextmanager
def _span(t: Trace, name: str, cat: str, tid: int) -> Iterator[None]:
    begin = _now_us()
    try:
        yield
    finally:
        t.event(name, cat, tid, begin, _now_us())
        if t.handles:
            t.poll()


_OFF = contextlib.nullcontext()


def trace_span(name: str) -> contextlib.AbstractContextManager[Any]:
    """``with dt.trace_span("forward"):`` marks a span of the user's program on the timeline
    (nothing when no trace is on)."""
    t = current
    return _OFF if t is None else _span(t, str(name), "user", LANES["spans"])


def backward_span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A backward node's (or the whole backward's) span; the caller checked a trace is on."""
    t = current
    return _OFF if t is None else _span(t, name, "backward", LANES["backward"])


def merge(paths: list[str], out: str) -> str:
    """Merge per-rank files into one (each rank is its own process track)."""
    events: list[Any] = []
    for p in paths:
        with open(p) as f:
            events.extend(json.load(f)["traceEvents"])
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return out


def _install_from_environment() -> None:
    """``DTORCH_TRACE=trace.json``: trace the whole program, written at exit."""
    path = settings.get("DTORCH_TRACE")
    if path:
        import atexit

        start(path)
        atexit.register(lambda: current is not None and stop())


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "merge" and "-o" in argv:
        i = argv.index("-o")
        print(merge(argv[1:i] + argv[i + 2:], argv[i + 1]))
        return 0
    print("usage: python -m dtorch_mpi.timeline merge trace.rank0.json trace.rank1.json ... -o trace.json",
          file=sys.stderr)
    return 2


_install_from_environment()

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
