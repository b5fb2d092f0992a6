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


_node: tuple[int, int] | None = None


def node_facts() -> tuple[int, int]:
    """``(this rank's index among the ranks of its node, ranks on the node)``: one world
    collective (``Split_type(COMM_TYPE_SHARED)``) on first use, so the first call must be
    made by every world rank together (cuda ``DeviceMesh`` construction makes it)."""
    global _node
    if _node is None:
        node = library_world().Split_type(MPI.COMM_TYPE_SHARED)
        _node = (node.Get_rank(), node.Get_size())
        node.Free()
    return _node


def node_local_rank() -> int:
    """This rank's index among the ranks of its node."""
    return node_facts()[0]


def ranks_on_node() -> int:
    """How many ranks share this rank's node."""
    return node_facts()[1]
