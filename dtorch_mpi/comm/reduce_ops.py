"""MPI reduction ops with NumPy's semantics.

MPI's ``MAX``/``MIN`` are not NaN-aware: whether a NaN survives depends on the order in which
an MPI library combines the terms, so different ranks of one group may end up with different
"replicated" values. ``np.max`` propagates NaN; so do these user-defined ops
(``np.maximum``/``np.minimum``), used for every floating-point max/min reduction.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import to_numpy_dtype

from ..dtypes import reduction_op


def _elementwise(ufunc: Any) -> Any:
    def apply(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
        dtype = to_numpy_dtype(datatype)
        ufunc(np.frombuffer(inbuf, dtype=dtype), np.frombuffer(inoutbuf, dtype=dtype),
              out=np.frombuffer(inoutbuf, dtype=dtype))

    return apply


_NAN_OPS: dict[str, MPI.Op] = {}


def nan_aware_op(dtype: np.dtype, reduce_op: str, host: bool = True) -> MPI.Op:
    """The MPI op reducing ``dtype`` by ``reduce_op``, NaN-propagating for float max/min on
    host buffers (a Python op cannot read device memory handed over by a CUDA-aware MPI)."""
    dt = np.dtype(dtype)
    if dt.kind != "f" or reduce_op not in ("max", "min") or not host:
        return reduction_op(dt, reduce_op)
    op = _NAN_OPS.get(reduce_op)
    if op is None:
        ufunc = np.maximum if reduce_op == "max" else np.minimum
        op = _NAN_OPS[reduce_op] = MPI.Op.Create(_elementwise(ufunc), commute=True)
    return op
