"""Error types raised by dtorch_mpi.

Every error that one rank can detect is agreed collectively (see :mod:`dtorch_mpi.spmd`),
so the same exception type and message is raised on every rank of the call.
"""

from __future__ import annotations

from collections.abc import Callable


class DTensorError(Exception):
    """Base class of every dtorch_mpi error."""


class PlacementError(DTensorError, ValueError):
    """Input placements match no rule, or a placement is invalid for the tensor or mesh."""


class ShapeMismatchError(DTensorError, ValueError):
    """Shapes (global or local) disagree with each other or with the split rule."""


class DTypeMismatchError(DTensorError, TypeError):
    """A dtype is unsupported, or pieces / values disagree on dtype."""


class MeshMismatchError(DTensorError, ValueError):
    """Operands or targets live on different device meshes, or a rank is not in the mesh."""


class StateDictError(DTensorError, ValueError):
    """A state_dict has missing or unexpected keys, or a value that is not an array."""


class CheckpointError(DTensorError, OSError):
    """A checkpoint is missing, truncated, corrupt, foreign, or does not fit its target."""


class SPMDDivergenceError(DTensorError, RuntimeError):
    """Ranks called different collectives, or the same one with different arguments."""

    resume: Callable[[], None] | None = None
    """Set by the divergence check (comm/divergence.py), called once, when the program receives
    the error: the group's communicator numbers its calls from a count every rank agreed."""


class CollectiveTimeoutError(DTensorError, TimeoutError):
    """A collective did not complete within ``DTORCH_COLLECTIVE_TIMEOUT`` seconds."""


ERROR_TYPES: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        DTensorError,
        PlacementError,
        ShapeMismatchError,
        DTypeMismatchError,
        MeshMismatchError,
        CheckpointError,
        StateDictError,
        SPMDDivergenceError,
        CollectiveTimeoutError,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        RuntimeError,
        OSError,
        NotImplementedError,
    )
}
