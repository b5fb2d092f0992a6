"""EMULATED DEVICE (test double): device pointers. ``.data`` of an emulated array registers
the allocation behind it, so NCCL calls given a pointer resolve it to that memory; a pointer
into nothing registered, or a count running past its allocation, fails loudly (real NCCL
would read or write whatever lies there, or fault)."""

from __future__ import annotations

import weakref

import numpy as np

_ALLOCATIONS: "weakref.WeakValueDictionary[int, np.ndarray]" = weakref.WeakValueDictionary()


def _owner(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class MemoryPointer:
    """``ndarray.data``: ``ptr`` is the address of the array's first element."""

    def __init__(self, ptr: int, owner: np.ndarray) -> None:
        self.ptr = ptr
        self._owner = owner  # the allocation stays alive while the pointer object does

    def __int__(self) -> int:
        return self.ptr


def pointer_to(a: np.ndarray) -> MemoryPointer:
    owner = _owner(a)
    start = owner.__array_interface__["data"][0]
    _ALLOCATIONS[start] = owner
    return MemoryPointer(a.__array_interface__["data"][0], owner)


class _Bytes:
    """``nbytes`` of memory at ``ptr`` as NumPy sees it (``__array_interface__``), keeping the
    allocation alive. (A ctypes array type per size made a new class on every call, each a
    reference cycle left to the garbage collector once the view was dropped.)"""

    def __init__(self, ptr: int, nbytes: int, owner: np.ndarray) -> None:
        self.__array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        self.owner = owner


def resolve(ptr: int, nbytes: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``(uint8 view of nbytes at ptr, the allocation holding it)``; raises if ``[ptr, ptr +
    nbytes)`` is not inside one registered allocation."""
    ptr = int(ptr)
    if nbytes == 0:  # NCCL never touches the memory of an empty transfer
        return np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.uint8)
    for start, owner in list(_ALLOCATIONS.items()):
        end = start + owner.nbytes
        if start <= ptr < end or (nbytes == 0 and ptr == end):
            if ptr + nbytes > end:
                raise ValueError(f"emulated NCCL: {what} of {nbytes} bytes at {ptr:#x} runs {ptr + nbytes - end} "
                                 f"bytes past its allocation ({owner.nbytes} bytes at {start:#x})")
            return np.asarray(_Bytes(ptr, nbytes, owner)), owner
    raise ValueError(f"emulated NCCL: {what}: {ptr:#x} is not a device pointer (no emulated device array "
                     f"holds it; pass cupy arrays' .data.ptr)")

