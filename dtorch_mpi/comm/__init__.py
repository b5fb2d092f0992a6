"""Communication layer: one collective interface, several backends (MPI now; GPU later)."""

from .config import comm_path, set_comm_path
from .counter import CommCounter, CommRecord
from .group import Group
from .mpi_backend import MPIBackend
from .work import Work, completed

_MPI = MPIBackend()


def backend_for(device_type: str) -> MPIBackend:
    """The backend moving pieces of a mesh of ``device_type``."""
    if device_type == "cuda":
        from .gpu import gpu_backend

        return gpu_backend()  # type: ignore[return-value]
    return _MPI


__all__ = [
    "CommCounter", "CommRecord", "Group", "MPIBackend", "Work", "backend_for", "comm_path",
    "completed", "set_comm_path",
]
