"""A checkpoint is untrusted input: check a file's structure before reading a byte of data.

What a dtorch_mpi checkpoint may contain, and nothing else:
- groups and datasets reached by hard links only (no soft, external or user-defined links,
  no object under two names, no member name with a ``.``: keys map one to one to datasets);
- datasets with contiguous, compact or chunked storage in the file itself: no external raw
  storage, no virtual datasets, no filters (dtorch_mpi writes none; compression, shuffle,
  Fletcher32 and plugins are all refused);
- a chunked dataset's chunk may hold at most ``max(dataset bytes, MAX_CHUNK_FLOOR)`` bytes (so
  a small tensor cannot make the reader allocate a huge chunk);
- a simple or scalar dataspace (no null dataspace), and storage that was written;
- the attributes this module reads are bounded (``MAX_ATTRIBUTE_BYTES``) and well typed:
  file ``format`` (the string ``dtorch_mpi``), ``version`` (an integer of ``READABLE``) and,
  from version 3, ``layout`` (a uint64: ``layout_digest`` of every group and dataset with its
  name, ``pytype``, dtype and shape, so a changed, added or removed ``pytype`` attribute, which
  decides how a value is restored, is refused like damaged data);
  dataset ``dtype`` (the exact dtype string, equal to the stored type) and ``checksum``
  (a uint64, see checksum.py); an optional ``pieces`` table (pieces.py: a uint64 array whose
  pieces lie inside the dataset); without a table, an optional ``xxsum`` (a uint64) with
  ``mesh_shape`` and ``written`` (int64 vectors of one length; pieces.check_written); a ``pytype`` attribute (Python scalars and containers,
  pytypes.py) must name a known type whose storage the dataset has.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from math import prod
from typing import Any

import numpy as np

from ..errors import CheckpointError, DTensorError
from . import pieces, pytypes
from .pieces import Layout

FORMAT = "dtorch_mpi"
VERSION = 3  # 2: per-dataset checksum and dtype attributes (version 1 files are refused); 3: the layout digest
READABLE = (2, 3)
LAYOUT = "layout"
MAX_CHUNK_FLOOR = 1 << 20
MAX_ATTRIBUTE_BYTES = 1 << 16


@dataclass(frozen=True)
class Entry:
    """One validated dataset: its h5py object, stored checksum and piece table (None: none stored);
    without a table, the sum check's ``xxsum`` and written ``layout`` (None: not stored)."""

    dataset: Any
    checksum: int
    pieces: np.ndarray | None = None
    xxsum: int | None = None
    layout: Layout | None = None


def check_header(f: Any, path: str) -> int:
    """The file's ``format`` and ``version`` attributes, strictly typed; returns the version."""
    if not _has(f.id, "format"):
        raise CheckpointError(f"{path} is not a dtorch_mpi checkpoint (no format attribute)")
    version = _attribute(f, "version", path, "/", integer=True) if _has(f.id, "version") else None
    fmt = _attribute(f, "format", path, "/", legacy=version is not None and version < 3)
    if isinstance(fmt, bytes):
        fmt = fmt.decode("utf-8", "replace")
    if not isinstance(fmt, str) or fmt != FORMAT:
        raise CheckpointError(f"{path} is not a dtorch_mpi checkpoint (format attribute {_show(fmt)}; "
                              f"expected the string {FORMAT!r})")
    if version is None:
        raise CheckpointError(f"{path}: / lacks the attribute 'version'")
    if not isinstance(version, (int, np.integer)) or isinstance(version, (bool, np.bool_)):
        raise CheckpointError(f"{path}: attribute 'version' must be an integer, got {_show(version)}")
    if int(version) not in READABLE:
        older = (" (version 1 predates per-dataset checksums, so it cannot be verified: load it with the "
                 "dtorch_mpi that wrote it and save it again)") if int(version) == 1 else ""
        raise CheckpointError(f"{path} has checkpoint format version {int(version)}; this dtorch_mpi reads "
                              f"versions {', '.join(map(str, READABLE))}{older}")
    return int(version)


def layout_digest(groups: Mapping[str, str], datasets: Iterable[tuple[str, str, str, tuple[int, ...]]]) -> np.uint64:
    """A 64-bit digest of what decides how a file's values are restored: each group's key and
    ``pytype`` ("" for a mapping with str keys) and each dataset's ``(key, pytype or "", dtype
    string, shape)``. ``save`` stores it as the root's ``layout``; ``check_layout`` recomputes it
    from what ``scan`` found."""
    rows = sorted((key, pytype, dtype, tuple(int(n) for n in shape)) for key, pytype, dtype, shape in datasets)
    text = repr((sorted((str(k), str(v)) for k, v in groups.items()), rows)).encode()
    return np.uint64(int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little"))


def listing_digest(listing: "Listing") -> np.uint64:
    """``layout_digest`` of what ``scan`` found."""
    found = [(key, "", e.dataset.dtype.str, tuple(e.dataset.shape)) for key, e in listing.tensors.items()]
    found += [(key, kind, e.dataset.dtype.str, tuple(e.dataset.shape)) for key, (e, kind) in listing.scalars.items()]
    return layout_digest(listing.groups, found)


def check_layout(f: Any, listing: "Listing", path: str, version: int) -> None:
    """The root's ``layout`` digest against the scanned groups and datasets (version 3 on;
    version 2 files predate it and have none)."""
    if version < 3:
        if _has(f.id, LAYOUT):
            raise CheckpointError(f"{path}: a version-{version} file with a {LAYOUT!r} attribute (added in "
                                  f"version 3): the file's metadata is damaged")
        return
    stored = _uint64(f, LAYOUT, path, "/", path)
    if stored != listing_digest(listing):
        raise CheckpointError(f"{path}: the groups and datasets (names, Python types in 'pytype' attributes, "
                              f"dtypes, shapes) differ from what was saved (the root's {LAYOUT!r} digest): "
                              f"the file's metadata is damaged; nothing was loaded")


@dataclass
class Listing:
    """Everything a file holds, by dotted key: tensor datasets, scalar datasets with their
    ``pytype``, and groups with theirs ("" for a mapping with str keys; the root is "")."""

    tensors: dict[str, Entry] = field(default_factory=dict)
    scalars: dict[str, tuple[Entry, str]] = field(default_factory=dict)
    groups: dict[str, str] = field(default_factory=dict)


def scan(f: Any, path: str, legacy: bool = False) -> Listing:
    """Every group and dataset of the file, after checking links, storage, filters, sizes and
    attributes (``legacy``: a version-2 file, whose strings are variable-length)."""
    h5py = _h5py()
    found = Listing()
    seen: set[int] = set()
    found.groups[""] = _group_type(f, path, "/", legacy)

    def member(group: Any, prefix: str, name: Any) -> Any:
        """Check and list one member of ``group``; a group is returned to be descended into."""
        if not isinstance(name, str):  # h5py gives a name that is not UTF-8 as bytes
            raise CheckpointError(f"{path}: {prefix}/ holds a member named {name!r}, which is not UTF-8 "
                                  f"(save writes UTF-8 names): the file's structure is damaged")
        where = f"{prefix}/{name}"
        if group.id.links.get_info(name.encode()).type != h5py.h5l.TYPE_HARD:
            link = group.get(name, getlink=True)
            raise CheckpointError(f"{path}: {where} is a {type(link).__name__} (dtorch_mpi checkpoints hold no "
                                  f"links; refusing to follow it outside the file or to another object)")
        if "." in name:
            raise CheckpointError(f"{path}: {where} has a '.' in its name (keys map dots to groups, "
                                  f"so this name is ambiguous)")
        oid = h5py.h5o.open(group.id, name.encode())  # low level: ``group[name]`` costs twice as much
        wrap = {h5py.h5g.GroupID: h5py.Group, h5py.h5d.DatasetID: partial(h5py.Dataset, readonly=True)}.get(type(oid))
        obj = wrap(oid) if wrap is not None else group[name]  # anything else is refused below
        address = h5py.h5o.get_info(oid).addr
        if address in seen:
            raise CheckpointError(f"{path}: {where} is a second name of an object already seen")
        seen.add(address)
        key = where[1:].replace("/", ".")
        if isinstance(obj, h5py.Group):
            found.groups[key] = _group_type(obj, path, where, legacy)
            return obj
        if not isinstance(obj, h5py.Dataset):
            raise CheckpointError(f"{path}: {where} is a {type(obj).__name__}, not a group or dataset")
        stored = _check_dataset(obj, where, path, legacy)
        table = _piece_table(obj, where, path)
        entry = Entry(obj, stored, table, *(_piece_sum(obj, where, path) if table is None else (None, None)))
        if _has(obj.id, pytypes.ATTRIBUTE):
            kind = _attribute(obj, pytypes.ATTRIBUTE, path, where, legacy=legacy)
            found.scalars[key] = entry, pytypes.check_stored(kind, obj, f"{path}: dataset {where}")
        else:
            found.tensors[key] = entry
        return None

    # depth first over a stack of open groups: a recursive closure would be a reference cycle
    # (each load's datasets left to the cycle collector) and would recurse as deep as the file nests
    pending = [(f, "", iter(f))]
    try:
        while pending:
            group, prefix, names = pending[-1]
            name = next(names, None)
            if name is None:
                pending.pop()
            elif (inner := member(group, prefix, name)) is not None:
                pending.append((inner, f"{prefix}/{name}", iter(inner)))
    except CheckpointError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: the file's structure is damaged ({exc})") from exc
    return found


RAW_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError, IndexError)
"""What h5py raises on a damaged file (e.g. RuntimeError "bad version number for attribute
message"); the library's own errors (``DTensorError``) pass through ``damaged`` unchanged."""


@contextmanager
def damaged(path: str, doing: str = "reading its metadata") -> Iterator[None]:
    """Turn h5py's raw errors on a damaged file into a ``CheckpointError`` naming the file."""
    try:
        yield
    except DTensorError:
        raise
    except RAW_ERRORS as exc:
        raise CheckpointError(f"{path}: the file is damaged ({doing} failed: {type(exc).__name__}: {exc}); "
                              f"nothing was loaded") from exc


def _group_type(group: Any, path: str, where: str, legacy: bool) -> str:
    kind = _attribute(group, pytypes.ATTRIBUTE, path, where, legacy=legacy) if _has(group.id, pytypes.ATTRIBUTE) else ""
    return pytypes.check_group(kind, f"{path}: group {where}")


def _check_dataset(ds: Any, where: str, path: str, legacy: bool = False) -> int:
    """Refuse what could read outside the file or allocate without bound; return the stored checksum."""
    from h5py import h5d, h5t

    what = f"{path}: dataset {where}"
    dcpl = ds.id.get_create_plist()  # once (``ds.is_virtual`` would make another)
    layout = dcpl.get_layout()
    if layout == h5d.VIRTUAL:
        raise CheckpointError(f"{what} is a virtual dataset (it reads other files); refused")
    if dcpl.get_external_count():
        raise CheckpointError(f"{what} keeps its data in external files; refused (data must be inside the checkpoint)")
    if layout not in (h5d.CONTIGUOUS, h5d.COMPACT, h5d.CHUNKED):
        raise CheckpointError(f"{what} has an unsupported storage layout ({layout})")
    if ds.shape is None:
        raise CheckpointError(f"{what} has a null dataspace (no shape); a tensor needs a simple or scalar one")
    nbytes = prod(ds.shape) * ds.dtype.itemsize
    if layout == h5d.CHUNKED:
        chunk = prod(dcpl.get_chunk()) * ds.dtype.itemsize
        limit = max(nbytes, MAX_CHUNK_FLOOR)
        if chunk > limit:
            raise CheckpointError(f"{what} is stored in chunks of {chunk} bytes for {nbytes} bytes of data "
                                  f"(limit: max(dataset bytes, {MAX_CHUNK_FLOOR})); refused")
    filters = [dcpl.get_filter(i)[3].decode("ascii", "replace") or str(dcpl.get_filter(i)[0])
               for i in range(dcpl.get_nfilters())]
    if filters:
        raise CheckpointError(f"{what} uses HDF5 filters {filters}; dtorch_mpi checkpoints use none (refused)")
    if not ds.id.get_type().equal(h5t.py_create(ds.dtype)):
        raise CheckpointError(f"{what} has an HDF5 type that is not the standard one for {ds.dtype.str} "
                              f"(a damaged type message); refused")
    stored = _attribute(ds, "dtype", path, where, legacy=legacy)
    if isinstance(stored, bytes):
        stored = stored.decode("utf-8", "replace")
    if not isinstance(stored, str) or stored != ds.dtype.str:
        raise CheckpointError(f"{what} is stored as {ds.dtype.str} but its 'dtype' attribute says {_show(stored)}: "
                              f"the file's metadata is damaged")
    checksum = _uint64(ds, "checksum", path, where, what)
    if nbytes and not ds.id.get_storage_size():
        raise CheckpointError(f"{what} has no data stored (it was never written)")
    return checksum


def _piece_table(ds: Any, where: str, path: str) -> np.ndarray | None:
    """The dataset's validated piece table, or None when it has none (older files: lin64 only)."""
    if not _has(ds.id, pieces.ATTRIBUTE):
        return None
    what = f"{path}: dataset {where}"
    value = _attribute(ds, pieces.ATTRIBUTE, path, where, scalar=False,
                       layout=lambda dtype, shape: pieces.check_layout(dtype, shape, tuple(ds.shape), what))
    return pieces.check(value, tuple(ds.shape), what)


def _piece_sum(ds: Any, where: str, path: str) -> tuple[int | None, Layout | None]:
    """The sum check's validated ``xxsum`` and written layout (pieces.py), or (None, None) when
    the dataset has no ``xxsum`` (files before it, complete arrays: lin64)."""
    if not _has(ds.id, pieces.SUM):
        return None, None
    what = f"{path}: dataset {where}"
    xxsum = _uint64(ds, pieces.SUM, path, where, what)
    mesh_shape, written = (_attribute(ds, name, path, where, scalar=False) for name in (pieces.MESH, pieces.WRITTEN))
    return xxsum, pieces.check_written(mesh_shape, written, tuple(ds.shape), what)


def _uint64(obj: Any, name: str, path: str, where: str, what: str) -> int:
    """A uint64 scalar attribute (a digest or a checksum); ``what`` names its owner in the error."""
    value = _attribute(obj, name, path, where)
    if not isinstance(value, np.uint64):
        raise CheckpointError(f"{what}: attribute {name!r} must be a uint64, got {_show(value)}; "
                              f"the file's metadata is damaged")
    return int(value)


def _attribute(obj: Any, name: str, path: str, where: str, scalar: bool = True,
               layout: Callable[[np.dtype, tuple[int, ...]], None] | None = None, *, legacy: bool = False,
               integer: bool = False) -> Any:
    """Read one attribute after bounding its size; a missing one is an error (so is an array,
    unless ``scalar`` is False; ``layout`` checks an array's stored type and shape). Both are
    checked before the read: the storage size does not bound variable-length contents. Opened
    once through h5py's low-level API (``obj.attrs[name]`` costs three opens and a new Group for
    a File: it was most of a small load's time). Its HDF5 type is checked before the read too:
    a standard number or string type (``_standard_type``), an integer where ``integer`` says so,
    and no variable-length string unless ``legacy`` (version 2): those live in the global heap,
    on a damaged one of which HDF5 can hang; version 3 writes fixed-length strings."""
    from h5py import h5a, h5t

    if not _has(obj.id, name):
        raise CheckpointError(f"{path}: {where} lacks the attribute {name!r}")
    attr = h5a.open(obj.id, name.encode())
    if attr.get_storage_size() > MAX_ATTRIBUTE_BYTES:
        raise CheckpointError(f"{path}: attribute {name!r} of {where} holds {attr.get_storage_size()} bytes "
                              f"(limit {MAX_ATTRIBUTE_BYTES})")
    if scalar and (attr.shape not in ((), None) or attr.dtype.subdtype is not None):
        shape = (attr.shape or ()) + (attr.dtype.subdtype[1] if attr.dtype.subdtype is not None else ())
        raise CheckpointError(f"{path}: attribute {name!r} of {where} is an array of shape {shape}; "
                              f"expected a scalar")
    if layout is not None:
        layout(attr.dtype, tuple(attr.shape or ()))
    tid = attr.get_type()
    if not _standard_type(tid):
        raise CheckpointError(f"{path}: attribute {name!r} of {where} has a malformed or unsupported HDF5 type "
                              f"(not a standard integer, float or string type); the file's metadata is damaged")
    if integer and tid.get_class() != h5t.INTEGER:
        word = "str" if tid.get_class() == h5t.STRING else "float"
        raise CheckpointError(f"{path}: attribute {name!r} must be an integer, got a {word}")
    if tid.get_class() == h5t.STRING and tid.is_variable_str() and not legacy:
        raise CheckpointError(f"{path}: attribute {name!r} of {where} is a variable-length string; version-3 "
                              f"files store fixed-length strings: the file's metadata is damaged")
    try:
        value = _value(attr)
    except (OSError, TypeError, ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"{path}: attribute {name!r} of {where} cannot be read ({exc})") from exc
    return value


def _standard_type(tid: Any) -> bool:
    """Whether an HDF5 type is one h5py converts safely: a standard integer or IEEE float type
    (of either byte order), or a string of a known character set and padding. A damaged type
    message can hold reserved field values that make the read crash the process (a segfault
    in the type conversion): such a type is refused before anything is read."""
    from h5py import h5t

    kind = tid.get_class()
    if kind == h5t.STRING:
        return bool(tid.get_cset() in (h5t.CSET_ASCII, h5t.CSET_UTF8)
                    and tid.get_strpad() in (h5t.STR_NULLTERM, h5t.STR_NULLPAD, h5t.STR_SPACEPAD))
    if kind in (h5t.INTEGER, h5t.FLOAT):  # every field (precision, offset, exponent...) as the standard type has it
        return bool(tid.equal(h5t.py_create(tid.dtype)))
    return False


def _has(oid: Any, name: str) -> bool:
    from h5py import h5a

    return bool(h5a.exists(oid, name.encode()))


def _value(attr: Any) -> Any:
    """An open attribute's value exactly as h5py's ``AttributeManager.__getitem__`` returns it
    (``Empty`` for a null dataspace, ``str`` for variable-length strings, NumPy scalars for 0-d)."""
    from h5py import Empty, h5t

    shape, dtype = attr.shape, attr.dtype
    if shape is None:
        return Empty(dtype)
    htype = h5t.py_create(dtype)
    if dtype.subdtype is not None:  # a top-level array type: NumPy sees its dims as the array's
        dtype, sub = dtype.subdtype
        shape = shape + sub
    arr = np.zeros(shape, dtype=dtype, order="C")
    attr.read(arr, mtype=htype)
    string = h5t.check_string_dtype(dtype)
    if string and string.length is None:
        arr = np.array([b.decode("utf-8", "surrogateescape") for b in arr.flat], dtype=dtype).reshape(arr.shape)
    return arr[()] if arr.ndim == 0 else arr


def _show(value: Any) -> str:
    """Type and (shortened) value, for messages."""
    plain = value.item() if isinstance(value, np.generic) else value
    return f"{type(plain).__name__} {repr(plain)[:60]}"


def _h5py() -> Any:
    import h5py

    return h5py
