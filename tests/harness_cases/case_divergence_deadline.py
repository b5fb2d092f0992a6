"""Planted divergences the default check bounds by the deadline or by the call numbers, each on
a fresh mesh (DTORCH_COLLECTIVE_TIMEOUT=2): every rank must raise, none may return data."""

import numpy as np
import pytest
from mpi4py import MPI

import dtorch_mpi as dt

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def test_a_large_call_meeting_a_small_one_times_out() -> None:
    """The size rule differs by rank: rank 0 (64 KiB and more) checks, the others (small) do not;
    rank 0 waits for its data (on the data communicator, its check in flight), the others for
    theirs (on the mesh's communicator): the same kind of call, of other sizes, which must
    never match each other's messages."""
    mesh = dt.init_device_mesh("cpu", (SIZE,))
    big = dt.distribute_tensor(np.ones((2 * SIZE + 1, 4096)), mesh, [dt.Shard(0)])
    small = dt.distribute_tensor(np.ones((2 * SIZE + 1, 3)), mesh, [dt.Shard(0)])
    with pytest.raises(dt.CollectiveTimeoutError) as err:
        (big if RANK == 0 else small).redistribute(placements=[dt.Replicate()])
    print(f"rank {RANK} raised CollectiveTimeoutError: {str(err.value)[:80]}")


def test_a_skipped_small_async_call_is_caught_by_the_call_number() -> None:
    """Rank 0 starts a small call the others skip (nonblocking, unchecked), then every rank makes
    the same large call: the numbers differ, so no rank gathers rank 0's small call's data."""
    mesh = dt.init_device_mesh("cpu", (SIZE,))
    big = dt.distribute_tensor(np.ones((2 * SIZE + 1, 4096)), mesh, [dt.Shard(0)])
    small = dt.distribute_tensor(np.ones((2 * SIZE + 1, 3)), mesh, [dt.Shard(0)])
    if RANK == 0:
        small.redistribute(placements=[dt.Replicate()], async_op=True)
    with pytest.raises(dt.SPMDDivergenceError, match="different collective calls") as err:
        big.redistribute(placements=[dt.Replicate()])
    print(f"rank {RANK} raised SPMDDivergenceError: {str(err.value)[:80]}")


def test_a_large_call_meeting_a_small_async_one_and_a_large_one_raises() -> None:
    """Rank 0's large call (its data in flight on the data communicator while its check waits)
    meets the others' small nonblocking call (unchecked, its data on the mesh's communicator,
    so it can never match rank 0's data) and then their large call, the same as rank 0's: its
    data may well complete, but the checks meet with different call numbers, so every rank
    raises SPMDDivergenceError and none returns the data."""
    mesh = dt.init_device_mesh("cpu", (SIZE,))
    big = dt.distribute_tensor(np.ones((2 * SIZE + 1, 4096)), mesh, [dt.Shard(0)])
    small = dt.distribute_tensor(np.ones((2 * SIZE + 1, 3)), mesh, [dt.Shard(0)])
    if RANK != 0:
        small.redistribute(placements=[dt.Replicate()], async_op=True)
    with pytest.raises(dt.SPMDDivergenceError, match="different collective calls") as err:
        big.redistribute(placements=[dt.Replicate()])
    print(f"rank {RANK} raised SPMDDivergenceError after a small call elsewhere: {str(err.value)[:60]}")


def test_a_call_the_issue_thread_checks_times_out_naming_the_callers_line() -> None:
    """Rank 0 hands a large gather to the issue thread (comm/issuer.py; inline where there is
    none), the others make a small one: rank 0's check meets no check and times out on the
    thread, and the error, raised at rank 0's wait, names this file's line, not the thread's."""
    from dtorch_mpi.comm import issuer

    mesh = dt.init_device_mesh("cpu", (SIZE,))
    big = dt.distribute_tensor(np.ones((2 * SIZE + 1, 4096)), mesh, [dt.Shard(0)])
    small = dt.distribute_tensor(np.ones((2 * SIZE + 1, 3)), mesh, [dt.Shard(0)])
    with pytest.raises(dt.CollectiveTimeoutError) as err:
        with issuer.deferred():
            pending = (big if RANK == 0 else small).redistribute(placements=[dt.Replicate()], async_op=True)
        pending.to_local()
    named = f"{__file__}:" in str(err.value)
    print(f"rank {RANK} raised CollectiveTimeoutError at its wait, naming {'its line' if named else err.value}")
