"""EMULATED DEVICE (test double): the ``cupyx`` calls the library makes, on emulated arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import scipy  # noqa: F401


def scatter_add(a: Any, slices: Any, value: Any) -> None:
    import cupy

    cupy._sync()
    np.add.at(a._a, cupy._unwrap(slices, strict=False), cupy._unwrap(value, strict=False))
