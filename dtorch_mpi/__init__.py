"""dtorch_mpi: distributed tensors for Python on MPI.

A DTensor is one global array whose pieces live on the MPI ranks of a DeviceMesh, one
placement per mesh dim: ``Shard(dim)``, ``Replicate()`` or ``Partial(op)``.
"""

from . import nn
from .checkpoint import has_parallel_hdf5, load, save
from .comm import CommCounter, CommRecord, set_comm_path
from .dtensor import DTensor, GatherHandle
from .errors import (
    CheckpointError,
    CollectiveTimeoutError,
    DTensorError,
    DTypeMismatchError,
    MeshMismatchError,
    PlacementError,
    ShapeMismatchError,
    SPMDDivergenceError,
    StateDictError,
)
from .factory import arange, distribute_tensor, empty, full, ones, rand, randn, zeros
from .mesh import DeviceMesh, init_device_mesh
from .nn import ColwiseParallel, RowwiseParallel, parallelize_module
from .ops import ARG_REDUCTIONS as _ARG_REDUCTIONS
from .ops import BINARY_FUNCTIONS as _BINARY
from .ops import REDUCTIONS as _REDUCTIONS
from .ops import UNARY_FUNCTIONS as _UNARY
from .ops import signature
from .ops.functions import (
    astype,
    cat,
    clone,
    flatten,
    log_softmax,
    matmul,
    permute,
    reshape,
    softmax,
    squeeze,
    stack,
    swapaxes,
    transpose,
    unsqueeze,
    where,
)
from .placement import Partial, Placement, Replicate, Shard
from .random import manual_seed
from .redistribute import plan_redistribute
from .split import compute_local_shape_and_offset
from .visualize import sharding_table, visualize_sharding

globals().update(_UNARY)
globals().update(_BINARY)
globals().update(_REDUCTIONS)
globals().update(_ARG_REDUCTIONS)
divide, multiply, subtract, negative, power = (  # NumPy spellings
    _BINARY["truediv"], _BINARY["mul"], _BINARY["sub"], _UNARY["neg"], _BINARY["pow"])

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CollectiveTimeoutError", "CommCounter", "CommRecord", "DTensor", "DTensorError", "DTypeMismatchError",
    "DeviceMesh", "GatherHandle", "MeshMismatchError", "Partial", "Placement", "PlacementError",
    "Replicate", "SPMDDivergenceError", "Shard", "StateDictError", "ShapeMismatchError", "arange",
    "compute_local_shape_and_offset", "distribute_tensor", "empty", "full", "init_device_mesh",
    "manual_seed", "ones", "plan_redistribute", "rand", "randn", "set_comm_path", "zeros",
    "sharding_table", "visualize_sharding", "nn", "save", "load", "has_parallel_hdf5", "ColwiseParallel", "RowwiseParallel", "parallelize_module", "signature", "astype", "cat", "clone", "flatten", "log_softmax", "matmul", "permute",
    "reshape", "softmax", "squeeze", "stack", "swapaxes", "transpose", "unsqueeze", "where",
    "divide", "multiply", "subtract", "negative", "power",
]
__all__.extend(sorted(_UNARY) + sorted(_BINARY) + sorted(_REDUCTIONS) + sorted(_ARG_REDUCTIONS))
