"""Reading validated datasets into parameters: verified against the stored checksums, and only
then installed, so a failed load changes nothing.

Every rank reads its own hyperslab in the file's dtype and checks it in one of three ways, the
same for a dataset on every rank:

- ``"xxh3"`` (fast path): when every rank's region is tiled exactly by pieces of the dataset's
  piece table (pieces.py; e.g. a load into the layout that saved it, or into a coarser one: fewer
  shards, a replicated target), each rank compares the ``xxh3_64`` of each tile of what it read
  with that piece's digest. Each rank decides from the table and its own region; one small
  Allreduce makes the choice common (a rank's verdict alone would not do: lin64 needs every
  rank's term).
- ``"xxh3 sum"`` (fast path without a table, one over the attribute limit): the pieces tiling
  each region come from the dataset's written layout (``pieces.layout_tiling``); each rank adds
  their offset-seeded ``xxh3_64``, and the sum over the ranks must be the stored ``xxsum`` once
  per copy read, as lin64's terms are.
- ``"lin64"`` otherwise: each rank adds its checksum term (checksum.py), and each dataset's sum
  must equal its stored checksum times the number of ranks of the world that read each element
  (replicas all read and all verify; so does every sub-mesh loading the key: ``copies_read``,
  summed in the same Allreduce).

Either way the verdicts of all ranks are summed in one Allreduce of a word per dataset (and per
dataset's copies), whatever the rank count (a mismatch is one rank's term of 1 on the fast
path), and a mismatch raises the same error on every rank before anything is
installed. ``VERIFIED`` records which way each dataset of the latest load went. Two staging
modes bound the memory a load needs on top of the model:

- ``"all"`` (default): every piece is read into a new buffer and verified; then each buffer is
  loaded in place (``_commit``: swapped in, no copy, where nothing else references the old
  array; copied into it otherwise). Peak extra memory: every piece this rank loads (one more
  copy of its share of the model, until the old arrays are released).
- ``"chunks"``: a first pass reads each piece in chunks of at most ``CHUNK_BYTES`` (or one
  slice along the piece's first dim, if bigger) and only hashes them; after verification a second
  pass reads each chunk again, checks that its xxh3 is the first pass's, and copies it in.
  Peak extra memory: one chunk (never more than one tensor's piece). It reads the file twice;
  if the file changes between the passes the load raises with the target partly loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from math import prod
from typing import Any

import numpy as np
from mpi4py import MPI

from .._mpi import library_world
from ..arrays import array_namespace
from ..autograd.record import mark_changed
from ..comm.deadline import wait_request
from ..dtypes import identity_value
from ..errors import CheckpointError
from ..placement import Partial, Replicate
from ..spmd import agreed
from . import pieces
from .checksum import MASK, checksum, digest, reduced_sums
from .validate import Entry, damaged

STAGING = ("all", "chunks")
CHUNK_BYTES = 16 << 20

Block = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, shape) of one hyperslab read
Tiles = tuple[pieces.Tile, ...]  # the recorded pieces tiling one region read (pieces.tiling)
VERIFIED: dict[str, str] = {}
"""Dataset key -> ``"xxh3"``, ``"xxh3 sum"`` or ``"lin64"``: the check chosen for each DTensor dataset of this
rank's latest load (set once the choice is agreed, before reading: a load that then fails
still shows its choice; complete arrays and scalars are not listed)."""


def read_verified(params: Mapping[str, Any], entries: Mapping[str, Entry], keys: list[str], path: str,
                  staging: str, mine: Mapping[str, Tiles | None]) -> None:
    """Read ``keys`` from ``entries`` into ``params`` (agreed on every rank); ``mine`` is
    ``own_checks`` (computed by the caller inside its agreed validation)."""
    world = library_world()
    expect = _common_checks(world, mine, keys)
    VERIFIED.clear()
    VERIFIED.update((key, "lin64" if expect[key] is None else "xxh3 sum" if summed(entries[key]) else "xxh3")
                    for key in keys)
    if staging == "all":
        staged, problem = _attempt(path, lambda: {key: _read_all(params[key], entries[key], expect[key])
                                                  for key in keys})
        _verify(world, keys, [staged[k][1] for k in keys] if staged else [0] * len(keys), params, entries, expect,
                path, problem)
        for key in keys:
            _commit(params[key], staged.pop(key)[0])
        return
    first, problem = _attempt(path, lambda: {key: _first_pass(params[key], entries[key], expect[key])
                                             for key in keys})
    _verify(world, keys, [first[k][1] for k in keys] if first else [0] * len(keys), params, entries, expect,
            path, problem)
    with agreed(world), damaged(path, "the second reading pass"):
        for key in keys:
            _stream_into(params[key], entries[key].dataset, first[key][0], path, key)


def _attempt(path: str, read: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], Exception | None]:
    """Run this rank's reads; a failure is kept for ``_verify``'s Allreduce to agree on (one
    collective carries both the terms and every rank's status), h5py's raw errors as a
    ``CheckpointError`` naming the file."""
    try:
        with damaged(path, "reading the data"):
            return read(), None
    except Exception as exc:
        return {}, exc


def own_checks(params: Mapping[str, Any], entries: Mapping[str, Entry], keys: list[str]) -> dict[str, Tiles | None]:
    """Each dataset's written pieces tiling this rank's region (none when it reads nothing:
    nothing to check), from its piece table or, without one, from its written layout (the sum
    check: ``summed``); None when they do not tile it (or neither is stored)."""
    mine: dict[str, Tiles | None] = {}
    for key in keys:
        entry, block = entries[key], _hyperslab(params[key])
        if entry.pieces is None and entry.layout is None:
            mine[key] = None
        elif block is None:  # this rank reads nothing: nothing of its own to check
            mine[key] = ()
        elif entry.pieces is not None:
            mine[key] = pieces.tiling(entry.pieces, *block)
        else:
            assert entry.layout is not None
            mine[key] = pieces.layout_tiling(entry.layout, tuple(params[key].shape), *block)
    return mine


def summed(entry: Entry) -> bool:
    """Whether the dataset's fast check is the sum of seeded digests (no table, a written layout)."""
    return entry.pieces is None and entry.layout is not None


def _common_checks(world: Any, mine: Mapping[str, Tiles | None], keys: list[str]) -> dict[str, Tiles | None]:
    """The fast check for a dataset only where recorded pieces tile every rank's region: one
    Allreduce (MIN of the ranks' flags) gives every rank the same choice; None means lin64."""
    flags = np.array([mine[key] is not None for key in keys], dtype=np.int8)
    every = np.empty_like(flags)
    wait_request(world.Iallreduce(flags, every, op=MPI.MIN), "the checkpoint load's choice of check (Allreduce)")
    return {key: mine[key] if every[n] else None for n, key in enumerate(keys)}


def _hyperslab(param: Any) -> Block | None:
    """This rank's block to read, or None when it reads nothing (outside the mesh, Partial identity)."""
    spec, mesh = param.spec, param.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    if any(isinstance(p, Partial) and p.reduce_op != "avg" and coord[k] for k, p in enumerate(param.placements)):
        return None
    shape, offset = spec.local_shape_and_offset
    return tuple(offset), tuple(shape)


def readers_per_element(param: Any) -> int:
    """How many ranks of the parameter's mesh read each element (replicas and Partial("avg")
    ranks all read it)."""
    count = 1
    for size, p in zip(param.device_mesh.shape, param.placements):
        if isinstance(p, Replicate) or (isinstance(p, Partial) and p.reduce_op == "avg"):
            count *= size
    return count


def copies_read(param: Any) -> int:
    """This rank's share of the number of times the world reads each element: its mesh's
    ``readers_per_element`` from the mesh's first rank (coordinate all zeros), 0 from the others.
    Summed over the world it counts every mesh that loads the key: the disjoint sub-meshes of a
    DP x TP job (``mesh["tp"]`` on each dp row) each read the whole tensor; ranks outside any
    mesh read nothing."""
    coord = param.device_mesh.get_coordinate()
    return readers_per_element(param) if coord is not None and not any(coord) else 0


def _read(ds: Any, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """The block at ``offset`` with ``shape``, in the file's dtype (h5py's low-level read: the
    high-level ``read_direct`` builds selections in Python at ~30 us per call)."""
    from h5py import h5s

    out = np.empty(shape, dtype=ds.dtype)
    if prod(shape):
        fspace = ds.id.get_space()
        if shape:
            fspace.select_hyperslab(offset, shape)
            ds.id.read(h5s.create_simple(shape), fspace, out)
        else:
            ds.id.read(h5s.create(h5s.SCALAR), fspace, out)
    return out


def _filler(param: Any) -> np.ndarray | None:
    """The piece of a rank that reads nothing: the reduce op's identity, or an empty piece."""
    shape, _ = param.spec.local_shape_and_offset
    coord = param.device_mesh.get_coordinate()
    xp = array_namespace(param.device_mesh.device_type)
    if coord is None:
        return xp.empty(shape, dtype=param.dtype)
    op = next(p.reduce_op for k, p in enumerate(param.placements)
              if isinstance(p, Partial) and p.reduce_op != "avg" and coord[k])
    return xp.full(shape, identity_value(param.dtype, op), dtype=param.dtype)


def _term(raw: np.ndarray, offset: tuple[int, ...], shape: tuple[int, ...], tiles: Tiles | None, sums: bool) -> int:
    """What this rank contributes to the verdict on a block it read at ``offset`` of a dataset of
    ``shape``: its lin64 term (``tiles`` None), the sum of its tiles' seeded digests (``sums``),
    or 1 if a tile's xxh3 is not the recorded one (0 for an empty block: nothing to check)."""
    if tiles is None:
        return checksum(raw, offset, shape)
    digests = pieces.TileDigests(tiles, seeded=sums)
    digests.update(0, raw)
    return digests.total() if sums else int(digests.mismatched())


def _read_all(param: Any, entry: Entry, expected: Tiles | None) -> tuple[Any, int]:
    """This rank's whole piece (in the parameter's dtype and array type) and its verdict term."""
    block = _hyperslab(param)
    if block is None:
        return _filler(param), 0
    raw = _read(entry.dataset, *block)
    term = _term(raw, block[0], param.shape, expected, summed(entry))
    xp = array_namespace(param.device_mesh.device_type)
    return xp.asarray(raw.astype(param.dtype, copy=False)), term


def _chunks(param: Any, ds: Any) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
    """This rank's piece as (offset, raw block) chunks along the piece's first dim."""
    block = _hyperslab(param)
    if block is None or not prod(block[1]):
        return
    offset, shape = block
    if not shape:
        yield offset, _read(ds, offset, shape)
        return
    step = max(1, CHUNK_BYTES // max(1, prod(shape[1:]) * ds.dtype.itemsize))
    for start in range(0, shape[0], step):
        sub_offset = (offset[0] + start, *offset[1:])
        yield sub_offset, _read(ds, sub_offset, (min(step, shape[0] - start), *shape[1:]))


def _first_pass(param: Any, entry: Entry, expected: Tiles | None) -> tuple[list[int], int]:
    """``"chunks"``, first pass: each chunk's xxh3 (for the second pass) and this rank's verdict
    term (lin64 terms summed, or each tile's xxh3 over the chunks in turn: against its digest, or
    seeded and summed)."""
    marks: list[int] = []
    term = 0
    ds, sums = entry.dataset, summed(entry)
    digests = None if expected is None else pieces.TileDigests(expected, seeded=sums)
    block = _hyperslab(param)
    first_row = block[0][0] if block is not None and block[0] else 0  # of the region, along dim 0
    for off, raw in _chunks(param, ds):
        marks.append(digest(raw))
        if digests is None:
            term += checksum(raw, off, param.shape)
        else:
            digests.update(off[0] - first_row if off else 0, raw)
    if digests is not None:
        term = digests.total() if sums else int(digests.mismatched())
    return marks, term & MASK


def _verify(world: Any, keys: list[str], terms: list[int], params: Mapping[str, Any],
            entries: Mapping[str, Entry], expect: Mapping[str, Tiles | None], path: str,
            problem: Exception | None) -> None:
    """Sum every rank's terms and status (``problem``: its reads failed); the same verdict
    (and error) on every rank (xxh3: no rank saw a mismatch; lin64 and the xxh3 sum: the terms
    add up to the stored checksum or ``xxsum`` once per reader)."""
    sums = reduced_sums(world, [*terms, *(copies_read(params[key]) for key in keys)], problem)
    bad = [key for key, total, copies in zip(keys, sums, sums[len(keys):]) if total != _expected(entries[key],
                                                                                            expect[key], copies)]
    if bad:
        raise CheckpointError(f"{path}: checksum mismatch in dataset{'s' if len(bad) > 1 else ''} "
                              f"{', '.join('/' + k.replace('.', '/') for k in bad)}: the data is damaged "
                              f"(or was never fully written); nothing was loaded")


def _expected(entry: Entry, tiles: Tiles | None, copies: int) -> int:
    """What the ranks' terms of one dataset must add up to, ``copies`` readers of each element."""
    if tiles is None:
        return entry.checksum * copies & MASK
    return (entry.xxsum or 0) * copies & MASK if summed(entry) else 0


def read_whole(entry: Entry, path: str, key: str) -> np.ndarray:
    """A whole dataset (a complete array or a scalar), verified on this rank (every rank reads all
    of it, so no gathering is needed): by its pieces' xxh3 when the table covers it, else lin64."""
    ds = entry.dataset
    shape = tuple(ds.shape)
    origin = (0,) * len(shape)
    raw = _read(ds, origin, shape)
    tiles = pieces.tiling(entry.pieces, origin, shape)
    if _term(raw, origin, shape, tiles, False) != (entry.checksum if tiles is None else 0):
        raise CheckpointError(f"{path}: checksum mismatch in dataset /{key.replace('.', '/')}: the data is damaged "
                              f"(or was never fully written); nothing was loaded")
    return raw


class _Holder:
    _local: Any = None


def _refs_to_local(holder: Any) -> int:
    """References to ``holder._local``, counted from here."""
    return sys.getrefcount(holder._local)


def _probe_unshared_refs() -> int:
    """What ``_refs_to_local`` shows for an array only its holder references (measured once
    through the same code path, so it holds on any interpreter)."""
    holder = _Holder()
    holder._local = np.empty(1)
    return _refs_to_local(holder)


_UNSHARED_REFS = _probe_unshared_refs()


def _commit(param: Any, piece: Any) -> None:
    """Load the verified piece into the parameter, in place (the contract; PyTorch's ``copy_``):
    when nothing but the parameter references its local array (no ``to_local()`` result kept,
    no tensor sharing the array, not a view) swapping the piece in is indistinguishable from
    copying it and saves the copy; otherwise the piece is copied into the existing array, so
    everyone holding it sees the loaded values."""
    param.to_local()  # a pending (lazy) redistribute into this tensor completes first
    local = param._local
    owned = getattr(local, "base", None) is None and getattr(local.flags, "writeable", True)
    del local
    if owned and _refs_to_local(param) <= _UNSHARED_REFS:
        param._local = piece
    else:
        param._local[...] = piece
    mark_changed(param)  # as PyTorch's copy_ counts it


def _stream_into(param: Any, ds: Any, first: list[int], path: str, key: str) -> None:
    """Second pass of ``"chunks"``: re-read, re-check each chunk against the first pass, copy in."""
    block = _hyperslab(param)
    if block is None:
        _commit(param, _filler(param))
        return
    local, xp = param.to_local(), array_namespace(param.device_mesh.device_type)
    direct = local.shape == block[1] and getattr(local.flags, "writeable", True)
    target = local if direct else xp.empty(block[1], dtype=param.dtype)
    for n, (off, raw) in enumerate(_chunks(param, ds)):
        if digest(raw) != first[n]:
            raise CheckpointError(f"{path}: dataset /{key.replace('.', '/')} changed while loading "
                                  f"(staging='chunks' reads twice); the target is partly loaded")
        where = tuple(slice(o - b, o - b + s) for o, b, s in zip(off, block[0], raw.shape))
        target[where] = xp.asarray(raw.astype(param.dtype, copy=False))
    if direct:
        mark_changed(param)
    else:
        _commit(param, target)
