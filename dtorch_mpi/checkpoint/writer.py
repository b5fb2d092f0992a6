"""Writing HDF5 checkpoints: collective, atomic, blocking or asynchronous (see hdf5.py for the layout).

A save has two parts. The *prepare* part runs on the calling thread with the library's
collectives: agreement of the structure, Partial tensors reduce-scattered, the choice of writers,
each rank's pieces. The *write* part touches only h5py, the checksums and one communicator:
create the temporary file, write the hyperslabs (collective MPI-IO, or node by node), exchange the
checksums, fsync, rename. ``save(..., async_op=True)`` copies this rank's pieces, duplicates the
world communicator (collectively, on the calling thread) and runs the write part in a background
thread on that duplicate (at ``DTORCH_SAVE_NICE``: the training threads have a busy core
first), so no library collective of the main thread can match one of the writer's.
"""

from __future__ import annotations

import atexit
import itertools
import os
import secrets
import sys
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import settings
from .._mpi import library_world, node_id
from ..arrays import to_host
from ..comm.deadline import wait_request
from ..dtensor import DTensor
from ..errors import CheckpointError
from ..placement import Partial, Replicate, Shard
from ..spmd import agree, agreed, agreed_allgather, agreed_min, require_same
from . import funnel, pieces, pytypes, tree, validate
from .checksum import checksum, require_hasher
from .h5lib import LOCK, fixed, has_parallel_hdf5
from .h5lib import group_path as _group_path
from .h5lib import h5py as _h5py
from .validate import FORMAT, VERSION

PROGRESS_THRESHOLD = 64 << 20
_UNCHOSEN = np.iinfo(np.int64).max  # what ranks other than 0 give to a MIN that carries rank 0's choice
_warned = False


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
    local = to_host(t.to_local())
    return offset, shape, np.ascontiguousarray(local).reshape(shape)  # ascontiguousarray makes 0-d 1-d


def _writing_copies(world: MPI.Intracomm, tensors: Mapping[str, DTensor] | None, count: int,
                    problem: BaseException | None) -> dict[str, bool]:
    """Whether this rank's mesh writes each tensor. The disjoint meshes that may hold one key
    (``mesh["tp"]`` of each dp row holds the same tensor) are copies of it: the one holding the
    lowest world rank writes, so every element is written once. One Allreduce, which also agrees
    on ``problem`` (``tensors`` is None then; ``count`` tensors on every rank, as
    ``_same_everywhere`` agreed)."""
    size = world.Get_size()
    mine = [size] * count if tensors is None else [
        int(t.device_mesh.mesh.min()) if t.device_mesh.get_coordinate() is not None else size for t in tensors.values()]
    lowest = agreed_min(world, problem, mine)
    assert tensors is not None  # (agreed_min raised on every rank otherwise)
    return {key: bool(m == low) for key, m, low in zip(tensors, mine, lowest)}


@dataclass
class _Slab:
    """One dataset to write: global shape and dtype, attributes, this rank's piece and checksum term."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    piece: tuple[Any, Any, Any] | None
    term: int | None  # None: computed from the piece when the write needs it (off the caller's thread)
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize

    def own(self) -> pieces.Own:
        """This rank's lin64 term and non-empty piece (pieces.exchange hashes it if its table is kept)."""
        piece = self.piece if self.piece is not None and prod(self.piece[1]) else None
        term = self.term if self.term is not None else 0 if self.piece is None else checksum(
            self.piece[2], tuple(self.piece[0]), self.shape)
        return pieces.Own(term, len(self.shape), piece)


def _complete(leaf: tree.Leaf) -> np.ndarray:
    """A complete array leaf (a NumPy array or an encoded scalar), C-contiguous with its shape."""
    array = np.asarray(to_host(leaf.value))
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
          wholes: Mapping[str, tuple[np.ndarray, int]], rank: int, copy: bool = False) -> _Slab:
    """A DTensor is written piece by piece (``writable``: Partial ones reduced) by the mesh that
    ``writes`` it; a complete array by rank 0. ``copy``: a piece that is a view of the caller's
    memory is copied (an asynchronous save; pieces that are already new arrays are not)."""
    if isinstance(leaf.value, DTensor):
        t = writable[leaf.key]
        piece = _writer_piece(t) if writes[leaf.key] else None
        if copy and piece is not None:
            piece = (piece[0], piece[1], _own(piece[2], leaf.value.to_local()))
        return _Slab(leaf.key, t.shape, t.dtype, piece, None,
                     {"placements": repr(list(leaf.value.placements)),
                      pieces.MESH: np.array(t.device_mesh.shape, dtype=np.int64),
                      pieces.WRITTEN: np.array([p.dim % t.ndim if isinstance(p, Shard) else -1 for p in t.placements],
                                               dtype=np.int64)})
    array, term = wholes[leaf.key]  # its lin64 checksum
    mine = rank == 0
    if copy and mine:
        array = _own(array, leaf.value)
    return _Slab(leaf.key, array.shape, array.dtype, ((0,) * array.ndim, array.shape, array) if mine else None,
                 term if mine else 0, {pytypes.ATTRIBUTE: leaf.pytype} if leaf.pytype else {})


def _own(data: np.ndarray, source: Any) -> np.ndarray:
    """``data``, copied when it may share memory with the caller's ``source``."""
    return data.copy() if isinstance(source, np.ndarray) and np.may_share_memory(data, source) else data


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


ASYNC_WRITE_BYTES = 1 << 20
"""An async save writes each rank's piece in calls of about this many bytes or fewer: h5py
holds the GIL inside every write, so the training loop's thread waits for the call in flight
whenever it needs the interpreter (16 MiB pieces slowed 2 ms sleeps beside the write by 21 %)."""


def _parts(slab: _Slab, ranks: int, write_bytes: int | None) -> int:
    """How many write calls a collective write of ``slab`` makes on every rank: from global
    facts only (its shape, dtype and the rank count), so every rank makes the same number."""
    if write_bytes is None or not slab.shape or not slab.shape[0]:
        return 1
    return max(1, min(slab.shape[0], -(-slab.nbytes // (ranks * write_bytes))))


def _row_blocks(piece: tuple[Any, Any, Any] | None, parts: int) -> list[tuple[Any, Any, Any] | None]:
    """``piece`` cut along its first dim into ``parts`` consecutive blocks (None: an empty one)."""
    if parts == 1 or piece is None or not piece[1]:
        return [piece] + [None] * (parts - 1)
    offset, shape, data = piece
    bounds = [shape[0] * i // parts for i in range(parts + 1)]
    return [((offset[0] + a, *offset[1:]), (b - a, *shape[1:]), data[a:b]) if b > a else None
            for a, b in itertools.pairwise(bounds)]


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


def save(obj: Mapping[Any, Any], path: str | os.PathLike, *, async_op: bool = False) -> SaveHandle | None:
    """Write ``obj`` to one HDF5 file at ``path``, atomically.

    ``obj`` is a mapping, nested as you like, of DTensors, NumPy arrays (complete values, the
    same on every rank) and Python scalars (int, float, bool, str, None, lists and tuples);
    a Module or Optimizer stands for its ``state_dict()``: ``save({"model": model, "optim":
    optimizer, "step": 100}, path)``. Collective: every rank calls it with the same structure
    and path. Raises ``CheckpointError`` on every rank if any rank fails; ``path`` is then untouched.

    ``async_op=True`` returns a :class:`SaveHandle` once this rank's pieces are copied (at most
    one copy of its local state); the file is written by a background thread on a communicator
    of its own. ``h.wait()`` finishes it and raises, on every rank, what the write raised. A
    save or load waits for the pending save first (and raises its failure if nobody waited for
    it), and so does the end of the program.
    """
    wait_pending()
    world = library_world()
    job = _prepare(world, obj, path, copy=async_op)
    if not async_op:
        job.run(world)
        return None
    handle = SaveHandle(job, world.Dup())  # collective: every rank got here (the preparation is agreed)
    global _pending
    _pending = handle
    return handle


@dataclass
class _Job:
    """The write part of one save: what to write, where, with which h5py stack."""

    h5py: Any
    path: str
    tmp: str
    groups: Mapping[str, str]
    slabs: list[_Slab]
    parallel: bool
    write_bytes: int | None = None  # an async save's bytes per write call (None: one call per piece)
    node_of: Any = None  # without MPI in h5py: every rank's node writer (_mpi.node_id of each rank)
    nice: int = 0  # an async save's writer thread's nice value (DTORCH_SAVE_NICE)

    def run(self, comm: MPI.Intracomm) -> None:
        """Create, write, fsync and rename ``tmp`` (collective over ``comm``, agreed throughout).

        The writers agree on their own errors as they go; what is left after them is rank 0's
        (the serial path's checksum attributes, fsync, rename), so one agreement at the end both
        reports it everywhere and keeps every rank from returning before the file is in place."""
        rank = comm.Get_rank()
        try:
            with agreed(comm):
                with LOCK:  # one thread inside h5py at a time (h5lib.py)
                    if self.parallel:
                        _save_parallel(self.h5py, comm, self.tmp, self.groups, self.slabs, self.write_bytes)
                    else:
                        _save_in_turn(self.h5py, comm, self.tmp, self.groups, self.slabs, self.write_bytes,
                                      self.node_of)
                if rank == 0:
                    _fsync_file(self.tmp)
                    os.replace(self.tmp, self.path)
                    _fsync_dir(os.path.dirname(self.path))
        except Exception as exc:
            if rank == 0 and os.path.exists(self.tmp):
                os.remove(self.tmp)
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"saving {self.path} failed: {exc}") from exc


def _prepare(world: MPI.Intracomm, obj: Any, path: str | os.PathLike, *, copy: bool) -> _Job:
    """The part of a save that uses the library's collectives (on the calling thread): agreement,
    Partial tensors reduced, writers chosen, this rank's pieces (``copy``: its own copies).
    Each agreement rides on a collective the save needs anyway (four in all where nothing
    fails: the structure; the directory, with rank 0's file name; the writers; the pieces, with
    the node layout on the serial path)."""
    rank = world.Get_rank()
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    problem: Exception | None = None
    structure = ""
    nice = 0
    try:
        nice = settings.get("DTORCH_SAVE_NICE") if copy else 0  # a bad value raises on every rank
        h5py = _h5py()  # h5py and xxhash on every rank (some may have nothing to hash)
        require_hasher()
        if not isinstance(obj, Mapping):
            raise CheckpointError(f"save() needs a mapping (of DTensors, arrays and scalars), got {type(obj).__name__}")
        layout = tree.flatten(obj)
        wholes = {leaf.key: (array, checksum(array, (0,) * array.ndim, array.shape))
                  for leaf in layout.leaves if not isinstance(leaf.value, DTensor) for array in [_complete(leaf)]}
        structure = repr((sorted(layout.groups.items()), _describe(layout.leaves, wholes)))
    except Exception as exc:
        problem = exc
    _same_everywhere(world, {"paths": ("path", path),
                             "state_dicts": ("keys, shapes, dtypes, placements or values", structure)}, problem)
    missing = None if os.path.isdir(directory) else \
        CheckpointError(f"cannot save to {path}: directory {directory} does not exist")
    token = agreed_min(world, missing, [secrets.randbits(62) if rank == 0 else _UNCHOSEN for _ in range(2)])
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{int(token[0]):016x}{int(token[1]):016x}.tmp")
    tensors = [leaf for leaf in layout.leaves if isinstance(leaf.value, DTensor)]
    try:
        writable = None
        try:  # the collective part (Partial tensors are reduced) before the local part
            writable = {leaf.key: _writable(leaf.value) for leaf in tensors}
        except Exception as exc:
            problem = exc
        writes = _writing_copies(world, writable, len(tensors), problem)
        assert writable is not None
        slabs: list[_Slab] = []
        try:
            slabs = [_slab(leaf, writable, writes, wholes, rank, copy) for leaf in layout.leaves]
        except Exception as exc:
            problem = exc
        parallel = has_parallel_hdf5()
        node_of = None
        if parallel:
            agree(world, problem)
        else:  # every rank's node writer (its node's lowest rank), in the same collective
            node_of = agreed_allgather(world, problem, node_id())
    except Exception as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"saving {path} failed: {exc}") from exc
    return _Job(h5py, path, tmp, layout.groups, slabs, parallel, ASYNC_WRITE_BYTES if copy else None, node_of,
                nice)


class SaveHandle:
    """A save in progress (``save(..., async_op=True)``): ``wait()`` finishes it, ``done()`` polls.

    The write runs in a background thread on ``comm`` (a duplicate of the library's world made
    by every rank when the save started), freed when the write ends. Without
    ``MPI_THREAD_MULTIPLE`` the write runs at once, on the calling thread, and the handle is done.
    """

    def __init__(self, job: _Job, comm: MPI.Intracomm) -> None:
        self.path = job.path
        self._job, self._comm = job, comm
        self._error: BaseException | None = None
        self._waited = False
        self._thread = threading.Thread(target=self._write_beside, name=f"dtorch_mpi save {job.path}")
        if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
            self._thread.start()
        else:
            self._write()

    def _write_beside(self) -> None:
        """The background thread's body: the write, at the save's lower priority."""
        _lower_this_threads_priority(self._job.nice)
        self._write()

    def _write(self) -> None:
        try:
            self._job.run(self._comm)
        except BaseException as exc:  # raised by wait(), on the caller's thread
            self._error = exc
        finally:
            self._job.slabs.clear()  # the copies go with the write, not with the handle
            self._comm.Free()

    def done(self) -> bool:
        """Whether this rank's part of the write has finished (a local poll: ranks may differ)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Finish the write; raise what it raised (the same on every rank: the write is agreed)."""
        if self._thread.is_alive():
            self._thread.join()
        self._waited = True
        if self._error is not None:
            raise self._error


def _lower_this_threads_priority(nice: int) -> None:
    """Give the calling thread (only it: Linux keeps a nice value per thread) ``nice``, so the
    threads of the training loop take a busy core before it; never a higher priority than it has
    (a process started under ``nice`` keeps its own); where the system has no per-thread nice
    (not Linux) or refuses, the thread keeps its priority."""
    if nice > 0 and sys.platform.startswith("linux"):
        try:
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread, max(nice, os.getpriority(os.PRIO_PROCESS, thread)))
        except OSError:
            pass


_pending: SaveHandle | None = None


def wait_pending() -> None:
    """Finish this process's pending asynchronous save; raise its failure if nobody waited for it."""
    global _pending
    handle, _pending = _pending, None
    if handle is not None and not handle._waited:
        handle.wait()
    elif handle is not None:
        handle._thread.join()


@atexit.register
def _wait_at_exit() -> None:
    """The end of the program finishes a pending save (its failure is printed: nobody can catch it)."""
    try:
        wait_pending()
    except BaseException as exc:
        sys.stderr.write(f"dtorch_mpi: the asynchronous checkpoint save failed: {exc}\n")


def _same_everywhere(world: MPI.Intracomm, facts: Mapping[str, tuple[str, str]],
                     problem: BaseException | None = None) -> None:
    """``{argument: (what it holds, text)}``: raise (on every rank) for the first argument whose
    text differs between ranks, naming each rank's text, after agreeing on this rank's own
    ``problem`` (one Allreduce for all of it)."""
    require_same(world, {what: text for what, text in facts.values()}, error=CheckpointError,
                 what={what: f"ranks passed different {argument}" for argument, (what, _) in facts.items()},
                 problem=problem)


def _create_datasets(f: Any, groups: Mapping[str, str], slabs: list[_Slab]) -> dict[str, Any]:
    f.attrs["format"] = fixed(FORMAT)  # strings the loader reads are fixed-length (validate._attribute)
    f.attrs["version"] = VERSION
    f.attrs[validate.LAYOUT] = validate.layout_digest(
        groups, [(slab.key, str(slab.attrs.get(pytypes.ATTRIBUTE, "")), slab.dtype.str, slab.shape) for slab in slabs])
    for key, kind in sorted(groups.items()):
        group = f.require_group(_group_path(key)) if key else f
        if kind:
            group.attrs[pytypes.ATTRIBUTE] = fixed(kind)
    out = {}
    for slab in slabs:
        ds = f.create_dataset(_group_path(slab.key), shape=slab.shape, dtype=slab.dtype)
        ds.attrs["dtype"] = fixed(slab.dtype.str)
        ds.attrs.update({k: fixed(v) if k == pytypes.ATTRIBUTE else v for k, v in slab.attrs.items()})
        out[slab.key] = ds
    return out


def _exchanged_checksums(world: MPI.Intracomm, slabs: list[_Slab],
                         problem: Exception | None = None) -> list[pieces.Summary]:
    """Every dataset's lin64 checksum and piece table (pieces.exchange; the same on every rank),
    after agreeing on this rank's ``problem`` (in the exchange's first collective) and checking
    that the written pieces cover each dataset once (the same verdict everywhere: a tensor held
    on overlapping meshes would be written twice in places and never in others)."""
    own: list[pieces.Own] = []
    if problem is None:
        try:
            own = [slab.own() for slab in slabs]
        except Exception as exc:
            problem = exc
    if problem is not None:
        own = [pieces.Own(0, len(slab.shape), None) for slab in slabs]
    sums = pieces.exchange(world, own, problem)
    for slab, summary in zip(slabs, sums):
        if summary.written != prod(slab.shape):
            raise CheckpointError(f"{slab.key}: the ranks wrote {summary.written} of its {prod(slab.shape)} elements; "
                                  f"each element must be written once (the ranks hold it on meshes that overlap or "
                                  f"leave parts out: save it from one mesh, or from disjoint copies of one)")
    return sums


def _set_checksums(datasets: Mapping[str, Any], slabs: list[_Slab], sums: list[pieces.Summary]) -> None:
    """Store each dataset's checksum and its piece table (pieces.exchange leaves out an empty
    one and one over the attribute limit); without a table, a non-empty DTensor's sum of its
    written pieces' seeded digests instead (the fast check without a table: pieces.py)."""
    for slab, summary in zip(slabs, sums):
        attrs = datasets[slab.key].attrs
        attrs["checksum"] = np.uint64(summary.checksum)
        if summary.table is not None:
            attrs[pieces.ATTRIBUTE] = summary.table
        elif pieces.WRITTEN in slab.attrs and slab.nbytes:
            attrs[pieces.SUM] = np.uint64(summary.xxsum)


def _save_parallel(h5py: Any, world: MPI.Intracomm, tmp: str, groups: Mapping[str, str], slabs: list[_Slab],
                   write_bytes: int | None) -> None:
    progress = _Progress(sum(slab.nbytes for slab in slabs), world.Get_rank())
    with h5py.File(tmp, "w", driver="mpio", comm=world) as f:
        datasets = _create_datasets(f, groups, slabs)
        for slab in slabs:
            if not slab.nbytes:
                continue  # no storage to write (the same decision on every rank)
            for block in _row_blocks(slab.piece, _parts(slab, world.Get_size(), write_bytes)):
                with agreed(world):  # an I/O error the write reports on one rank stops every rank
                    _write_slab(h5py, datasets[slab.key], block, collective=True)
            progress.add(slab.nbytes, "saving")
        _set_checksums(datasets, slabs, _exchanged_checksums(world, slabs))
    # no H5Fflush here: with MPI-IO it is an MPI_File_sync, and the file is fsynced after close
    progress.close()


def _save_in_turn(h5py: Any, world: MPI.Intracomm, tmp: str, groups: Mapping[str, str], slabs: list[_Slab],
                  write_bytes: int | None, node_of: np.ndarray) -> None:
    global _warned
    rank = world.Get_rank()
    if not _warned and rank == 0 and world.Get_size() > 1:
        warnings.warn("h5py has no MPI support: checkpoint nodes write in turn (slower); "
                      "install a parallel h5py for collective MPI-IO", stacklevel=3)
    _warned = True
    error: Exception | None = None
    mine = [(i, slab.piece) for i, slab in enumerate(slabs) if slab.piece is not None and prod(slab.piece[1])]
    leader = int(node_of[rank])  # one writer per node (checkpoint/funnel.py), the nodes in turn
    sends = [] if leader == rank else funnel.send(world, leader, mine)
    for n, turn in enumerate(sorted(set(node_of.tolist()))):
        if n:  # the previous node's writer has closed the file
            wait_request(world.Ibarrier(), "the checkpoint save's writes, node by node (Barrier)")
        if turn == rank:  # rank 0 leads the first turn: it creates the file, then writes its node's pieces
            members = [r for r in range(world.Get_size()) if node_of[r] == rank and r != rank]
            error = _write_node(h5py, world, tmp, slabs, mine, members, write_bytes, groups if n == 0 else None)
    for request in sends:
        wait_request(request, "the checkpoint save's pieces sent to the node's writer")
    sums = _exchanged_checksums(world, slabs, error)  # every writer has closed the file once it returns
    if rank == 0:  # (its failure is agreed by Job.run)
        with h5py.File(tmp, "r+") as f:
            _set_checksums({slab.key: f[_group_path(slab.key)] for slab in slabs}, slabs, sums)


def _write_node(h5py: Any, world: MPI.Intracomm, tmp: str, slabs: list[_Slab], mine: list[tuple[int, Any]],
                members: list[int], write_bytes: int | None, create: Mapping[str, str] | None) -> Exception | None:
    """A node leader's turn: open the file once (the first turn's leader, rank 0, creates it with
    its datasets: ``create`` holds the groups), write its pieces and its members' as they arrive."""
    opened: Exception | None = None
    f = None
    try:
        f = h5py.File(tmp, "r+" if create is None else "w")
        if create is not None:
            _create_datasets(f, create, slabs)
    except Exception as exc:  # every piece then fails alike (the members' are still received)
        if f is not None:
            f.close()
        f, opened = None, exc

    def write(index: int, piece: Any) -> None:
        if f is None:
            raise opened  # type: ignore[misc]
        slab = slabs[index]
        parts = 1 if write_bytes is None else max(1, -(-piece[2].nbytes // write_bytes))
        for block in _row_blocks(piece, parts):
            _write_slab(h5py, f[_group_path(slab.key)], block, collective=False)

    error = funnel.write_node(world, members, mine, [len(slab.shape) for slab in slabs],
                              [slab.dtype for slab in slabs], write)
    if f is not None:
        try:
            f.close()
        except Exception as exc:
            error = error or exc
    return error if error is not None else opened


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

