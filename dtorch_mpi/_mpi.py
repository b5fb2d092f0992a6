"""The library's own world communicator, kept apart from the user's ``COMM_WORLD`` traffic."""

from __future__ import annotations

from mpi4py import MPI

_library_world: MPI.Intracomm | None = None


def library_world() -> MPI.Intracomm:
    """A duplicate of ``COMM_WORLD`` (made collectively on first use by the first mesh)."""
    global _library_world
    if _library_world is None:
        _library_world = MPI.COMM_WORLD.Dup()
        _library_world.Set_name("dtorch_mpi world")
    return _library_world


_node_local_rank: int | None = None


def node_local_rank() -> int:
    """This rank's index among the ranks of its node (``Split_type(COMM_TYPE_SHARED)``)."""
    global _node_local_rank
    if _node_local_rank is None:
        node = library_world().Split_type(MPI.COMM_TYPE_SHARED)
        _node_local_rank = node.Get_rank()
        node.Free()
    return _node_local_rank
