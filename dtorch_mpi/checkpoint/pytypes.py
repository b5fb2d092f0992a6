"""Python scalars in a checkpoint: small datasets whose ``pytype`` attribute names the exact
Python type to give back (no pickle: plain h5py reads the values).

| Python value                           | dataset                      | ``pytype``                    |
|----------------------------------------|------------------------------|-------------------------------|
| ``int`` (int64 range)                  | 0-d ``<i8``                  | ``int``                       |
| ``float``                              | 0-d ``<f8``                  | ``float``                     |
| ``bool``                               | 0-d ``|u1``, 0 or 1          | ``bool``                      |
| ``str``                                | 1-d ``|u1``, UTF-8 bytes     | ``str``                       |
| ``None``                               | 1-d ``|u1`` of length 0      | ``None``                      |
| non-empty list/tuple of only int,      | 1-d ``<i8``/``<f8``/``|u1``  | ``list[int]``, ``tuple[float]``, |
| only float or only bool                |                              | ... (the container and kind)  |

Containers are groups (:mod:`.tree`): a mapping with ``str`` keys is a plain group, one with
``int`` keys has ``pytype = "dict[int]"`` (members named by the decimal integer), and any other
list or tuple (mixed, empty, holding strings, mappings, tensors...) has ``pytype = "list"`` or
``"tuple"`` with members ``0 .. n-1``. Scalar datasets carry the ``dtype`` and ``checksum``
attributes of every dataset, so the untrusted-input checks and the checksum cover them too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointError

ATTRIBUTE = "pytype"
GROUP_TYPES = ("dict[int]", "list", "tuple")  # and no attribute: a mapping with str keys
MAX_SCALAR_BYTES = 1 << 24  # scalar datasets are read whole on every rank before the target is known
INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class Kind:
    """How one scalar kind is stored: dtype, rank (0-d or 1-d) and the conversions both ways."""

    dtype: np.dtype
    ndim: int
    encode: Callable[[Any], np.ndarray]
    decode: Callable[[np.ndarray], Any]


def _utf8(raw: np.ndarray) -> str:
    try:
        return raw.tobytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason})") from exc


def _bools(raw: np.ndarray) -> list[bool]:
    if raw.size and int(raw.max()) > 1:
        raise ValueError(f"a bool is stored as 0 or 1, found {int(raw.max())}")
    return [bool(v) for v in raw.reshape(-1)]


def _none(raw: np.ndarray) -> None:
    if raw.size:
        raise ValueError(f"None is stored as an empty dataset, found {raw.size} element(s)")


I8, F8, U1 = np.dtype("<i8"), np.dtype("<f8"), np.dtype("|u1")
SCALARS: dict[str, Kind] = {
    "int": Kind(I8, 0, lambda v: np.array(v, dtype=I8), lambda a: int(a[()])),
    "float": Kind(F8, 0, lambda v: np.array(v, dtype=F8), lambda a: float(a[()])),
    "bool": Kind(U1, 0, lambda v: np.array(int(v), dtype=U1), lambda a: _bools(a)[0]),
    "str": Kind(U1, 1, lambda v: np.frombuffer(v.encode("utf-8"), dtype=U1), _utf8),
    "None": Kind(U1, 1, lambda v: np.zeros(0, dtype=U1), _none),
}
"""Single values by ``pytype``."""



def _sequence(container: type, kind: str) -> Kind:
    dtype = SCALARS[kind].dtype

    def decode(raw: np.ndarray) -> Any:
        return container(_bools(raw) if kind == "bool" else raw.tolist())

    return Kind(dtype, 1, lambda v: np.array(list(v), dtype=dtype), decode)


SEQUENCES = {f"{c.__name__}[{k}]": _sequence(c, k) for c in (list, tuple) for k in ("int", "float", "bool")}
"""Homogeneous numeric lists and tuples as one 1-d dataset (an optimizer's ``params`` indices)."""

KINDS = {**SCALARS, **SEQUENCES}
_ORDER: tuple[tuple[type, str], ...] = ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"),
                                        (type(None), "None"))  # bool before int: True is an int


def scalar_kind(value: Any) -> str | None:
    """The ``pytype`` of a single Python scalar, or None when ``value`` is not one."""
    if isinstance(value, np.generic):
        return None  # NumPy scalars are 0-d arrays (their dtype is kept)
    return next((name for cls, name in _ORDER if isinstance(value, cls)), None)


def encode(value: Any, key: str) -> tuple[np.ndarray, str] | None:
    """``(data, pytype)`` for a scalar or a homogeneous numeric list/tuple; None for anything else."""
    kind = scalar_kind(value)
    if kind is None and type(value) in (list, tuple) and value:
        kinds = {scalar_kind(v) for v in value}
        if len(kinds) == 1 and kinds <= {"int", "float", "bool"}:
            kind = f"{type(value).__name__}[{kinds.pop()}]"
    if kind is None:
        return None
    if "int" in kind and any(not INT64[0] <= v <= INT64[1] for v in (value if kind != "int" else [value])):
        raise CheckpointError(f"{key or 'the root'}: integer out of the int64 range; store it as a str")
    return KINDS[kind].encode(value), kind


def _plain(value: Any) -> str:
    plain = value.item() if isinstance(value, np.generic) else value
    return f"{type(plain).__name__} {plain!r}"[:80]


def check_stored(pytype: Any, ds: Any, where: str) -> str:
    """The metadata of a scalar dataset against its ``pytype`` (no data read); returns the pytype."""
    if isinstance(pytype, bytes):
        pytype = pytype.decode("utf-8", "replace")
    if not isinstance(pytype, str) or pytype not in KINDS:
        raise CheckpointError(f"{where}: unknown {ATTRIBUTE} attribute {_plain(pytype)} (known: {', '.join(KINDS)})")
    kind = KINDS[pytype]
    shape = tuple(ds.shape)
    if ds.dtype != kind.dtype or len(shape) != kind.ndim:
        raise CheckpointError(f"{where}: {ATTRIBUTE} {pytype!r} is stored as a {kind.ndim}-d {kind.dtype.str} "
                              f"dataset, this one is {len(shape)}-d {ds.dtype.str}")
    if ds.dtype.itemsize * int(np.prod(shape)) > MAX_SCALAR_BYTES:
        raise CheckpointError(f"{where}: scalar dataset of {shape} elements exceeds {MAX_SCALAR_BYTES} bytes")
    return pytype


def decode(pytype: str, raw: np.ndarray, where: str) -> Any:
    """The Python value of a checked scalar dataset's data."""
    try:
        return KINDS[pytype].decode(raw)
    except ValueError as exc:
        raise CheckpointError(f"{where}: malformed {pytype!r} value ({exc})") from exc


def check_group(pytype: Any, where: str) -> str:
    """A group's ``pytype`` attribute ("" when absent: a mapping with str keys)."""
    if isinstance(pytype, bytes):
        pytype = pytype.decode("utf-8", "replace")
    if pytype != "" and (not isinstance(pytype, str) or pytype not in GROUP_TYPES):
        raise CheckpointError(f"{where}: unknown group {ATTRIBUTE} attribute {_plain(pytype)} "
                              f"(known: {', '.join(GROUP_TYPES)})")
    return pytype
