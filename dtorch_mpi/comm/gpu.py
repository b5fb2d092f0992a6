"""GPU backends, one module per job: selection (comm/gpu_select.py), the NCCL backend
(comm/nccl_backend.py), and the MPI-carried ones, host staging and CUDA-aware MPI
(comm/staging.py). This module re-exports them so ``comm.gpu`` keeps its names."""

from __future__ import annotations

from .gpu_select import agreed_facts, choose_backend, gpu_backend_names, mpi_is_cuda_aware, selected_backend
from .nccl_backend import NCCL_TYPES, NCCLBackend, NCCLWork, nccl_wire, padded_plan, uid_from_bytes, uid_to_bytes
from .staging import CudaAwareMPIBackend, DeviceAdapter, HostStagingBackend, cupy_adapter

__all__ = ["NCCL_TYPES", "CudaAwareMPIBackend", "DeviceAdapter", "HostStagingBackend", "NCCLBackend", "NCCLWork",
           "agreed_facts", "choose_backend", "cupy_adapter", "gpu_backend_names", "mpi_is_cuda_aware", "nccl_wire",
           "padded_plan", "selected_backend", "uid_from_bytes", "uid_to_bytes"]
