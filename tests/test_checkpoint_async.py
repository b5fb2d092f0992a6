"""Asynchronous checkpoint saves (``save(..., async_op=True)``): the file holds the values at the
time of the call although the caller changes them before ``wait()``; the same bytes as a blocking
save; saves in a row; a load and the next save wait for the pending one; a failed write raised by
``wait()`` on every rank with the previous file intact; memory flat over many saves. Runs on both
HDF5 stacks (serial h5py: in turn; parallel h5py: collective MPI-IO from the writer thread)."""

from __future__ import annotations

import os
import sys
import threading
import tracemalloc
from typing import Any

import h5py
import numpy as np
import pytest
from conftest import RANK, SIZE, Checker
from helpers import a_writing_rank, full_value, make_pieces
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.checkpoint import writer as ck

pytestmark = pytest.mark.path_independent

WORLD = MPI.COMM_WORLD
LAYOUTS = [[dt.Shard(0)], [dt.Shard(1)], [dt.Replicate()], [dt.Partial("sum")]]
# first lengths below, equal to, not divisible by the rank count, and zero
SHAPES = [(max(SIZE - 1, 1), 3), (SIZE, 2), (SIZE + 1, 3), (2 * SIZE + 3, 1), (0, 2)]


def training_state(mesh: dt.DeviceMesh, shape: tuple[int, ...]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """DTensors of every layout, a complete array and a scalar; their full values."""
    fulls: dict[str, np.ndarray] = {}
    sd: dict[str, Any] = {}
    for i, plc in enumerate(LAYOUTS):
        full = full_value(shape, i)
        fulls[f"layer{i}.w"] = full
        sd[f"layer{i}.w"] = dt.DTensor.from_local(make_pieces(full, mesh, plc), mesh, plc, shape=shape)
    fulls["table"] = full_value((3, 2), 9)
    sd["table"] = fulls["table"].copy()
    sd["step"] = 7
    return fulls, sd


def change_in_place(sd: dict[str, Any]) -> None:
    """What a training step does to the state: every local buffer overwritten in place."""
    for value in sd.values():
        if isinstance(value, dt.DTensor):
            value.to_local()[...] = -5.0
        elif isinstance(value, np.ndarray):
            value[...] = -5.0


def loaded(mesh: dt.DeviceMesh, path: str, shape: tuple[int, ...]) -> dict[str, Any]:
    tgt: dict[str, Any] = {f"layer{i}.w": dt.zeros(*shape, dtype=np.float64, device_mesh=mesh,
                                                   placements=[dt.Shard(0)]) for i in range(len(LAYOUTS))}
    tgt.update(table=None, step=0)
    return dt.load(path, tgt)


def datasets(path: str) -> dict[str, bytes]:
    """Every dataset's bytes and attributes but the per-rank piece table (rank 0 reads)."""
    out: dict[str, bytes] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()].tobytes() + repr(
            sorted((k, repr(v)) for k, v in obj.attrs.items())).encode())
            if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_async_save_holds_the_values_at_save_time(mesh1d: dt.DeviceMesh, shared_dir: str, check: Checker,
                                                  shape: tuple[int, ...]) -> None:
    fulls, sd = training_state(mesh1d, shape)
    blocking = os.path.join(shared_dir, "blocking.h5")
    dt.save(sd, blocking)
    path = os.path.join(shared_dir, "async.h5")
    h = dt.save(sd, path, async_op=True)
    check.true(isinstance(h, dt.SaveHandle), "save(async_op=True) returns a SaveHandle")
    change_in_place(sd)  # before wait(): the file must not see it
    assert h is not None
    h.wait()
    check.true(h.done(), "done() after wait()")
    out = loaded(mesh1d, path, shape)
    for key, full in fulls.items():
        got = out[key].full_tensor() if isinstance(out[key], dt.DTensor) else out[key]
        check.equal(got, full, f"{key} {shape}")
    check.equal(out["step"], 7, "step")
    if RANK == 0:
        check.true(datasets(path) == datasets(blocking), "the async file holds what a blocking save writes")
    check.done()


def test_saves_in_a_row_and_a_load_wait_for_the_pending_one(mesh1d: dt.DeviceMesh, shared_dir: str,
                                                            check: Checker) -> None:
    shape = (SIZE + 1, 3)
    fulls, sd = training_state(mesh1d, shape)
    first, second = (os.path.join(shared_dir, f"{n}.h5") for n in ("first", "second"))
    h1 = dt.save(sd, first, async_op=True)
    change_in_place(sd)
    h2 = dt.save(sd, second, async_op=True)  # waits for h1 first
    assert h1 is not None and h2 is not None
    check.true(h1.done(), "the next save finished the previous one")
    out = loaded(mesh1d, second, shape)  # no wait(): load waits for h2
    check.true(h2.done(), "load finished the pending save")
    h2.wait()  # already finished: returns at once
    for key in fulls:
        got = out[key].full_tensor() if isinstance(out[key], dt.DTensor) else out[key]
        partial = isinstance(sd[key], dt.DTensor) and sd[key].placements[0].is_partial()
        check.equal(got, np.full_like(fulls[key], -5.0 * (SIZE if partial else 1)), f"second: {key}")
    out = loaded(mesh1d, first, shape)
    for key, full in fulls.items():
        got = out[key].full_tensor() if isinstance(out[key], dt.DTensor) else out[key]
        check.equal(got, full, f"first: {key}")
    check.done()


def test_a_failed_write_is_raised_by_wait_on_every_rank(mesh1d: dt.DeviceMesh, shared_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    shape = (SIZE + 1, 3)
    _, sd = training_state(mesh1d, shape)
    path = os.path.join(shared_dir, "ck.h5")
    dt.save(sd, path)
    WORLD.Barrier()
    before = open(path, "rb").read() if RANK == 0 else b""
    real = ck._write_slab
    writer = a_writing_rank()

    def failing(*args: Any, **kwargs: Any) -> None:
        """In the writer thread: the write completes (a collective MPI-IO write must be made by
        every rank), then reports an I/O error on one writing rank only, as an ENOSPC does."""
        real(*args, **kwargs)
        if writer == RANK:
            raise OSError(28, "No space left on device (planted)")

    monkeypatch.setattr(ck, "_write_slab", failing)
    h = dt.save(sd, path, async_op=True)  # the preparation succeeds: the failure is in the write
    assert h is not None
    with pytest.raises(dt.CheckpointError, match="planted"):
        h.wait()
    with pytest.raises(dt.CheckpointError, match="planted"):
        h.wait()  # asked again, the same answer
    # a failure nobody waited for is raised by the next save, before it starts
    dt.save(sd, path, async_op=True)
    with pytest.raises(dt.CheckpointError, match="planted"):
        dt.save(sd, path)
    monkeypatch.setattr(ck, "_write_slab", real)
    WORLD.Barrier()
    if RANK == 0:
        assert open(path, "rb").read() == before, "the previous checkpoint changed"
        assert sorted(os.listdir(shared_dir)) == ["ck.h5"], os.listdir(shared_dir)


def test_memory_is_flat_over_async_saves(mesh1d: dt.DeviceMesh, shared_dir: str) -> None:
    _, sd = training_state(mesh1d, (64 * SIZE + 1, 128))  # state large beside h5py's own caches
    path = os.path.join(shared_dir, "ck.h5")
    tracemalloc.start()
    try:
        sizes = []
        for _ in range(12):
            h = dt.save(sd, path, async_op=True)
            assert h is not None
            h.wait()  # no gc.collect(): a save leaves no cycles (test_checkpoint checks it)
            sizes.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    state_bytes = sum(v.to_local().nbytes for v in sd.values() if isinstance(v, dt.DTensor))
    grown = sizes[-1] - sizes[4]  # a copy kept per save would grow >= 7 x state_bytes here
    assert grown < 2 * state_bytes, f"memory grew by {grown} bytes over 7 saves (state {state_bytes}): {sizes}"


def test_the_writer_thread_runs_at_the_save_nice_value(mesh1d: dt.DeviceMesh, shared_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The write runs at ``DTORCH_SAVE_NICE`` on its own thread (Linux: a per-thread nice value),
    never above the priority the process had; the calling thread keeps its own."""
    if not sys.platform.startswith("linux"):
        pytest.skip("a per-thread nice value is Linux's")
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("without MPI_THREAD_MULTIPLE the write runs on the calling thread")
    _, sd = training_state(mesh1d, (SIZE + 1, 3))
    path = os.path.join(shared_dir, "ck.h5")
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    real = ck._write_slab
    seen: list[tuple[int, int]] = []

    def recording(*args: Any, **kwargs: Any) -> None:
        tid = threading.get_native_id()
        seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))
        real(*args, **kwargs)

    monkeypatch.setattr(ck, "_write_slab", recording)
    for nice in (13, 0):
        monkeypatch.setenv("DTORCH_SAVE_NICE", str(nice))
        seen.clear()
        h = dt.save(sd, path, async_op=True)
        assert h is not None
        h.wait()
        assert seen or a_writing_rank() != RANK, "the writing rank wrote nothing"
        assert all(tid != threading.get_native_id() for tid, _ in seen), "the write ran on the calling thread"
        assert {value for _, value in seen} <= {max(nice, base)}, (nice, base, seen)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base, "the caller's priority changed"


def test_a_bad_save_nice_value_raises_on_every_rank(mesh1d: dt.DeviceMesh, shared_dir: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A value out of range on one rank (settings are read per process) raises on every rank,
    naming it, before anything is written."""
    _, sd = training_state(mesh1d, (SIZE + 1, 3))
    if RANK == SIZE - 1:
        monkeypatch.setenv("DTORCH_SAVE_NICE", "20")
    path = os.path.join(shared_dir, "ck.h5")
    with pytest.raises(ValueError, match="DTORCH_SAVE_NICE='20' must be an integer from 0 to 19"):
        dt.save(sd, path, async_op=True)
    assert os.listdir(shared_dir) == [], os.listdir(shared_dir)
    dt.save(sd, path)  # a blocking save does not read it
    assert os.path.exists(path)
