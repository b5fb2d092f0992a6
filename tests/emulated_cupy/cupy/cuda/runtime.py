"""EMULATED DEVICE (test double): ``cupy.cuda.runtime``. The emulated node has
``DTORCH_EMULATED_GPUS`` devices (default: one per rank of the job, so NCCL's one-GPU-per-rank
rule holds; ``DTORCH_EMULATED_GPUS=1`` makes ranks share a device)."""

from __future__ import annotations

import os


class CUDARuntimeError(RuntimeError):
    pass


def getDeviceCount() -> int:
    raw = os.environ.get("DTORCH_EMULATED_GPUS")
    if raw:
        return int(raw)
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def getDevice() -> int:
    from . import current_device_id

    return current_device_id()


def deviceSynchronize() -> None:
    from . import Device

    Device().synchronize()
