#!/usr/bin/env python3
"""Checkpoint throughput: dt.save / dt.load vs a raw h5py MPI-IO collective write / read of
the same bytes, side by side in one run. Needs the parallel-HDF5 stack:
  make install-phdf5
  /usr/bin/mpiexec.mpich -n 4 .venv-phdf5/bin/python scripts/bench_checkpoint.py
The raw write also flushes and fsyncs (an atomic save must). Target: within 1.3x.

Then, on either stack: the cost of the per-dataset checksums (the same save/load with the
checksum function replaced by zero: target <= 1.10x), and the peak memory a load allocates on
top of the model (tracemalloc, which sees NumPy buffers; largest rank) for staging="all" and
staging="chunks":
  .venv/bin/mpiexec -n 2 .venv/bin/python scripts/bench_checkpoint.py --mb 256 --no-raw
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import h5py
import numpy as np
from benchtools import timed
from mpi4py import MPI

import dtorch_mpi as dt

WORLD = MPI.COMM_WORLD


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", default="64,256", help="checkpoint sizes in MB")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-raw", action="store_true", help="skip the raw MPI-IO comparison (needs parallel h5py)")
    args = ap.parse_args()
    if not args.no_raw and not h5py.get_config().mpi:
        raise SystemExit("the raw comparison needs h5py with MPI (make install-phdf5); or pass --no-raw")
    m, rank = WORLD.Get_size(), WORLD.Get_rank()
    mesh = dt.init_device_mesh("cpu", (m,))
    directory = WORLD.bcast(tempfile.mkdtemp(prefix="dtorch-bench-", dir=os.environ.get("BENCH_DIR")) if rank == 0 else None)
    if rank == 0:
        print(f"ranks={m}  {args.tensors} tensors, float32, Shard(0)  (median of {args.reps}, slowest rank)")
    if rank == 0 and not args.no_raw:
        print(f"{'size':>6} {'op':<5} {'dtorch s':>9} {'raw s':>8} {'dtorch MB/s':>12} {'raw MB/s':>9} {'ratio':>6}")
    for mb in (int(v) for v in args.mb.split(",")):
        rows = (mb << 20) // 4 // args.tensors // 1024
        shape = (rows, 1024)
        state = {f"layer{i}.weight": dt.ones(*shape, device_mesh=mesh, placements=[dt.Shard(0)]) for i in range(args.tensors)}
        ours_path = os.path.join(directory, "ours.h5")
        raw_path = os.path.join(directory, "raw.h5")
        _, offset = dt.compute_local_shape_and_offset(shape, mesh, [dt.Shard(0)])
        pieces = {k: v.to_local() for k, v in state.items()}

        def raw_write() -> None:
            with h5py.File(raw_path, "w", driver="mpio", comm=WORLD) as f:
                for k, piece in pieces.items():
                    ds = f.create_dataset(k.replace(".", "/"), shape=shape, dtype=np.float32)
                    with ds.collective:
                        ds[offset[0] : offset[0] + piece.shape[0]] = piece
                f.flush()
            if rank == 0:
                fd = os.open(raw_path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

        def raw_read() -> None:
            with h5py.File(raw_path, "r", driver="mpio", comm=WORLD) as f:
                for k, piece in pieces.items():
                    ds = f[k.replace(".", "/")]
                    with ds.collective:
                        ds.read_direct(np.empty_like(piece), np.s_[offset[0] : offset[0] + piece.shape[0]])

        target = {k: dt.zeros(*shape, device_mesh=mesh, placements=[dt.Shard(0)]) for k in state}
        if not args.no_raw:
            results = [
                ("save", timed(lambda: dt.save(state, ours_path), args.reps, warmup=False, after=WORLD.Barrier),
                 timed(raw_write, args.reps, warmup=False, after=WORLD.Barrier)),
                ("load", timed(lambda: dt.load(ours_path, target), args.reps, warmup=False, after=WORLD.Barrier),
                 timed(raw_read, args.reps, warmup=False, after=WORLD.Barrier)),
            ]
            if rank == 0:
                for op, ours, raw in results:
                    print(f"{mb:>4}MB {op:<5} {ours:>9.3f} {raw:>8.3f} {mb / ours:>12.0f} {mb / raw:>9.0f} {ours / raw:>6.2f}")
        checksum_cost(mb, state, target, ours_path, args.reps)
        load_memory(mb, target, ours_path)
    WORLD.Barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    mesh.free()


def checksum_cost(mb: int, state: dict, target: dict, path: str, reps: int) -> None:
    """save/load with checksums vs the same code with the checksum replaced by 0 (interleaved)."""
    from dtorch_mpi.checkpoint import hdf5, reader

    real = hdf5.checksum
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(reps):
        for on in (True, False):
            hdf5.checksum = reader.checksum = real if on else (lambda *a: 0)  # type: ignore[assignment]
            times.setdefault(("save", on), []).append(timed(lambda: dt.save(state, path), 1, warmup=False, after=WORLD.Barrier))
            times.setdefault(("load", on), []).append(timed(lambda: dt.load(path, target), 1, warmup=False, after=WORLD.Barrier))
    hdf5.checksum = reader.checksum = real
    dt.save(state, path)  # leave a checksummed file
    if WORLD.Get_rank() == 0:
        for op in ("save", "load"):
            on, off = statistics.median(times[(op, True)]), statistics.median(times[(op, False)])
            print(f"{mb:>4}MB {op} with checksums {on:.3f} s, without {off:.3f} s: ratio {on / off:.3f}")


def load_memory(mb: int, target: dict, path: str) -> None:
    """Peak bytes a load allocates (tracemalloc; the largest rank) for each staging mode."""
    import tracemalloc

    for staging in ("all", "chunks"):
        WORLD.Barrier()
        tracemalloc.start()
        dt.load(path, target, staging=staging)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        worst = WORLD.allreduce(peak, op=MPI.MAX)
        share = sum(v.to_local().nbytes for v in target.values())
        share = WORLD.allreduce(share, op=MPI.MAX)
        if WORLD.Get_rank() == 0:
            print(f"{mb:>4}MB load staging={staging!r}: peak extra {worst / 2**20:,.1f} MiB per rank "
                  f"(this rank's share of the model: {share / 2**20:,.1f} MiB)")



if __name__ == "__main__":
    main()
