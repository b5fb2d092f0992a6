"""dtorch_mpi: distributed tensors for Python on MPI.

A DTensor is one global array whose pieces live on the MPI ranks of a DeviceMesh, one
placement per mesh dim: ``Shard(dim)``, ``Replicate()`` or ``Partial(op)``.
"""

from .comm import CommCounter, CommRecord, set_comm_path
from .dtensor import DTensor, GatherHandle
from .errors import (
    CheckpointError,
    DTensorError,
    DTypeMismatchError,
    MeshMismatchError,
    PlacementError,
    ShapeMismatchError,
    SPMDDivergenceError,
)
from .factory import arange, distribute_tensor, empty, full, ones, rand, randn, zeros
from .mesh import DeviceMesh, init_device_mesh
from .placement import Partial, Placement, Replicate, Shard
from .random import manual_seed
from .redistribute import plan_redistribute
from .split import compute_local_shape_and_offset

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CommCounter", "CommRecord", "DTensor", "DTensorError", "DTypeMismatchError",
    "DeviceMesh", "GatherHandle", "MeshMismatchError", "Partial", "Placement", "PlacementError",
    "Replicate", "SPMDDivergenceError", "Shard", "ShapeMismatchError", "arange",
    "compute_local_shape_and_offset", "distribute_tensor", "empty", "full", "init_device_mesh",
    "manual_seed", "ones", "plan_redistribute", "rand", "randn", "set_comm_path", "zeros",
]
