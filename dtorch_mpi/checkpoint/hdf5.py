"""HDF5 checkpoints: one plain file, parallel writes, resharding loads, atomic saves.

Layout: one dataset per tensor with its global shape and dtype; dotted names are groups
(``layer.weight`` -> ``/layer/weight``). File attributes ``format = "dtorch_mpi"`` and
``version``; dataset attributes ``dtype`` (the exact dtype string), ``checksum`` (checksum.py,
computed collectively from the written pieces), ``placements`` and ``mesh_shape`` (information
only: any target layout can load it). No pickle anywhere; plain h5py reads it.

Loads treat the file as untrusted (validate.py): links, external storage, virtual datasets,
filters and oversized chunks are refused before a byte is read, and every dataset is verified
against its checksum before anything is copied into the target (reader.py).

Writes: with an MPI-enabled h5py the file is opened with ``driver="mpio"`` and every rank
writes its own hyperslab in one collective call per tensor (ranks with nothing to write still
take part, with an empty selection: h5py would skip a zero-size write and hang the others). A
``Replicate`` tensor is written by one replica; a ``Partial`` tensor is first reduce-scattered
so that each rank writes a slice of the reduced value. Without MPI in h5py (the pip wheel),
rank 0 creates the file and the ranks then write their hyperslabs in turn (one warning). Every
write is agreed: an I/O error on one rank makes every rank raise, never leaves one in a collective.

Atomic: the file is written under a temporary name in the same directory, flushed and fsynced;
only when every rank has succeeded does rank 0 rename it over ``path`` (and fsync the
directory). A failure on any rank aborts the save on all ranks and removes the temporary file:
the previous checkpoint stays intact.
"""

from __future__ import annotations

import os
import sys
import uuid
import warnings
from collections.abc import Mapping
from math import prod
from typing import Any

import numpy as np
from mpi4py import MPI

from .._mpi import library_world
from ..dtensor import DTensor
from ..errors import CheckpointError
from ..placement import Partial, Replicate, Shard
from ..spmd import agreed
from . import validate
from .checksum import checksum, combine
from .reader import STAGING, read_verified
from .validate import FORMAT, VERSION

PROGRESS_THRESHOLD = 64 << 20
_warned = False


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a test dependency
        raise CheckpointError("checkpoints need h5py: pip install h5py") from exc
    return h5py


def has_parallel_hdf5() -> bool:
    """True when h5py was built with MPI (``driver="mpio"`` available)."""
    return bool(_h5py().get_config().mpi)


def _group_path(name: str) -> str:
    if not name or any(not part for part in name.split(".")) or "/" in name:
        raise CheckpointError(f"state_dict key {name!r} cannot be a dataset name (dotted words only)")
    return "/" + name.replace(".", "/")


def _writable(value: Any) -> DTensor:
    """Partial tensors are reduce-scattered (each rank then writes a slice of the value)."""
    if not isinstance(value, DTensor):
        raise CheckpointError(f"save() takes DTensors (a module's state_dict()); got {type(value).__name__}")
    if not any(isinstance(p, Partial) for p in value.placements):
        return value
    target = [Shard(0) if isinstance(p, Partial) and value.ndim else Replicate() if isinstance(p, Partial) else p
              for p in value.placements]
    return value.redistribute(placements=target)


def _writer_piece(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...], Any] | None:
    """This rank's hyperslab to write (None when another replica writes it)."""
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None
    if any(isinstance(p, Replicate) and coord[k] != 0 for k, p in enumerate(t.placements)):
        return None
    shape, offset = t.spec.local_shape_and_offset
    local = t.to_local()
    if hasattr(local, "get"):
        local = local.get()
    return offset, shape, np.ascontiguousarray(local).reshape(shape)  # ascontiguousarray makes 0-d 1-d


def _term(piece: tuple[Any, Any, Any] | None, t: DTensor) -> int:
    """This rank's term of the tensor's checksum (0 when it writes nothing)."""
    return 0 if piece is None else checksum(piece[2], tuple(piece[0]), t.shape)


class _Progress:
    def __init__(self, total: int, rank: int) -> None:
        self.total, self.done = total, 0
        self.show = rank == 0 and total >= PROGRESS_THRESHOLD and sys.stderr.isatty()

    def add(self, nbytes: int, what: str) -> None:
        self.done += nbytes
        if self.show:
            sys.stderr.write(f"\r{what}: {self.done / 2**20:,.0f} / {self.total / 2**20:,.0f} MiB")
            sys.stderr.flush()

    def close(self) -> None:
        if self.show:
            sys.stderr.write("\n")


def _write_slab(h5py: Any, ds: Any, piece: tuple[Any, Any, Any] | None, collective: bool) -> None:
    from h5py import h5fd, h5p, h5s

    dxpl = h5p.create(h5p.DATASET_XFER)
    if collective:
        dxpl.set_dxpl_mpio(h5fd.MPIO_COLLECTIVE)
    fspace = ds.id.get_space()
    if piece is None or prod(piece[1]) == 0:
        if not collective:
            return
        mspace = h5s.create_simple((1,))
        mspace.select_none()
        fspace.select_none()
        ds.id.write(mspace, fspace, np.zeros(1, dtype=ds.dtype), dxpl=dxpl)
        return
    offset, shape, data = piece
    if shape:
        fspace.select_hyperslab(tuple(offset), tuple(shape))
        mspace = h5s.create_simple(tuple(shape))
    else:
        mspace = h5s.create(h5s.SCALAR)
    ds.id.write(mspace, fspace, data, dxpl=dxpl)


def save(state_dict: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write ``state_dict`` (name -> DTensor) to one HDF5 file at ``path``, atomically.

    Collective: every rank calls it with the same keys and path. Raises ``CheckpointError`` on
    every rank if any rank fails; ``path`` is then untouched.
    """
    h5py = _h5py()
    world = library_world()
    rank = world.Get_rank()
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    tmp = ""
    with agreed(world):
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(f"save() needs a mapping name -> DTensor, got {type(state_dict).__name__}")
        items = sorted(state_dict.items())
    with agreed(world):
        described = [(n, getattr(v, "shape", None), str(getattr(v, "dtype", None)), repr(getattr(v, "placements", None)))
                     for n, v in items]
        _same_everywhere(world, {"paths": path,
                                 "state_dicts (keys, shapes, dtypes or placements differ)": repr(described)})
        for name, value in items:
            _group_path(name)
            if not isinstance(value, DTensor):
                raise CheckpointError(f"{name}: save() takes DTensors, got {type(value).__name__}")
        if not os.path.isdir(directory):
            raise CheckpointError(f"cannot save to {path}: directory {directory} does not exist")
    token_buf = np.frombuffer(uuid.uuid4().hex.encode(), dtype=np.uint8).copy()
    world.Bcast(token_buf, root=0)
    token = token_buf.tobytes().decode()
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{token}.tmp")
    parallel = has_parallel_hdf5()
    try:
        with agreed(world):
            tensors = [(name, _writable(v)) for name, v in items]
            sources = {name: v for name, v in items}
        with agreed(world):
            if parallel:
                _save_parallel(h5py, world, tmp, tensors, sources)
            else:
                _save_in_turn(h5py, world, tmp, tensors, sources)
            if rank == 0:
                _fsync_file(tmp)
        with agreed(world):
            if rank == 0:
                os.replace(tmp, path)
                _fsync_dir(directory)
    except Exception as exc:
        if rank == 0 and os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"saving {path} failed: {exc}") from exc
    world.Barrier()


def _same_everywhere(world: MPI.Intracomm, facts: Mapping[str, str]) -> None:
    """One collective: raise (on every rank) naming each fact whose text differs between ranks."""
    import zlib

    digests = np.array([zlib.crc32(text.encode()) for text in facts.values()], dtype=np.int64)
    both = np.concatenate([digests, -digests])
    low = np.empty_like(both)
    world.Allreduce(both, low, op=MPI.MIN)
    differ = [what for n, what in enumerate(facts) if low[n] != -low[n + len(facts)]]
    if differ:
        raise CheckpointError(f"ranks passed different {' and '.join(differ)}; every rank must pass the same")


def _create_datasets(f: Any, tensors: list[tuple[str, DTensor]], sources: Mapping[str, DTensor]) -> dict[str, Any]:
    f.attrs["format"] = FORMAT
    f.attrs["version"] = VERSION
    out = {}
    for name, t in tensors:
        ds = f.create_dataset(_group_path(name), shape=t.shape, dtype=t.dtype)
        ds.attrs["dtype"] = t.dtype.str
        ds.attrs["placements"] = repr(list(sources[name].placements))
        ds.attrs["mesh_shape"] = np.array(t.device_mesh.shape, dtype=np.int64)
        out[name] = ds
    return out


def _set_checksums(world: MPI.Intracomm, datasets: Mapping[str, Any], tensors: list[tuple[str, DTensor]],
                   terms: list[int]) -> None:
    """Gather every rank's terms and store each dataset's checksum (the same value on every rank)."""
    every = np.empty((world.Get_size(), len(terms)), dtype=np.uint64)
    world.Allgather(np.array(terms, dtype=np.uint64), every)
    for n, (name, _) in enumerate(tensors):
        datasets[name].attrs["checksum"] = np.uint64(combine(every[:, n]))


def _save_parallel(h5py: Any, world: MPI.Intracomm, tmp: str, tensors: list[tuple[str, DTensor]],
                   sources: Mapping[str, DTensor]) -> None:
    progress = _Progress(sum(t.size * t.dtype.itemsize for _, t in tensors), world.Get_rank())
    terms = [0] * len(tensors)
    with h5py.File(tmp, "w", driver="mpio", comm=world) as f:
        datasets = _create_datasets(f, tensors, sources)
        for n, (name, t) in enumerate(tensors):
            if t.size == 0:
                continue  # no storage to write (the same decision on every rank)
            with agreed(world):  # a failure preparing one rank's piece stops every rank here,
                piece = _writer_piece(t)  # before the collective write could hang the others
                terms[n] = _term(piece, t)
            with agreed(world):  # an I/O error the write reports on one rank stops every rank
                _write_slab(h5py, datasets[name], piece, collective=True)
            progress.add(t.size * t.dtype.itemsize, "saving")
        _set_checksums(world, datasets, tensors, terms)
    # no H5Fflush here: with MPI-IO it is an MPI_File_sync, and the file is fsynced after close
    progress.close()


def _save_in_turn(h5py: Any, world: MPI.Intracomm, tmp: str, tensors: list[tuple[str, DTensor]],
                  sources: Mapping[str, DTensor]) -> None:
    global _warned
    rank = world.Get_rank()
    if not _warned and rank == 0 and world.Get_size() > 1:
        warnings.warn("h5py has no MPI support: checkpoint ranks write in turn (slower); "
                      "install a parallel h5py for collective MPI-IO", stacklevel=3)
    _warned = True
    with agreed(world):
        if rank == 0:
            with h5py.File(tmp, "w") as f:
                _create_datasets(f, tensors, sources)
    error: Exception | None = None
    terms = [0] * len(tensors)
    for turn in range(world.Get_size()):
        if turn == rank:
            try:
                pieces = [(name, _writer_piece(t)) for name, t in tensors]
                terms = [_term(p, t) for (_, p), (_, t) in zip(pieces, tensors)]
                if any(p is not None and prod(p[1]) for _, p in pieces):
                    with h5py.File(tmp, "r+") as f:
                        for name, piece in pieces:
                            if piece is not None and int(np.prod(piece[1])):
                                _write_slab(h5py, f[_group_path(name)], piece, collective=False)
            except Exception as exc:
                error = exc
        world.Barrier()
    with agreed(world):
        if error is not None:
            raise error
    every = np.empty((world.Get_size(), len(terms)), dtype=np.uint64)
    world.Allgather(np.array(terms, dtype=np.uint64), every)
    with agreed(world):
        if rank == 0:
            with h5py.File(tmp, "r+") as f:
                for n, (name, _) in enumerate(tensors):
                    f[_group_path(name)].attrs["checksum"] = np.uint64(combine(every[:, n]))


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | os.PathLike, target: Any, *, strict: bool = True, staging: str = "all") -> Any:
    """Load a checkpoint into ``target`` (a module or a mapping name -> DTensor) in place.

    Any placements and mesh shape load any checkpoint (resharding); each rank reads only its own
    hyperslab. ``strict=False`` loads the keys both sides have. The file is validated (no links,
    external or virtual storage, filters or oversized chunks), shapes and dtypes are checked
    against the target before anything is read, and every dataset is verified against its
    checksum before anything is copied in. Every rank raises ``CheckpointError`` (or the load's
    own error type) when any rank fails; the target is then unchanged.

    ``staging="all"`` (default) holds every piece read until all are verified (peak: one extra
    copy of this rank's share of the target); ``staging="chunks"`` reads twice instead and needs
    one chunk (at most one tensor's piece) extra. See reader.py.
    """
    h5py = _h5py()
    from ..nn.module import Module
    from ..nn.state import _check

    world = library_world()
    path = os.path.abspath(os.fspath(path))
    params = target.state_dict() if isinstance(target, Module) else target
    if not isinstance(params, Mapping):
        raise TypeError(f"load() target must be a Module or a mapping name -> DTensor, got {type(target).__name__}")
    handle = None
    try:
        with agreed(world):
            _same_everywhere(world, {"paths": path, "staging options": repr(staging)})
            if staging not in STAGING:
                raise CheckpointError(f"load(staging={staging!r}): use one of {', '.join(STAGING)}")
            _check_openable(h5py, path)
        with agreed(world):
            handle = _open(h5py, world, path)
        with agreed(world):
            validate.check_header(handle, path)
            entries = validate.entries(handle, path)
            if strict:
                missing = [k for k in params if k not in entries]
                unexpected = [k for k in entries if k not in params]
                if missing or unexpected:
                    raise CheckpointError(
                        f"{path} does not match the target: "
                        + (f"missing keys {missing} " if missing else "")
                        + (f"unexpected keys {unexpected}" if unexpected else "")
                        + "; pass strict=False to load a subset"
                    )
            keys = _check(params, {k: entries[k].dataset for k in params if k in entries}, strict=False)
        try:
            read_verified(params, entries, keys, path, staging)
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path}: reading failed ({exc}); the file is damaged") from exc
    finally:
        if handle is not None:
            handle.close()
    return target


def _check_openable(h5py: Any, path: str) -> None:
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    if not h5py.is_hdf5(path):
        raise CheckpointError(f"{path} is not an HDF5 file (truncated, corrupt or another format)")


def _open(h5py: Any, world: MPI.Intracomm, path: str) -> Any:
    """Open read-only (collectively with MPI-IO when h5py has it); every rank checked the path first."""
    try:
        if has_parallel_hdf5() and world.Get_size() > 1:
            return h5py.File(path, "r", driver="mpio", comm=world)
        return h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be opened as HDF5: {exc}") from exc
