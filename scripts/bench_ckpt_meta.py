"""Checkpoint metadata per rank vs the rank count (issue 27 item 2), before -> after the fix: the
peak bytes and CPU seconds of a save's and a load's metadata exchanges on one process, at
simulated rank counts (tests/ckpt_meta_sim.py: a stand-in communicator filled as if every rank
held this rank's values). Datasets are 2-d and Shard(0) over all ranks; "save, TP 8" writes each
dataset in 8 pieces (its tables are kept). "before" runs the exchanges the checkpoint made until
the fix (one Allgather of ranks x datasets words). "load's fast check": without tables (over the
attribute limit above ~820 pieces), the tiles of this rank's region worked out from each
dataset's written layout (pieces.layout_tiling), for the same-layout load: before it, such a load
fell back to lin64.

    PYTHONPATH=. python scripts/bench_ckpt_meta.py [--datasets 1000] [256 1024 4096 16384]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from ckpt_meta_sim import before_load, before_save, load_after, measured, save_after, sharded_owns

from dtorch_mpi.checkpoint import pieces


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="*", type=int, default=[256, 1024, 4096, 16384])
    ap.add_argument("--datasets", type=int, default=1000)
    args = ap.parse_args()
    n = args.datasets
    print(f"{n} datasets: peak MB / CPU s per rank, before -> after")
    print(f"{'ranks':>6s}  {'save (before -> after)':>34s}  {'save, TP 8 (after)':>20s}  {'load (before -> after)':>34s}"
          + "  " + "load's fast check".rjust(20))
    for p in args.sizes:
        owns = sharded_owns(p, n)
        runs = [measured(lambda: before_save(p, owns)), measured(lambda: save_after(p, owns)),
                measured(lambda: save_after(p, owns, writers=min(8, p))),
                measured(lambda: before_load(p, n)), measured(lambda: load_after(p, n)),
                measured(lambda: [pieces.layout_tiling(pieces.Layout((p,), (0,)), (3 * p, 4), (3 * (p // 2), 0), (3, 4))
                                  for _ in range(n)])]
        (_, b0, t0), (_, b1, t1), (_, b2, t2), (_, b3, t3), (_, b4, t4), (_, b5, t5) = runs
        print(f"{p:>6d}  {b0 / 1e6:9.1f} MB {t0:5.2f} s -> {b1 / 1e6:5.2f} MB {t1:5.3f} s"
              f"  {b2 / 1e6:7.2f} MB {t2:5.3f} s"
              f"  {b3 / 1e6:9.1f} MB {t3:5.2f} s -> {b4 / 1e6:5.2f} MB {t4:5.3f} s"
              f"  {b5 / 1e6:7.2f} MB {t5:5.3f} s", flush=True)


if __name__ == "__main__":
    main()
