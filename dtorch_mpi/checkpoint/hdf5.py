"""HDF5 checkpoints: one plain file, parallel writes, resharding loads, atomic saves.

Layout: one dataset per tensor with its global shape and dtype; dotted names are groups
(``layer.weight`` -> ``/layer/weight``). File attributes ``format = "dtorch_mpi"``,
``version`` and ``layout`` (a digest of every name, ``pytype``, dtype and shape: validate.py);
dataset attributes ``dtype`` (the exact dtype string), ``checksum`` (checksum.py,
computed collectively from the written pieces), ``pieces`` (each written piece's region and
xxh3, pieces.py: a load whose regions those pieces tile verifies with it), ``placements`` and ``mesh_shape``
(information only: any target layout can load it). No pickle anywhere; plain h5py reads it.

Loads treat the file as untrusted (validate.py): links, external storage, virtual datasets,
filters and oversized chunks are refused before a byte is read, and every dataset is verified
against its checksum before anything is installed in the target (reader.py).

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
from dataclasses import dataclass, field
from math import prod
from typing import Any, cast

import numpy as np
from mpi4py import MPI

from .._mpi import library_world
from ..comm.deadline import wait_request
from ..dtensor import DTensor
from ..errors import CheckpointError
from ..placement import Partial, Replicate, Shard
from ..spmd import agreed, require_same
from . import pieces, pytypes, targets, tree, validate
from .checksum import checksum, digest, require_hasher
from .reader import STAGING, own_checks, read_verified
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
    return "/" + name.replace(".", "/")


def _writable(value: Any) -> DTensor:
    """Partial tensors are reduce-scattered (each rank then writes a slice of the value)."""
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


def _writing_copies(world: MPI.Intracomm, tensors: Mapping[str, DTensor]) -> dict[str, bool]:
    """Whether this rank's mesh writes each tensor. The disjoint meshes that may hold one key
    (``mesh["tp"]`` of each dp row holds the same tensor) are copies of it: the one holding the
    lowest world rank writes, so every element is written once (one Allreduce)."""
    size = world.Get_size()
    mine = np.array([int(t.device_mesh.mesh.min()) if t.device_mesh.get_coordinate() is not None else size
                     for t in tensors.values()], dtype=np.int64)
    lowest = np.empty_like(mine)
    if len(mine):  # the same number of tensors on every rank (agreed by _same_everywhere)
        wait_request(world.Iallreduce(mine, lowest, op=MPI.MIN), "the checkpoint save's choice of writers (Allreduce)")
    return {key: bool(m == low) for key, m, low in zip(tensors, mine, lowest)}


def _term(piece: tuple[Any, Any, Any] | None, t: DTensor) -> int:
    """This rank's term of the tensor's checksum (0 when it writes nothing)."""
    return 0 if piece is None else checksum(piece[2], tuple(piece[0]), t.shape)


@dataclass
class _Slab:
    """One dataset to write: global shape and dtype, attributes, this rank's piece and checksum term."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    piece: tuple[Any, Any, Any] | None
    term: int
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize

    def record(self) -> np.ndarray:
        """This rank's lin64 term and piece-table row (the piece's xxh3 from the bytes in memory)."""
        piece = self.piece if self.piece is not None and prod(self.piece[1]) else None
        return pieces.record(self.term, len(self.shape), piece, digest(piece[2]) if piece is not None else 0)


def _complete(leaf: tree.Leaf) -> np.ndarray:
    """A complete array leaf (a NumPy array or an encoded scalar), C-contiguous with its shape."""
    value = leaf.value.get() if hasattr(leaf.value, "get") and not isinstance(leaf.value, np.ndarray) else leaf.value
    array = np.asarray(value)
    if array.dtype.kind not in "biufc":
        raise CheckpointError(f"{leaf.key}: cannot save a NumPy array of dtype {array.dtype} "
                              f"(numbers and bools only; a str is saved as a Python str)")
    return np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray makes 0-d 1-d


def _describe(leaves: list[tree.Leaf], wholes: Mapping[str, tuple[np.ndarray, int]]) -> list[tuple[Any, ...]]:
    """What every rank must agree on: keys, shapes, dtypes, placements (DTensors) or content (the rest)."""
    return [(leaf.key, leaf.value.shape, str(leaf.value.dtype), repr(leaf.value.placements))
            if isinstance(leaf.value, DTensor) else (leaf.key, leaf.pytype, *wholes[leaf.key][0].shape,
                                                     str(wholes[leaf.key][0].dtype), wholes[leaf.key][1])
            for leaf in leaves]


def _slab(leaf: tree.Leaf, writable: Mapping[str, DTensor], writes: Mapping[str, bool],
          wholes: Mapping[str, tuple[np.ndarray, int]], rank: int) -> _Slab:
    """A DTensor is written piece by piece (``writable``: Partial ones reduced) by the mesh that
    ``writes`` it; a complete array by rank 0."""
    if isinstance(leaf.value, DTensor):
        t = writable[leaf.key]
        piece = _writer_piece(t) if writes[leaf.key] else None
        return _Slab(leaf.key, t.shape, t.dtype, piece, _term(piece, t),
                     {"placements": repr(list(leaf.value.placements)),
                      "mesh_shape": np.array(t.device_mesh.shape, dtype=np.int64)})
    array, term = wholes[leaf.key]  # its lin64 checksum
    mine = rank == 0
    return _Slab(leaf.key, array.shape, array.dtype, ((0,) * array.ndim, array.shape, array) if mine else None,
                 term if mine else 0, {pytypes.ATTRIBUTE: leaf.pytype} if leaf.pytype else {})


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


def save(obj: Mapping[Any, Any], path: str | os.PathLike) -> None:
    """Write ``obj`` to one HDF5 file at ``path``, atomically.

    ``obj`` is a mapping, nested as you like, of DTensors, NumPy arrays (complete values, the
    same on every rank) and Python scalars (int, float, bool, str, None, lists and tuples);
    a Module or Optimizer stands for its ``state_dict()``: ``save({"model": model, "optim":
    optimizer, "step": 100}, path)``. Collective: every rank calls it with the same structure
    and path. Raises ``CheckpointError`` on every rank if any rank fails; ``path`` is then untouched.
    """
    world = library_world()
    rank = world.Get_rank()
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    tmp = ""
    with agreed(world):
        h5py = _h5py()  # h5py and xxhash on every rank (some may have nothing to hash)
        require_hasher()
        if not isinstance(obj, Mapping):
            raise CheckpointError(f"save() needs a mapping (of DTensors, arrays and scalars), got {type(obj).__name__}")
        layout = tree.flatten(obj)
        wholes = {leaf.key: (array, checksum(array, (0,) * array.ndim, array.shape))
                  for leaf in layout.leaves if not isinstance(leaf.value, DTensor) for array in [_complete(leaf)]}
    with agreed(world):
        _same_everywhere(world, {"paths": ("path", path),
                                 "state_dicts": ("keys, shapes, dtypes, placements or values",
                                                 repr((sorted(layout.groups.items()), _describe(layout.leaves, wholes))))})
        if not os.path.isdir(directory):
            raise CheckpointError(f"cannot save to {path}: directory {directory} does not exist")
    token_buf = np.frombuffer(uuid.uuid4().hex.encode(), dtype=np.uint8).copy()
    wait_request(world.Ibcast(token_buf, root=0), "the checkpoint save's file name (Bcast)")
    token = token_buf.tobytes().decode()
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{token}.tmp")
    parallel = has_parallel_hdf5()
    try:
        with agreed(world):  # the collective part (Partial tensors are reduced) before the local part
            writable = {leaf.key: _writable(leaf.value) for leaf in layout.leaves if isinstance(leaf.value, DTensor)}
        writes = _writing_copies(world, writable)
        with agreed(world):
            slabs = [_slab(leaf, writable, writes, wholes, rank) for leaf in layout.leaves]
        with agreed(world):
            if parallel:
                _save_parallel(h5py, world, tmp, layout.groups, slabs)
            else:
                _save_in_turn(h5py, world, tmp, layout.groups, slabs)
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
    wait_request(world.Ibarrier(), "the end of the checkpoint save (Barrier)")


def _same_everywhere(world: MPI.Intracomm, facts: Mapping[str, tuple[str, str]]) -> None:
    """``{argument: (what it holds, text)}``: raise (on every rank) for the first argument whose
    text differs between ranks, naming each rank's text (one Allreduce for all of them)."""
    require_same(world, {what: text for what, text in facts.values()}, error=CheckpointError,
                 what={what: f"ranks passed different {argument}" for argument, (what, _) in facts.items()})


def _create_datasets(f: Any, groups: Mapping[str, str], slabs: list[_Slab]) -> dict[str, Any]:
    f.attrs["format"] = _fixed(FORMAT)  # strings the loader reads are fixed-length (validate._attribute)
    f.attrs["version"] = VERSION
    f.attrs[validate.LAYOUT] = validate.layout_digest(
        groups, [(slab.key, str(slab.attrs.get(pytypes.ATTRIBUTE, "")), slab.dtype.str, slab.shape) for slab in slabs])
    for key, kind in sorted(groups.items()):
        group = f.require_group(_group_path(key)) if key else f
        if kind:
            group.attrs[pytypes.ATTRIBUTE] = _fixed(kind)
    out = {}
    for slab in slabs:
        ds = f.create_dataset(_group_path(slab.key), shape=slab.shape, dtype=slab.dtype)
        ds.attrs["dtype"] = _fixed(slab.dtype.str)
        ds.attrs.update({k: _fixed(v) if k == pytypes.ATTRIBUTE else v for k, v in slab.attrs.items()})
        out[slab.key] = ds
    return out


def _fixed(text: str) -> np.bytes_:
    """A fixed-length string attribute (h5py writes a ``str`` variable-length, in the global heap)."""
    return np.bytes_(text.encode("utf-8"))


def _gathered_checksums(world: MPI.Intracomm, slabs: list[_Slab]) -> list[tuple[int, np.ndarray | None]]:
    """Every dataset's lin64 checksum and piece table (one Allgather; the same on every rank),
    after checking that the written pieces cover each dataset once (the same verdict everywhere:
    a tensor held on overlapping meshes would be written twice in places and never in others)."""
    sums = pieces.gather(world, [slab.record() for slab in slabs])
    for slab, (_, table) in zip(slabs, sums):
        written = 0 if table is None else int(np.prod(table[:, len(slab.shape) : 2 * len(slab.shape)],
                                                      axis=1, dtype=np.uint64).sum())
        if written != prod(slab.shape):
            raise CheckpointError(f"{slab.key}: the ranks wrote {written} of its {prod(slab.shape)} elements; each "
                                  f"element must be written once (the ranks hold it on meshes that overlap or "
                                  f"leave parts out: save it from one mesh, or from disjoint copies of one)")
    return sums


def _set_checksums(datasets: Mapping[str, Any], slabs: list[_Slab],
                   sums: list[tuple[int, np.ndarray | None]]) -> None:
    """Store each dataset's checksum and its piece table (unless empty or over the attribute limit)."""
    for slab, (total, table) in zip(slabs, sums):
        attrs = datasets[slab.key].attrs
        attrs["checksum"] = np.uint64(total)
        if table is not None and table.nbytes <= pieces.MAX_TABLE_BYTES:
            attrs[pieces.ATTRIBUTE] = table


def _save_parallel(h5py: Any, world: MPI.Intracomm, tmp: str, groups: Mapping[str, str], slabs: list[_Slab]) -> None:
    progress = _Progress(sum(slab.nbytes for slab in slabs), world.Get_rank())
    with h5py.File(tmp, "w", driver="mpio", comm=world) as f:
        datasets = _create_datasets(f, groups, slabs)
        for slab in slabs:
            if not slab.nbytes:
                continue  # no storage to write (the same decision on every rank)
            with agreed(world):  # an I/O error the write reports on one rank stops every rank
                _write_slab(h5py, datasets[slab.key], slab.piece, collective=True)
            progress.add(slab.nbytes, "saving")
        _set_checksums(datasets, slabs, _gathered_checksums(world, slabs))
    # no H5Fflush here: with MPI-IO it is an MPI_File_sync, and the file is fsynced after close
    progress.close()


def _save_in_turn(h5py: Any, world: MPI.Intracomm, tmp: str, groups: Mapping[str, str], slabs: list[_Slab]) -> None:
    global _warned
    rank = world.Get_rank()
    if not _warned and rank == 0 and world.Get_size() > 1:
        warnings.warn("h5py has no MPI support: checkpoint ranks write in turn (slower); "
                      "install a parallel h5py for collective MPI-IO", stacklevel=3)
    _warned = True
    with agreed(world):
        if rank == 0:
            with h5py.File(tmp, "w") as f:
                _create_datasets(f, groups, slabs)
    error: Exception | None = None
    mine = [slab for slab in slabs if slab.piece is not None and prod(slab.piece[1])]
    for turn in range(world.Get_size()):
        if turn == rank and mine:
            try:
                with h5py.File(tmp, "r+") as f:
                    for slab in mine:
                        _write_slab(h5py, f[_group_path(slab.key)], slab.piece, collective=False)
            except Exception as exc:
                error = exc
        wait_request(world.Ibarrier(), "the checkpoint save's writes in turn (Barrier)")
    with agreed(world):
        if error is not None:
            raise error
    sums = _gathered_checksums(world, slabs)
    with agreed(world):
        if rank == 0:
            with h5py.File(tmp, "r+") as f:
                _set_checksums({slab.key: f[_group_path(slab.key)] for slab in slabs}, slabs, sums)


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
    """Load a checkpoint into ``target`` in place and return it.

    ``target``: a Module, an Optimizer, a DTensor, or a mapping (nested like the saved object)
    of these, e.g. ``{"model": model, "optim": optimizer, "step": 0}``; any other value of a
    mutable mapping (``"step": 0``) is replaced by the stored value (Python scalars with their
    exact types; complete NumPy arrays for tensors). Modules and DTensors keep their current
    placements and mesh (resharding: each rank reads only its own hyperslab); an Optimizer gets
    the saved hyperparameters and scalar state, and its moments take their parameters' current
    placements. ``strict=False`` loads what both sides have.

    The file is validated (no links, external or virtual storage, filters, oversized chunks or
    malformed scalar metadata), everything is checked against the target before anything is
    read, and every dataset is verified against its checksum before anything is installed.
    Every rank raises ``CheckpointError`` (or the load's own error type) when any rank fails;
    the target is then unchanged.

    ``staging="all"`` (default) holds every piece read until all are verified (peak: one extra
    copy of this rank's share of the target); ``staging="chunks"`` reads twice instead and needs
    one chunk (at most one tensor's piece) extra. See reader.py.
    """
    from ..stateful import check_fill as _check

    world = library_world()
    path = os.path.abspath(os.fspath(path))
    handle = None
    try:
        with agreed(world):
            h5py = _h5py()  # h5py and xxhash on every rank (some may have nothing to hash)
            require_hasher()
            found = targets.parts(target)  # what cannot be loaded into raises on every rank
        with agreed(world):  # apart: a rank that failed above must not meet the others' comparison
            _same_everywhere(world, {"paths": ("path", path), "staging options": ("staging", repr(staging))})
            if staging not in STAGING:
                raise CheckpointError(f"load(staging={staging!r}): use one of {', '.join(STAGING)}")
            _check_openable(h5py, path, world)
        try:
            failed: Exception | None = None
            handle = _open(h5py, world, path)
        except Exception as exc:  # agreed below, with the validation
            failed = exc
        # one agreement for the open (collective with MPI-IO) and the validation; h5py's raw errors
        # on damaged metadata become a CheckpointError naming the file
        with agreed(world), validate.damaged(path):
            if failed is not None:
                raise failed
            version = validate.check_header(handle, path)
            listing = validate.scan(handle, path, legacy=version < 3)
            validate.check_layout(handle, listing, path, version)
            restore = targets.match(found, listing, path, strict)
            keys = _check(cast(Mapping[str, Any], restore.tensors),
                          {k: listing.tensors[k].dataset for k in restore.tensors}, strict=False)
            mine = own_checks(restore.tensors, listing.tensors, keys)
        try:
            read_verified(restore.tensors, listing.tensors, keys, path, staging, mine)
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path}: reading failed ({exc}); the file is damaged") from exc
        for commit in restore.commits:
            commit()
    finally:
        if handle is not None:
            handle.close()
    return target


def _check_openable(h5py: Any, path: str, world: MPI.Intracomm) -> None:
    """The file exists and is HDF5; before a collective MPI-IO open, rank 0 also opens it alone
    (agreed by the caller): HDF5's collective open hangs on some damaged superblocks (an error
    on one rank, the others waiting in its broadcast), where a serial open just fails."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    if not h5py.is_hdf5(path):
        raise CheckpointError(f"{path} is not an HDF5 file (truncated, corrupt or another format)")
    if has_parallel_hdf5() and world.Get_size() > 1 and world.Get_rank() == 0:
        try:
            h5py.File(path, "r").close()
        except Exception as exc:
            raise CheckpointError(f"{path} cannot be opened as HDF5: {exc}") from exc


def _open(h5py: Any, world: MPI.Intracomm, path: str) -> Any:
    """Open read-only (collectively with MPI-IO when h5py has it); every rank checked the path first."""
    try:
        if has_parallel_hdf5() and world.Get_size() > 1:
            return h5py.File(path, "r", driver="mpio", comm=world)
        return h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be opened as HDF5: {exc}") from exc
