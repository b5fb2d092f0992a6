"""Communication layer: one collective interface (``backend.Backend``), several backends.

The registry below is the one place naming the backends: adding one is its module plus one
``register_backend`` line (docs/backends.md). ``backend_for`` picks a mesh's backend: MPI for
``"cpu"``; for ``"cuda"`` the backend agreed across ranks when the first cuda mesh was built.
"""

from . import gpu, pool
from .backend import Backend, Handle, backend_named, register_backend
from .config import comm_path, set_comm_path
from .counter import CommCounter, CommRecord
from .group import Group
from .mpi_backend import MPIBackend
from .work import Work, completed, wait_all

register_backend("mpi", MPIBackend, "cpu")
register_backend("nccl", gpu.NCCLBackend, "cuda")
register_backend("cuda-aware-mpi", gpu.CudaAwareMPIBackend, "cuda")
register_backend("host-staging", gpu.HostStagingBackend, "cuda")


def backend_for(device_type: str) -> Backend:
    """The backend moving pieces of a mesh of ``device_type``."""
    return backend_named(gpu.selected_backend() if device_type == "cuda" else "mpi")


__all__ = [
    "Backend", "CommCounter", "CommRecord", "Group", "Handle", "MPIBackend", "Work", "backend_for",
    "backend_named", "comm_path", "completed", "pool", "register_backend", "set_comm_path", "wait_all",
]
