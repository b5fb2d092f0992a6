#!/usr/bin/env python3
"""Checkpoint throughput: dt.save / dt.load vs a raw h5py MPI-IO collective write / read of
the same bytes, interleaved repeat by repeat in one run (medians of the slowest rank). Needs the
parallel-HDF5 stack:
  make install-phdf5
  PYTHONPATH=$PWD /usr/bin/mpiexec.mpich -n 2 .venv-phdf5/bin/python scripts/bench_checkpoint.py
The raw write also flushes and fsyncs (an atomic save must); the raw read reads into fresh
buffers while its previous result is still alive (as a load that changes nothing on failure
must, beside the model's current arrays). Each case runs in its own loop, ours and raw
alternating. Target: ratio <= 1.3.

"load" reads into the layout that saved the file (Shard(0)): every rank's region is one piece
the save recorded, so it is verified with that piece's xxh3. "load resharded" reads into
Shard(1) (the raw read then reads the same column blocks): written pieces reach partly into the
regions, so it is verified with lin64, as is "load no table" (the same reads as "load", from a
copy of the file without piece tables, as written before them). "load replicated" reads the
whole of every dataset on every rank (a Replicate target; the raw read reads it whole too): the
written pieces tile it, so each is checked by its xxh3. The "verified by" line says which check
each took.

Beside each time, the peak memory the call allocates (tracemalloc, which sees NumPy buffers;
largest rank, in a separate untimed call). Then the cost of the per-dataset checksums (the
same save/load with the checksum replaced by zero, interleaved). On the pip stack (no MPI in
h5py) pass --no-raw: only the checksum cost and the memory rows are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable

import h5py
import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi.checkpoint import pieces, reader, writer

WORLD = MPI.COMM_WORLD


def once(fn: Callable[[], object]) -> float:
    """One call's time on the slowest rank, ranks starting together."""
    WORLD.Barrier()
    start = time.perf_counter()
    fn()
    WORLD.Barrier()
    return float(WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX))


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak bytes ``fn`` allocates (tracemalloc), largest rank, in MiB."""
    WORLD.Barrier()
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return float(WORLD.allreduce(peak, op=MPI.MAX)) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", default="64,256", help="checkpoint sizes in MB")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--reps", type=int, default=21)  # medians of 5 swung 1.1-1.9x on this 2-core machine
    ap.add_argument("--no-raw", action="store_true", help="skip the raw MPI-IO comparison (needs parallel h5py)")
    ap.add_argument("--ops", default="save,load,load chunks,load resharded,load replicated,load no table,checksums",
                    help="cases to run (comma-separated; 'checksums': the cost of the checks)")
    args = ap.parse_args()
    if not args.no_raw and not h5py.get_config().mpi:
        raise SystemExit("the raw comparison needs h5py with MPI (make install-phdf5); or pass --no-raw")
    m, rank = WORLD.Get_size(), WORLD.Get_rank()
    mesh = dt.init_device_mesh("cpu", (m,))
    directory = WORLD.bcast(tempfile.mkdtemp(prefix="dtorch-bench-", dir=os.environ.get("BENCH_DIR")) if rank == 0 else None)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"ranks={m}  {args.tensors} tensors, float32, Shard(0)  (median of {args.reps}, slowest rank, interleaved)  "
        f"load average {os.getloadavg()[0]:.2f}")
    say("ratio: of the medians; best: of the fastest repeats (the steadier figure on a busy machine)")
    say(f"{'size':>6} {'op':<15} {'dtorch s':>9} {'raw s':>8} {'ratio':>6} {'best':>5} {'dtorch peak MiB':>16} "
        f"{'raw peak MiB':>13}")
    for mb in (int(v) for v in args.mb.split(",")):
        rows = (mb << 20) // 4 // args.tensors // 1024
        shape = (rows, 1024)
        state = {f"layer{i}.weight": dt.ones(*shape, device_mesh=mesh, placements=[dt.Shard(0)]) for i in range(args.tensors)}
        target = {k: dt.zeros(*shape, device_mesh=mesh, placements=[dt.Shard(0)]) for k in state}
        columns = {k: dt.zeros(*shape, device_mesh=mesh, placements=[dt.Shard(1)]) for k in state}
        whole = {k: dt.zeros(*shape, device_mesh=mesh, placements=[dt.Replicate()]) for k in state}
        ours_path = os.path.join(directory, "ours.h5")
        raw_path = os.path.join(directory, "raw.h5")
        _, offset = dt.compute_local_shape_and_offset(shape, mesh, [dt.Shard(0)])
        col_shape, col_offset = dt.compute_local_shape_and_offset(shape, mesh, [dt.Shard(1)])
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

        # The raw reads keep their previous result alive until the new one is complete, as a
        # model's parameters are while dt.load reads their replacements: without that the raw
        # read's fresh buffers came back from the allocator already faulted in (its previous
        # result freed first), and a raw read without page faults is 2.5x faster (64 MB).
        previous: list[list[np.ndarray]] = [[]]

        def raw_read() -> list[np.ndarray]:
            fresh = []  # every piece kept, as a load that changes nothing until all are read must
            with h5py.File(raw_path, "r", driver="mpio", comm=WORLD) as f:
                for k, piece in pieces.items():
                    ds = f[k.replace(".", "/")]
                    fresh.append(np.empty_like(piece))
                    with ds.collective:
                        ds.read_direct(fresh[-1], np.s_[offset[0] : offset[0] + piece.shape[0]])
            previous[0] = fresh
            return fresh

        def raw_read_columns() -> list[np.ndarray]:
            fresh = []  # independent reads, as dt.load makes (collective two-phase reads of columns are slower here)
            with h5py.File(raw_path, "r", driver="mpio", comm=WORLD) as f:
                for k in pieces:
                    fresh.append(np.empty(col_shape, dtype=np.float32))
                    f[k.replace(".", "/")].read_direct(fresh[-1], np.s_[:, col_offset[1] : col_offset[1] + col_shape[1]])
            previous[0] = fresh
            return fresh

        def raw_read_whole() -> list[np.ndarray]:
            fresh = []
            with h5py.File(raw_path, "r", driver="mpio", comm=WORLD) as f:
                for k in pieces:
                    fresh.append(np.empty(shape, dtype=np.float32))
                    f[k.replace(".", "/")].read_direct(fresh[-1])
            previous[0] = fresh
            return fresh

        cases: dict[str, tuple[Callable[[], object], Callable[[], object] | None]] = {
            "save": (lambda: dt.save(state, ours_path), None if args.no_raw else raw_write),
            "load": (lambda: dt.load(ours_path, target), None if args.no_raw else raw_read),
            "load chunks": (lambda: dt.load(ours_path, target, staging="chunks"), None if args.no_raw else raw_read),
            "load resharded": (lambda: dt.load(ours_path, columns), None if args.no_raw else raw_read_columns),
            "load replicated": (lambda: dt.load(ours_path, whole), None if args.no_raw else raw_read_whole),
            "load no table": (lambda: dt.load(old_path, target), None if args.no_raw else raw_read),
        }
        ops = args.ops.split(",")
        cases = {op: fns for op, fns in cases.items() if op in ops}
        dt.save(state, ours_path)  # the loads need the files even when the saves are not timed
        old_path = os.path.join(directory, "old.h5")
        if rank == 0:
            shutil.copyfile(ours_path, old_path)
            with h5py.File(old_path, "r+") as f:
                for k in state:
                    del f[k.replace(".", "/")].attrs["pieces"]
        WORLD.Barrier()
        if not args.no_raw:
            raw_write()
        times: dict[tuple[str, int], list[float]] = {}
        # one case at a time, ours and raw alternating within it: interleaving all cases let the
        # raw read reuse heap memory another case had just faulted in (4.5 ms instead of 12 ms at
        # 64 MB: no page faults) while dt.load's buffers faulted, swinging the ratio 1.05 <-> 1.8
        for op, fns in cases.items():
            pairs = list(enumerate(fns))
            for rep in range(args.reps):
                for n, fn in pairs if rep % 2 == 0 else pairs[::-1]:  # alternate who goes first (cache, allocator)
                    if fn is not None:
                        times.setdefault((op, n), []).append(once(fn))
        for op, (ours, raw) in cases.items():
            t_ours, p_ours = statistics.median(times[(op, 0)]), peak_mib(ours)
            if raw is None:
                say(f"{mb:>4}MB {op:<15} {t_ours:>9.3f} {'-':>8} {'-':>6} {'-':>5} {p_ours:>16.1f} {'-':>13}")
            else:
                t_raw, p_raw = statistics.median(times[(op, 1)]), peak_mib(raw)
                best = min(times[(op, 0)]) / min(times[(op, 1)])
                say(f"{mb:>4}MB {op:<15} {t_ours:>9.3f} {t_raw:>8.3f} {t_ours / t_raw:>6.2f} {best:>5.2f} {p_ours:>16.1f} "
                    f"{p_raw:>13.1f}")
        checks = {}
        for op, tgt, file in (("load", target, ours_path), ("load resharded", columns, ours_path),
                              ("load replicated", whole, ours_path), ("load no table", target, old_path)):
            dt.load(file, tgt)
            checks[op] = sorted(set(reader.VERIFIED.values()))
        say(f"{mb:>4}MB verified by: " + ", ".join(f"{op}: {'/'.join(kinds)}" for op, kinds in checks.items()))
        share = WORLD.allreduce(sum(v.to_local().nbytes for v in target.values()), op=MPI.MAX) / 2**20
        say(f"{mb:>4}MB (this rank's share of the model: {share:,.1f} MiB)")
        if "checksums" in ops:
            checksum_cost(mb, state, target, ours_path, args.reps)
    say(f"load average at the end {os.getloadavg()[0]:.2f}")
    WORLD.Barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    mesh.free()


class _Unchecked:
    """pieces.TileDigests that hashes nothing and never finds a mismatch (the cost without xxh3)."""

    def __init__(self, tiles: object) -> None:
        pass

    def update(self, row: int, block: object) -> None:
        pass

    def mismatched(self) -> bool:
        return False


def checksum_cost(mb: int, state: dict, target: dict, path: str, reps: int) -> None:
    """save/load with checksums vs the same code with both checks (lin64 and xxh3) replaced by 0
    (interleaved; the load is the same-layout one, so "with" is its xxh3 check)."""
    real = {"checksum": reader.checksum, "digest": reader.digest}
    users = [(module, name) for module in (writer, reader, pieces) for name in real if hasattr(module, name)]
    tiles = pieces.TileDigests
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(reps):
        for on in (True, False):
            for module, name in users:
                setattr(module, name, real[name] if on else (lambda *a: 0))
            pieces.TileDigests = tiles if on else _Unchecked  # type: ignore[misc]
            times.setdefault(("save", on), []).append(once(lambda: dt.save(state, path)))
            times.setdefault(("load", on), []).append(once(lambda: dt.load(path, target)))
    for module, name in users:
        setattr(module, name, real[name])
    pieces.TileDigests = tiles  # type: ignore[misc]
    dt.save(state, path)  # leave a checksummed file
    if WORLD.Get_rank() == 0:
        for op in ("save", "load"):
            on, off = statistics.median(times[(op, True)]), statistics.median(times[(op, False)])
            best = min(times[(op, True)]) / min(times[(op, False)])
            print(f"{mb:>4}MB {op} with checksums {on:.3f} s, without {off:.3f} s: ratio {on / off:.2f} (best {best:.2f})")


if __name__ == "__main__":
    main()
