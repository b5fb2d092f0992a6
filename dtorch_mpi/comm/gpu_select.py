"""Choosing the GPU backend: ``DTORCH_GPU_BACKEND`` (``auto`` | ``nccl`` | ``cuda-aware-mpi`` |
``host-staging``), with ``auto`` decided from facts every rank agrees on.

``auto`` takes NCCL when ``cupy.cuda.nccl`` is importable and every rank of the node has a GPU
of its own (NCCL refuses two ranks on one GPU), else CUDA-aware MPI when the MPI library says
it is (``DTORCH_CUDA_AWARE_MPI=1`` forces it), else host staging: device -> host -> MPI ->
device, the safe default. All three take the same calls as the MPI backend.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .. import settings
from .._mpi import library_world, ranks_on_node
from .backend import backends_for
from .deadline import wait_request


def choose_backend(requested: str, nccl_available: bool, ranks_on_node: int, gpus_on_node: int,
                   cuda_aware_mpi: bool) -> str:
    """The backend to use (pure: unit-tested without a GPU)."""
    if requested not in gpu_backend_names():
        raise ValueError(f"DTORCH_GPU_BACKEND={requested!r} is not one of {', '.join(gpu_backend_names())}")
    if requested == "nccl":
        if not nccl_available:
            raise RuntimeError("DTORCH_GPU_BACKEND=nccl but cupy.cuda.nccl is not available")
        if ranks_on_node > gpus_on_node:
            raise RuntimeError(f"NCCL needs one GPU per rank: {ranks_on_node} ranks share {gpus_on_node} GPU(s) "
                               f"on this node; use DTORCH_GPU_BACKEND=host-staging")
        return "nccl"
    if requested != "auto":
        return requested
    if nccl_available and ranks_on_node <= gpus_on_node:
        return "nccl"
    return "cuda-aware-mpi" if cuda_aware_mpi else "host-staging"


def gpu_backend_names() -> tuple[str, ...]:
    """The values ``DTORCH_GPU_BACKEND`` accepts: ``auto`` and every registered cuda backend."""
    return ("auto", *backends_for("cuda"))


def mpi_is_cuda_aware() -> bool:
    flag = settings.get("DTORCH_CUDA_AWARE_MPI")
    if flag is not None:
        return bool(flag)
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:
        return False


def agreed_facts(world: MPI.Intracomm, requested: str, nccl_available: bool, ranks_on_node: int,
                 gpus_on_node: int, cuda_aware_mpi: bool) -> tuple[bool, int, int, bool]:
    """The selection facts every rank shares: NCCL and CUDA-aware MPI only where every rank
    has them, the most crowded node's ranks and the fewest GPUs, so every rank picks the same
    backend (one rank in NCCL while another calls MPI would hang)."""
    names = gpu_backend_names()
    code = names.index(requested) if requested in names else len(names)
    local = np.array([code, -code, -int(nccl_available), ranks_on_node, -gpus_on_node, -int(cuda_aware_mpi)],
                     dtype=np.int64)
    worst = np.empty_like(local)
    wait_request(world.Iallreduce(local, worst, op=MPI.MAX), "the GPU backend selection (Allreduce)")
    if worst[0] != -worst[1]:
        raise ValueError("DTORCH_GPU_BACKEND differs between ranks; set the same value on every rank")
    return bool(-worst[2]), int(worst[3]), int(-worst[4]), bool(-worst[5])


_selected: str | None = None


def selected_backend() -> str:
    """The name of the process's GPU backend, chosen once from facts agreed over the library's
    world (a collective of every world rank: cuda ``DeviceMesh`` construction calls it first)."""
    global _selected
    if _selected is None:
        try:
            import cupy

            gpus = int(cupy.cuda.runtime.getDeviceCount())
        except Exception:  # a rank without CuPy or a GPU takes part with none
            gpus = 0
        try:
            from cupy.cuda import nccl  # noqa: F401

            have_nccl = True
        except ImportError:
            have_nccl = False
        world = library_world()
        requested = str(settings.get("DTORCH_GPU_BACKEND"))
        facts = agreed_facts(world, requested, have_nccl, ranks_on_node(), gpus, mpi_is_cuda_aware())
        _selected = choose_backend(requested, *facts)
    return _selected


__all__ = ["agreed_facts", "choose_backend", "gpu_backend_names", "mpi_is_cuda_aware", "selected_backend"]
