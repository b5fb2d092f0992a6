"""The array library behind a mesh's device type or a plain array (NumPy on CPU, CuPy on
CUDA). It imports nothing from the package, so every layer can ask it without a cycle."""

from __future__ import annotations

from typing import Any

import numpy as np


def array_namespace(device_type: str) -> Any:
    """The array module for ``device_type``: CuPy for ``"cuda"``, NumPy otherwise."""
    if device_type == "cuda":
        import cupy

        return cupy
    return np


def array_module_of(x: Any) -> Any:
    """The array module of a plain array: NumPy for ``np.ndarray``, CuPy otherwise."""
    return np if isinstance(x, np.ndarray) else array_namespace("cuda")


def to_host(x: Any) -> Any:
    """``x`` as a NumPy array: a CuPy array copied to the host, anything else as it is."""
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x
