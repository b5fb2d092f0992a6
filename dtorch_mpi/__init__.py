"""dtorch_mpi: distributed tensors for Python on MPI.

A DTensor is one global array whose pieces live on the MPI ranks of a DeviceMesh, one
placement per mesh dim: ``Shard(dim)``, ``Replicate()`` or ``Partial(op)``.
"""

from . import ucx as _ucx  # noqa: F401  (first: it sets UCX_RNDV_THRESH before anything starts MPI)

# isort: split
from . import heap as _heap
from . import nn, optim
from .autograd import enable_grad, is_grad_enabled, no_grad
from .autograd import wire as _wire_autograd
from .checkpoint import SaveHandle, has_parallel_hdf5, load, save
from .comm import CommCounter, CommRecord, set_comm_path, wait_all
from .dtensor import WIRING as _WIRING
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
from .factory import (
    arange,
    distribute_tensor,
    empty,
    empty_like,
    full,
    full_like,
    ones,
    ones_like,
    rand,
    randn,
    zeros,
    zeros_like,
)
from .mesh import DeviceMesh, init_device_mesh
from .nn import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module, replicate
from .ops import catalog as _catalog
from .ops import exported as _exported
from .ops import install_methods as _install_methods
from .ops import signature
from .ops.catalog import *  # noqa: F403  (every operator function; its __all__ is checked against OPS)
from .placement import Partial, Placement, Replicate, Shard
from .random import manual_seed
from .redistribute import plan_redistribute
from .split import compute_local_shape_and_offset
from .timeline import trace, trace_span
from .visualize import sharding_table, visualize_sharding

_install_methods(DTensor)  # DTensor methods and operators, derived from the operator declarations
_wire_autograd(_WIRING)  # backward, hooks and recorded redistributes: dtensor.py does not import autograd
_WIRING.exported = _exported  # the ufunc table of __array_ufunc__: nor ops
_heap.tune()  # with DTORCH_MALLOC_TUNING=1, glibc keeps freed MB-sized blocks for the next step (heap.py)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CollectiveTimeoutError", "CommCounter", "CommRecord", "DTensor", "DTensorError", "DTypeMismatchError",
    "DeviceMesh", "GatherHandle", "MeshMismatchError", "Partial", "Placement", "PlacementError",
    "Replicate", "SPMDDivergenceError", "Shard", "StateDictError", "ShapeMismatchError", "arange",
    "compute_local_shape_and_offset", "distribute_tensor", "empty", "full", "init_device_mesh",
    "manual_seed", "ones", "plan_redistribute", "zeros_like", "ones_like", "empty_like", "full_like", "rand", "randn", "set_comm_path", "zeros",
    "sharding_table", "visualize_sharding", "nn", "optim", "save", "SaveHandle", "load", "has_parallel_hdf5", "ColwiseParallel", "RowwiseParallel", "fully_shard", "parallelize_module", "replicate", "trace", "trace_span", "signature", "enable_grad", "is_grad_enabled", "no_grad",
    "wait_all",
]
__all__ += _catalog.__all__
