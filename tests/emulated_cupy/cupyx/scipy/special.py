"""EMULATED DEVICE (test double): ``cupyx.scipy.special.erf`` on emulated arrays."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def erf(x: Any) -> Any:
    import cupy

    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"Unsupported type {type(x)} (emulated cupyx: erf takes a device array)")
    cupy._sync()
    return cupy.ndarray._of(np.vectorize(math.erf, otypes=[x.dtype])(x._a).astype(x.dtype))
