"""Planted failures for the harness self-test (run explicitly by tests/test_harness.py)."""

from mpi4py import MPI


def test_fails_on_last_rank_only() -> None:
    comm = MPI.COMM_WORLD
    assert comm.Get_rank() != comm.Get_size() - 1, "planted failure on the last rank"


def test_passes_everywhere() -> None:
    assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.Get_size()
