"""Communication settings: which collective path and which backend.

``DTORCH_COMM_PATH``:
- ``auto`` (default): equal-size collectives for equal pieces, the variable-size ``v``/``w``
  collectives for unequal ones (``Allgatherv`` for unequal contiguous gathers, ``Alltoallw``
  for unequal inner-axis ones; comm/routes.py). Equal all-to-all blocks take ``Alltoallv``
  from 1 MB, like ``variable`` (comm/mpi_backend.py ``ALLTOALLV_FROM``).
- ``padded``: always pad to equal sizes, the path NCCL needs; selectable on CPU so CI runs it.
- ``variable``: always the variable-size collectives.
``DTORCH_GPU_BACKEND``: ``auto`` or a registered ``"cuda"`` backend (``nccl`` | ``cuda-aware-mpi``
| ``host-staging``; see comm/gpu.py).
"""

from __future__ import annotations

from .. import settings

PATHS = settings.COMM_PATHS


def comm_path() -> str:
    """The collective path of this process (``DTORCH_COMM_PATH``, or ``set_comm_path``)."""
    return settings.get("DTORCH_COMM_PATH")


def set_comm_path(path: str) -> None:
    """Select the collective path for this process (all ranks must select the same)."""
    settings.put("DTORCH_COMM_PATH", settings.parse("DTORCH_COMM_PATH", path))


def spmd_debug() -> bool:
    """``DTORCH_SPMD_DEBUG=1``: every collective first checks that all ranks of its group make
    the same call (kind, shapes, dtype), raising ``SPMDDivergenceError`` instead of hanging."""
    return settings.get("DTORCH_SPMD_DEBUG")


def set_spmd_debug(on: bool) -> None:
    settings.put("DTORCH_SPMD_DEBUG", bool(on))


def spmd_check() -> bool:
    """``DTORCH_SPMD_CHECK`` (default on): the default divergence check of collectives of
    64 KiB or more (comm/divergence.py); off only to measure its cost."""
    return settings.get("DTORCH_SPMD_CHECK")


def set_spmd_check(on: bool) -> None:
    """Turn the default divergence check on or off for this process (every rank alike)."""
    settings.put("DTORCH_SPMD_CHECK", bool(on))


def check_form() -> str:
    """``DTORCH_SPMD_CHECK_FORM``: ``auto`` (a shared-memory board for a group on one node, the
    all-reduce elsewhere) or ``allreduce`` (always); read when a mesh attaches its check twins."""
    return settings.get("DTORCH_SPMD_CHECK_FORM")


def set_check_form(form: str) -> None:
    """Select the check's form for meshes built from now on (every rank alike)."""
    settings.put("DTORCH_SPMD_CHECK_FORM", settings.parse("DTORCH_SPMD_CHECK_FORM", form))
