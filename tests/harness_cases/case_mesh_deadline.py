"""A rank that never builds the mesh the others build (DTORCH_COLLECTIVE_TIMEOUT=2): the others'
construction ends at the deadline in its first collective (the nonblocking duplicate of
COMM_WORLD), before any ``Comm.Split`` (MPI has no nonblocking split: the splits run only once
the agreement has shown every rank there). Afterwards the skipping rank completes the pending
duplicate, so the job's later collectives match."""

import pytest
from mpi4py import MPI

import dtorch_mpi as dt

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
SIDE = MPI.COMM_WORLD.Dup()  # the test's own signal: "the others have timed out"


def test_a_rank_that_skips_the_mesh_leaves_the_others_at_the_deadline() -> None:
    if RANK == SIZE - 1:
        print(f"rank {RANK} skipped the mesh")
        for other in range(SIZE - 1):  # every other rank has timed out (a slower one, still
            SIDE.recv(source=other)     # waiting, would otherwise see the late Idup complete)
        _late, request = MPI.COMM_WORLD.Idup()  # the call the others wait in, late
        request.Wait()
        return
    with pytest.raises(dt.CollectiveTimeoutError, match="DeviceMesh construction") as err:
        dt.init_device_mesh("cpu", (SIZE,))
    print(f"rank {RANK} raised CollectiveTimeoutError: {str(err.value)[:120]}")
    SIDE.send(None, dest=SIZE - 1)
