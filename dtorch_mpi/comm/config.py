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

import os

PATHS = ("auto", "padded", "variable")

_path: str | None = None


def comm_path() -> str:
    global _path
    if _path is None:
        set_comm_path(os.environ.get("DTORCH_COMM_PATH", "auto"))
    assert _path is not None
    return _path


def set_comm_path(path: str) -> None:
    """Select the collective path for this process (all ranks must select the same)."""
    global _path
    if path not in PATHS:
        raise ValueError(f"DTORCH_COMM_PATH={path!r} is not one of {', '.join(PATHS)}")
    _path = path


_debug: bool | None = None


def spmd_debug() -> bool:
    """``DTORCH_SPMD_DEBUG=1``: every collective first checks that all ranks of its group make
    the same call (kind, shapes, dtype), raising ``SPMDDivergenceError`` instead of hanging."""
    global _debug
    if _debug is None:
        _debug = os.environ.get("DTORCH_SPMD_DEBUG", "") not in ("", "0")
    return _debug


def set_spmd_debug(on: bool) -> None:
    global _debug
    _debug = bool(on)


_check: bool | None = None


def spmd_check() -> bool:
    """``DTORCH_SPMD_CHECK`` (default ``1``): the default divergence check of collectives of
    64 KiB or more (comm/divergence.py); ``0`` turns it off (to measure its cost)."""
    global _check
    if _check is None:
        _check = os.environ.get("DTORCH_SPMD_CHECK", "1") not in ("", "0")
    return _check


def set_spmd_check(on: bool) -> None:
    """Turn the default divergence check on or off for this process (every rank alike)."""
    global _check
    _check = bool(on)
