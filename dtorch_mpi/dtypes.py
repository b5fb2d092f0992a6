"""Supported dtypes, their wire codes, and their MPI datatypes for reductions."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
from mpi4py import MPI

from .errors import DTypeMismatchError

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name)
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
)
_CODE = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}


def check_dtype(dtype: object) -> np.dtype:
    """Normalise ``dtype``; raise ``DTypeMismatchError`` naming the supported ones if not."""
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as exc:
        raise DTypeMismatchError(f"{dtype!r} is not a dtype") from exc
    dt = dt.newbyteorder("=")
    if dt not in _CODE:
        raise DTypeMismatchError(
            f"dtype {dt} is not supported; use one of {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )
    return dt


def to_native(array: Any) -> Any:
    """``array`` in native byte order: itself when it already is, else a converted copy.

    MPI moves raw bytes and reduces in the machine's byte order, so a ``>f4`` piece on a
    little-endian machine would arrive (or sum) as garbage: every entry point converts first.
    """
    dt = np.dtype(array.dtype)
    return array if dt.isnative else array.astype(dt.newbyteorder("="))


def dtype_code(dtype: np.dtype) -> int:
    return _CODE[check_dtype(dtype)]


def dtype_from_code(code: int) -> np.dtype:
    return SUPPORTED_DTYPES[code]


@lru_cache(maxsize=64)
def element_type(itemsize: int) -> MPI.Datatype:
    """An MPI type of ``itemsize`` contiguous bytes: how every dtype moves (no reduction)."""
    t = MPI.BYTE.Create_contiguous(itemsize)
    t.Commit()
    return t


_REDUCE_TYPES = {
    "int8": MPI.INT8_T, "int16": MPI.INT16_T, "int32": MPI.INT32_T, "int64": MPI.INT64_T,
    "uint8": MPI.UINT8_T, "uint16": MPI.UINT16_T, "uint32": MPI.UINT32_T, "uint64": MPI.UINT64_T,
    "float32": MPI.FLOAT, "float64": MPI.DOUBLE,
    "complex64": MPI.C_FLOAT_COMPLEX, "complex128": MPI.C_DOUBLE_COMPLEX, "bool": MPI.C_BOOL,
}
WIDENED = {np.dtype("float16"): np.dtype("float32")}
"""Dtypes MPI cannot reduce natively, reduced in a wider type (never reinterpreted as ints)."""


_REDUCE_TYPES_BY_DTYPE = {np.dtype(name): t for name, t in _REDUCE_TYPES.items()}


def reduction_type(dtype: np.dtype) -> MPI.Datatype:
    return _REDUCE_TYPES_BY_DTYPE[np.dtype(dtype)]  # keyed by dtype: ``.name`` costs ~1 us


def reduction_op(dtype: np.dtype, reduce_op: str) -> MPI.Op:
    """The MPI op for ``reduce_op`` on ``dtype`` (``avg`` is a sum divided afterwards)."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "avg": MPI.LOR}[reduce_op]
    if dt.kind == "c" and reduce_op in ("max", "min"):
        raise DTypeMismatchError(
            f"Partial({reduce_op!r}) is undefined for complex dtype {dt} (complex numbers have no "
            f"order); use Partial('sum') or Partial('avg'), or reduce a real quantity such as abs()"
        )
    return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[reduce_op]


def identity_value(dtype: np.dtype, reduce_op: str) -> object:
    """The identity of ``reduce_op`` in ``dtype`` (used for Partial pieces off coordinate 0)."""
    dt = np.dtype(dtype)
    if reduce_op in ("sum", "avg"):
        return dt.type(0)
    if dt == np.bool_:
        return reduce_op == "min"
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return info.min if reduce_op == "max" else info.max
    return -np.inf if reduce_op == "max" else np.inf
