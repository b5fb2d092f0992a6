"""Checkpoint metadata at simulated scale (issue 27 item 2): a save's and a load's metadata
exchanges at 4,096 ranks x 1,000 datasets, on one process (ckpt_meta_sim.py: a stand-in
communicator filled as if the writing ranks held this rank's values), within 20 MB and 0.3 s
of CPU per rank; before the fix the save's Allgather alone was 229 MB (scripts/bench_ckpt_meta.py
prints both)."""

from __future__ import annotations

import numpy as np
from ckpt_meta_sim import big_term, expected_sum, load_after, measured, save_after, sharded_owns
from conftest import RUN_ONCE

from dtorch_mpi.checkpoint import pieces

pytestmark = RUN_ONCE  # pure simulations on a stand-in communicator: no rank count or path changes them

P, DATASETS = 4096, 1000
GOAL_BYTES, GOAL_SECONDS = 20 * 10**6, 0.3


def test_a_sharded_save_at_4096_ranks_exchanges_metadata_per_dataset_not_per_rank() -> None:
    """Every dataset Shard(0) over 4,096 ranks: one Allreduce of 3 words a dataset (the tables,
    4,096 pieces each, are over the attribute limit: neither hashed nor gathered), then one of a
    word a dataset for the sums of the pieces' seeded digests that take their place."""
    owns = sharded_owns(P, DATASETS)
    sums, peak, seconds = measured(lambda: save_after(P, owns))
    assert peak <= GOAL_BYTES and seconds <= GOAL_SECONDS, (peak, seconds)
    small = measured(lambda: save_after(64, owns))[1]
    assert peak <= small + 64 * P, (peak, small)  # O(datasets + ranks), not ranks x datasets
    for k, summary in enumerate(sums):
        assert summary.checksum == expected_sum(big_term(k), P) and summary.written == 12 * P and summary.table is None
        assert summary.xxsum == expected_sum(pieces.seeded_digest(owns[k].piece[2], (0, 0)), P)  # type: ignore[index]


def test_a_save_whose_tables_fit_gathers_only_the_writers_rows() -> None:
    """4,096 ranks, each dataset written in 8 pieces (a TP group of 8; the other copies write
    nothing): every table is kept (8 rows, rank order) and the exchange is still within goal."""
    owns = sharded_owns(P, DATASETS)
    sums, peak, seconds = measured(lambda: save_after(P, owns, writers=8))
    assert peak <= GOAL_BYTES and seconds <= GOAL_SECONDS, (peak, seconds)
    small = measured(lambda: save_after(64, owns, writers=8))[1]
    assert peak <= small + 64 * P, (peak, small)  # the one count per rank of the Allgather
    row = np.array([0, 0, 3, 4, pieces.digest(owns[0].piece[2])], dtype=np.uint64)  # type: ignore[index]
    for k, summary in enumerate(sums):
        assert summary.checksum == expected_sum(big_term(k), 8) and summary.written == 12 * 8
        assert summary.table is not None and np.array_equal(summary.table, np.tile(row, (8, 1))), summary.table


def test_tables_over_the_limit_are_left_out_at_any_rank_count() -> None:
    """The kept/left-out choice is the table's size: 819 two-d pieces fit the 32 KiB attribute, 820 do not."""
    owns = sharded_owns(820, 2)
    assert pieces.table_bytes(819, 2) <= pieces.MAX_TABLE_BYTES < pieces.table_bytes(820, 2)
    assert save_after(820, owns, writers=819)[0].table is not None
    assert all(s.table is None for s in save_after(820, owns))


def test_a_load_at_4096_ranks_reduces_its_checksums() -> None:
    """The load's verdicts: one Allreduce of 2 words a dataset plus a status word."""
    sums, peak, seconds = measured(lambda: load_after(P, DATASETS))
    assert peak <= GOAL_BYTES and seconds <= GOAL_SECONDS, (peak, seconds)
    small = measured(lambda: load_after(64, DATASETS))[1]
    assert peak <= small + 64 * P, (peak, small)  # O(datasets + ranks), not ranks x datasets
    assert sums == [expected_sum(big_term(k), P) for k in range(DATASETS)] + [P] * DATASETS


def test_a_load_at_4096_ranks_keeps_the_fast_check_without_tables() -> None:
    """No table (4,096 pieces each): the fast check comes from each dataset's written layout and
    the split rule (pieces.layout_tiling), visiting only the pieces in this rank's region, so the
    same-layout load of 1,000 datasets takes the sum check on every rank within goal."""
    layout = pieces.Layout((P,), (0,))
    shape = (3 * P + 5, 4)  # uneven: the first 5 pieces have 4 rows
    for rank in (0, 7, P - 1):
        size, at = (4, 4 * rank) if rank < 5 else (3, 3 * rank + 5)
        tiles, peak, seconds = measured(lambda: [pieces.layout_tiling(layout, shape, (at, 0), (size, 4))
                                                 for _ in range(DATASETS)])
        assert peak <= GOAL_BYTES and seconds <= GOAL_SECONDS, (peak, seconds)
        assert all(t == (((0, 0), (size, 4), pieces.seed((at, 0))),) for t in tiles), tiles[0]
    whole = pieces.layout_tiling(layout, shape, (0, 0), shape)  # a replicated target: every piece
    assert whole is not None and len(whole) == P
