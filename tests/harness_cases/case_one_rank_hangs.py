"""A planted hang for the harness self-test: rank 1 waits for a message that never comes."""

import numpy as np
from mpi4py import MPI


def test_hangs_on_rank_one() -> None:
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 1:
        comm.Recv(np.empty(1), source=0, tag=999)
