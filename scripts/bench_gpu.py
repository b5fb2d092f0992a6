#!/usr/bin/env python3
"""Short GPU benchmark: redistribute of CuPy pieces vs the raw collective of the same bytes.

Run under mpiexec on a GPU machine (scripts/gpu_check.sh does). The raw baseline is what the
selected backend does by hand: host staging (device -> host -> MPI -> device), or NCCL /
CUDA-aware MPI on device buffers.

``--nccl`` (one rank per GPU; NCCL refuses two ranks on one GPU): the NCCL backend's
``reduce_scatter`` (``ncclReduceScatter``, padded when uneven) and ``all_to_all`` (grouped
``ncclSend``/``ncclRecv``) against the raw CuPy NCCL calls moving the same bytes, each result
checked against NumPy. The backend object is called directly (the prologue would answer a
one-rank group without NCCL), so one GPU still runs every NCCL call the backend makes.
"""

from __future__ import annotations

import argparse
from typing import Any

import cupy
import numpy as np
from benchtools import timed
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.comm import Group, backend_for
from dtorch_mpi.comm.gpu import NCCLBackend
from dtorch_mpi.split import split_sizes

WORLD = MPI.COMM_WORLD


def _row(case: str, shape: tuple[int, ...], t: float, r: float, ok: bool | None = None) -> None:
    if WORLD.Get_rank() == 0:
        verdict = "" if ok is None else "  ok" if ok else "  MISMATCH"
        print(f"{case:<18} {shape!s:>13} {t * 1e3:>10.3f} {r * 1e3:>9.3f} {t / r:>6.2f}{verdict}")


def nccl_cases() -> None:
    """The NCCL backend's reduce_scatter and all_to_all vs raw cupy.cuda.nccl calls."""
    from cupy.cuda import nccl

    comm = WORLD.Dup()
    m, me = comm.Get_size(), comm.Get_rank()
    cupy.cuda.Device(me % cupy.cuda.runtime.getDeviceCount()).use()
    backend, group = NCCLBackend(), Group(comm, 0)
    raw = backend._nccl(group)  # the same communicator, driven by hand below
    stream = cupy.cuda.get_current_stream()
    f32 = nccl.NCCL_FLOAT32
    if me == 0:
        print(f"ranks={m} backend=nccl (called directly)")
        print(f"{'case':<18} {'shape':>13} {'dtorch ms':>10} {'raw ms':>9} {'ratio':>6}  vs NumPy")
    for shape in ((4096, 1024), (4099, 1023)):
        full = np.random.default_rng(0).integers(-9, 9, size=shape).astype(np.float32)
        rows = split_sizes(shape[0], m)
        cols = split_sizes(shape[1], m)
        mine = (sum(rows[:me]), sum(rows[: me + 1]))
        # P -> S(0): every rank holds the whole array; rank i keeps rows block i of the sum
        send = cupy.asarray(full)
        out = cupy.empty((rows[me], shape[1]), np.float32)
        width = max(rows) * shape[1]
        padded = cupy.zeros(m * width, np.float32)  # the raw call's input, padded once, outside the timing
        for i, (n, o) in enumerate(zip(rows, np.cumsum([0, *rows[:-1]]))):
            padded[i * width : i * width + n * shape[1]] = send[o : o + n].reshape(-1)
        recv = cupy.empty(width, np.float32)

        def ours_rs() -> Any:
            return backend.reduce_scatter(group, send, out, 0, rows, "sum").wait()

        def raw_rs() -> None:
            raw.reduceScatter(padded.data.ptr, recv.data.ptr, width, f32, nccl.NCCL_SUM, stream.ptr)

        ok = bool(np.array_equal(cupy.asnumpy(ours_rs()), full[mine[0] : mine[1]] * m))
        t, r = timed(ours_rs, 10, comm, after=stream.synchronize), timed(raw_rs, 10, comm, after=stream.synchronize)
        _row("P->S(0) nccl", shape, t, r, bool(comm.allreduce(ok, op=MPI.LAND)))
        # S(0) -> S(1): block j of my rows (columns block j) goes to rank j
        piece = cupy.asarray(full[mine[0] : mine[1]])
        out2 = cupy.empty((shape[0], cols[me]), np.float32)
        blocks = [cupy.ascontiguousarray(piece[:, o : o + n]) for n, o in zip(cols, np.cumsum([0, *cols[:-1]]))]
        landing = [cupy.empty((rows[j], cols[me]), np.float32) for j in range(m)]

        def ours_a2a() -> Any:
            return backend.all_to_all(group, piece, out2, 1, cols, 0, rows).wait()

        def raw_a2a() -> None:
            nccl.groupStart()
            for j in range(m):
                raw.send(blocks[j].data.ptr, blocks[j].size, f32, j, stream.ptr)
                raw.recv(landing[j].data.ptr, landing[j].size, f32, j, stream.ptr)
            nccl.groupEnd()

        c0 = sum(cols[:me])
        ok = bool(np.array_equal(cupy.asnumpy(ours_a2a()), full[:, c0 : c0 + cols[me]]))
        t, r = timed(ours_a2a, 10, comm, after=stream.synchronize), timed(raw_a2a, 10, comm, after=stream.synchronize)
        _row("S(0)->S(1) nccl", shape, t, r, bool(comm.allreduce(ok, op=MPI.LAND)))
    comm.Free()  # releases the NCCL communicator attached to it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nccl", action="store_true", help="the NCCL backend vs raw NCCL (one rank per GPU)")
    if ap.parse_args().nccl:
        nccl_cases()
        return
    m = WORLD.Get_size()
    mesh = dt.init_device_mesh("cuda", (m,))
    name = backend_for("cuda").name
    if WORLD.Get_rank() == 0:
        print(f"ranks={m} backend={name} device={cupy.cuda.Device().id}")
        print(f"{'case':<18} {'shape':>13} {'dtorch ms':>10} {'raw ms':>9} {'ratio':>6}")
    for shape in ((4096, 1024), (4099, 1023)):
        full = cupy.ones(shape, dtype=cupy.float32)
        x = dt.distribute_tensor(full, mesh, [dt.Shard(0)], src_data_rank=None)
        p = dt.distribute_tensor(full, mesh, [dt.Partial()], src_data_rank=None)
        piece = x.to_local()
        rows = max(dt.split.split_sizes(shape[0], m))

        def raw_gather() -> None:
            host = np.zeros((rows, shape[1]), np.float32)
            host[: piece.shape[0]] = cupy.asnumpy(piece)
            out = np.empty((m * rows, shape[1]), np.float32)
            WORLD.Allgather(host, out)
            cupy.asarray(out)

        def raw_reduce() -> None:
            host = cupy.asnumpy(p.to_local())
            out = np.empty_like(host)
            WORLD.Allreduce(host, out)
            cupy.asarray(out)

        for case, ours, raw in (("S(0)->R", lambda: x.redistribute(placements=[dt.Replicate()]), raw_gather),
                                ("P->R", lambda: p.redistribute(placements=[dt.Replicate()]), raw_reduce)):
            sync = cupy.cuda.get_current_stream().synchronize
            _row(case, shape, timed(ours, 10, after=sync), timed(raw, 10, after=sync))
    mesh.free()


if __name__ == "__main__":
    main()
