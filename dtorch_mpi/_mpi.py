"""The library's own world communicator, kept apart from the user's ``COMM_WORLD`` traffic."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from mpi4py import MPI

_library_world: MPI.Intracomm | None = None


def library_world(wait: Callable[[MPI.Request, str], None] | None = None) -> MPI.Intracomm:
    """A duplicate of ``COMM_WORLD`` (made collectively on first use, normally by the first
    mesh). Made with the nonblocking ``MPI_Comm_idup`` and waited on by ``wait`` (``DeviceMesh``
    passes the collective deadline's wait: this is its first collective, so a rank that never
    builds the first mesh leaves the others with ``CollectiveTimeoutError`` instead of a hang in
    a blocking ``Dup``; without ``wait``, a plain ``Wait``)."""
    global _library_world
    if _library_world is None:
        world, request = MPI.COMM_WORLD.Idup()
        if wait is None:
            request.Wait()
        else:
            wait(request, "DeviceMesh construction (the first mesh duplicates COMM_WORLD: MPI_Comm_idup)")
        world.Set_name("dtorch_mpi world")
        _library_world = world
    return _library_world


_node: tuple[int, int, int] | None = None


def node_facts() -> tuple[int, int]:
    """``(this rank's index among the ranks of its node, ranks on the node)``: world
    collectives (``Split_type(COMM_TYPE_SHARED)``, then a node-wide ``Allreduce``) on first
    use, so the first call must be made by every world rank together (``DeviceMesh``
    construction makes it)."""
    return _facts()[:2]


def node_id() -> int:
    """The lowest world rank on this rank's node: equal exactly for ranks sharing a node."""
    return _facts()[2]


def _facts() -> tuple[int, int, int]:
    global _node
    if _node is None:
        world = library_world()
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        lowest = np.array([world.Get_rank()], dtype=np.int64)
        node.Allreduce(MPI.IN_PLACE, lowest, op=MPI.MIN)
        _node = (node.Get_rank(), node.Get_size(), int(lowest[0]))
        node.Free()
    return _node


def node_local_rank() -> int:
    """This rank's index among the ranks of its node."""
    return node_facts()[0]


def ranks_on_node() -> int:
    """How many ranks share this rank's node."""
    return node_facts()[1]
