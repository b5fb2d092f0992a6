"""EMULATED DEVICE (a test double, not CuPy): importable as ``cupy`` under ``pytest --device
emulated`` (tests/conftest.py puts tests/emulated_cupy first on ``sys.path``).

It stands in for exactly the CuPy the library uses, so the GPU backends' code runs where no GPU
is: ``ndarray`` is a distinct type (module ``cupy``, not a ``numpy.ndarray`` subclass) backed
by NumPy memory, with CuPy's rules where they catch bugs a real device would show:

- no implicit conversion: ``numpy.asarray(device_array)`` raises ``TypeError`` as CuPy does
  (``.get()`` / ``cupy.asnumpy`` are the explicit ways); mixing a NumPy array (not a scalar)
  into a device operation raises ``TypeError``;
- reductions and scalar indexing return 0-d device arrays, not NumPy scalars;
- ``.data.ptr`` is the address of the memory behind the array, registered so that the emulated
  NCCL (``cupy.cuda.nccl``) resolves pointers to the buffers behind them;
- stream order: a device operation first completes the NCCL work pending on the current
  stream (the real device runs kernels in stream order).

Nothing run on it is "verified on GPU": it shows the code paths execute and compute the right
values under CuPy's and NCCL's documented semantics; the real device stays the final word.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from . import cuda
from .cuda import memory as _memory

__version__ = "0.0.0+emulated"
EMULATED = True


def _sync() -> None:
    """Stream order: NCCL work queued on the current stream completes before a device op."""
    cuda.get_current_stream()._drain()


def _refuse_host(a: Any) -> None:
    if isinstance(a, np.ndarray) and a.ndim > 0:
        raise TypeError(f"Unsupported type {type(a)} (emulated CuPy: a numpy.ndarray in a device "
                        f"operation; move it with cupy.asarray first)")


def _unwrap(a: Any, strict: bool = True) -> Any:
    if isinstance(a, ndarray):
        return a._a
    if strict:
        _refuse_host(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_unwrap(x, strict) for x in a)
    return a


def _wrap(r: Any) -> Any:
    if isinstance(r, np.ndarray):
        return ndarray._of(r)
    if isinstance(r, np.generic):
        return ndarray._of(np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(x) for x in r)
    if isinstance(r, list):
        return [_wrap(x) for x in r]
    return r


def _device_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], strict: bool = True) -> Any:
    """``fn`` on the arrays behind device arrays. A NumPy array is refused as an operand (every
    argument of a ufunc, the first of another function: CuPy raises ``TypeError``); a later
    argument may be one (axes, indices: CuPy reads those as sequences)."""
    _sync()
    out = kwargs.get("out")
    if isinstance(fn, np.ufunc) or not args:
        args = _unwrap(args, strict)
    else:
        args = (_unwrap(args[0], strict), *_unwrap(args[1:], False))
    r = fn(*args, **{k: _unwrap(v, strict and k == "out") for k, v in kwargs.items()})
    if out is not None and isinstance(out, ndarray):
        return out
    if isinstance(out, tuple) and len(out) == 1 and isinstance(out[0], ndarray):
        return out[0]
    return _wrap(r)


class ndarray(NDArrayOperatorsMixin):
    """A device array of the emulated device (NumPy memory underneath)."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100

    def __init__(self, shape: Any, dtype: Any = float, memptr: Any = None, strides: Any = None,
                 order: str = "C") -> None:
        if memptr is not None or strides is not None:
            raise NotImplementedError("emulated cupy.ndarray(): memptr/strides are not emulated")
        self._a = np.empty(shape, dtype=dtype, order=order)

    @classmethod
    def _of(cls, a: np.ndarray) -> "ndarray":
        obj = object.__new__(cls)
        obj._a = a
        return obj

    # --- what CuPy has and NumPy has not ---
    @property
    def data(self) -> "_memory.MemoryPointer":
        return _memory.pointer_to(self._a)

    def get(self, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
        _sync()
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        _sync()
        self._a[...] = arr

    @property
    def device(self) -> Any:
        return cuda.Device()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        a = self._a
        return {"shape": a.shape, "typestr": a.dtype.str, "descr": a.dtype.descr,
                "data": (self.data.ptr, False), "version": 2,
                "strides": None if a.flags.c_contiguous else a.strides}

    # --- NumPy protocols: CuPy's rules ---
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
                        "construct a NumPy array explicitly. (emulated CuPy)")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if "out" in kwargs:
            kwargs["out"] = tuple(kwargs["out"])
        return _device_call(getattr(ufunc, method), inputs, kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return _device_call(func, args, kwargs)

    # --- the array interface, delegated ---
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if callable(attr):
            def method(*args: Any, **kwargs: Any) -> Any:
                return _device_call(attr, args, kwargs)
            return method
        return _wrap(attr) if isinstance(attr, np.ndarray) else attr

    def __getitem__(self, key: Any) -> Any:
        _sync()
        return _wrap(self._a[_unwrap(key, strict=False)])

    def __setitem__(self, key: Any, value: Any) -> None:
        _sync()
        self._a[_unwrap(key, strict=False)] = _unwrap(value, strict=False)

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Any:
        for i in range(len(self)):
            yield self[i]

    def __bool__(self) -> bool:
        _sync()
        return bool(self._a)

    def __float__(self) -> float:
        _sync()
        return float(self._a)

    def __int__(self) -> int:
        _sync()
        return int(self._a)

    def __complex__(self) -> complex:
        _sync()
        return complex(self._a)

    def __repr__(self) -> str:
        return repr(self._a)

    def __str__(self) -> str:
        return str(self._a)

    def __copy__(self) -> "ndarray":
        return self.copy()

    def __deepcopy__(self, memo: Any) -> "ndarray":
        return self.copy()

    def __reduce__(self) -> Any:
        return (asarray, (self.get(),))

    __hash__ = None  # type: ignore[assignment]


# --- module functions ----------------------------------------------------------------------
def asnumpy(a: Any, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(out=out, order=order)
    return np.asarray(a, order=order)


def asarray(a: Any, dtype: Any = None, order: Any = None) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    _sync()
    return ndarray._of(np.array(a, dtype=dtype, order=order or "K", copy=True))  # host -> device copy


def array(obj: Any, dtype: Any = None, copy: bool = True, order: str = "K", ndmin: int = 0) -> ndarray:
    _sync()
    return ndarray._of(np.array(_unwrap(obj, strict=False), dtype=dtype, copy=True, order=order, ndmin=ndmin))


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)} (emulated CuPy)")
    return _device_call(np.ascontiguousarray, (a,), {"dtype": dtype})


def get_array_module(*args: Any) -> Any:
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


def copy(a: Any, order: str = "K") -> ndarray:
    return _device_call(np.array, (a,), {"copy": True, "order": order})


_NO_HOST_INPUT = {"empty", "zeros", "ones", "full", "arange", "linspace", "eye", "identity"}


def __getattr__(name: str) -> Any:
    """Every other name: NumPy's, run on device arrays (types and constants are NumPy's, as in
    CuPy: ``cupy.float32 is numpy.float32``)."""
    if name.startswith("__") or name in ("random", "fft", "linalg", "testing", "lib", "ma", "char"):
        raise AttributeError(f"emulated cupy has no {name!r}")
    attr = getattr(np, name)
    if isinstance(attr, type) or not callable(attr):
        return attr

    def function(*args: Any, **kwargs: Any) -> Any:
        return _device_call(attr, args, kwargs, strict=name not in _NO_HOST_INPUT)
    function.__name__ = name
    return function


__all__ = ["EMULATED", "array", "asarray", "ascontiguousarray", "asnumpy", "copy", "cuda", "get_array_module",
           "ndarray"]
