"""Piece tables: the hyperslabs a save wrote, each with the ``xxh3_64`` of its bytes, so that a
load whose regions are made of whole written pieces verifies at memory speed (the fast path of
checksum.py): the layout that saved, and any coarser one (fewer shards, a replicated target,
a complete array), since the pieces inside such a region tile it.

A dataset may carry the attribute ``pieces``: a uint64 array of shape ``(n, 2 * ndim + 1)``,
one row per non-empty written piece: its global offset (``ndim`` values), its shape (``ndim``)
and ``checksum.digest`` of its bytes. ``save`` exchanges what it needs in metadata that grows with
the number of tensors, not ranks x tensors (``exchange``): one Allreduce (SUM) of each dataset's
lin64 term, elements written and pieces written; then, only for the datasets whose table fits
under ``MAX_TABLE_BYTES`` (about 800 pieces of a 2-d tensor; HDF5 stores an attribute in one
object-header message, under 64 KiB), the digests of their pieces (computed from the pieces in
memory) and the rows, in one Allgatherv of the writers' rows (an Allgather of one count per rank
sizes it). A table over the limit is neither computed nor written, and neither is an empty one:
such datasets load with lin64.

A checkpoint is untrusted: ``check`` refuses a table of the wrong type or shape, a piece that is
empty or reaches outside the dataset, and a region listed twice. A table only chooses which
check runs: a region read that its listed pieces do not tile exactly (one reaching partly into
it, two overlapping, a gap) is verified with lin64.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
from mpi4py import MPI

from ..comm.deadline import wait_request
from ..errors import CheckpointError
from ..spmd import agree
from .checksum import canonical, digest, running_digest

ATTRIBUTE = "pieces"
MAX_TABLE_BYTES = 1 << 15
SLAB_BYTES = 1 << 20  # a strided part of a tile is hashed in contiguous copies of about this size
Piece = tuple[tuple[int, ...], tuple[int, ...], Any]  # (global offset, shape, data) of one written hyperslab
Tile = tuple[tuple[int, ...], tuple[int, ...], int]  # (offset in the region read, shape, recorded digest)


@dataclass(frozen=True)
class Own:
    """This rank's part of one dataset: its lin64 ``term``, the dataset's ``ndim`` and the
    non-empty piece it wrote (None when it wrote none); the piece's digest is computed only
    when the dataset's table is kept."""

    term: int
    ndim: int
    piece: Piece | None


@dataclass(frozen=True)
class Summary:
    """One dataset's save metadata, the same on every rank: its lin64 ``checksum``, the elements
    ``written`` by all ranks (each piece counted once per writer) and its piece ``table`` (None when
    no rank wrote a non-empty piece or the table is over ``MAX_TABLE_BYTES``)."""

    checksum: int
    written: int
    table: np.ndarray | None


def table_bytes(pieces: int, ndim: int) -> int:
    """The stored size of a table of ``pieces`` rows for a ``ndim``-d dataset."""
    return pieces * (2 * ndim + 1) * 8


def exchange(world: Any, mine: Sequence[Own], problem: BaseException | None = None) -> list[Summary]:
    """Every dataset's ``Summary`` from each rank's ``Own`` parts (collective over ``world``):
    one Allreduce of ``3 * len(mine) + 1`` words, then the rows of the tables that are kept (see
    the module's docstring): per rank, O(datasets + the rows kept) bytes whatever the rank count.
    The extra word counts the ranks that bring a ``problem``: where any does, every rank raises
    (``spmd.agree``) before the tables."""
    words = np.zeros(3 * len(mine) + 1, dtype=np.uint64)
    sums = words[:-1].reshape(3, len(mine))
    for k, own in enumerate(mine):
        sums[:, k] = own.term, prod(own.piece[1]) if own.piece else 0, own.piece is not None
    words[-1] = problem is not None
    every = np.empty_like(words)
    wait_request(world.Iallreduce(words, every, op=MPI.SUM), "the checkpoint save's checksum exchange (Allreduce)")
    if every[-1]:
        agree(world, problem)
    total = every[:-1].reshape(3, len(mine))
    kept = [bool(n) and table_bytes(int(n), own.ndim) <= MAX_TABLE_BYTES for n, own in zip(total[2], mine)]
    tables = _gather_rows(world, mine, kept) if any(kept) else {}
    return [Summary(int(term), int(written), tables.get(k)) for k, (term, written) in enumerate(zip(total[0], total[1]))]


def _gather_rows(world: Any, mine: Sequence[Own], kept: Sequence[bool]) -> dict[int, np.ndarray]:
    """The piece tables of the ``kept`` datasets (index -> table, rows in rank order): each rank
    sends a row ``[dataset index, *offset, *shape, digest]`` (padded to one width) per kept
    dataset it wrote a piece of; one Allgather of the ranks' word counts sizes one Allgatherv."""
    width = 2 * max(own.ndim for own, keep in zip(mine, kept) if keep) + 2
    rows = [[k, *own.piece[0], *own.piece[1], digest(own.piece[2])] for k, (own, keep) in enumerate(zip(mine, kept))
            if keep and own.piece is not None]
    send = np.zeros((len(rows), width), dtype=np.uint64)
    for n, row in enumerate(rows):
        send[n, : len(row)] = row
    counts = np.zeros(world.Get_size(), dtype=np.int64)
    wait_request(world.Iallgather(np.array([send.size], dtype=np.int64), counts),
                 "the checkpoint save's piece-table sizes (Allgather)")
    every = np.zeros((int(counts.sum()) // width, width), dtype=np.uint64)
    displs = np.concatenate([[0], np.cumsum(counts[:-1])])
    wait_request(world.Iallgatherv(send, [every, (counts.tolist(), displs.tolist()), MPI.UINT64_T]),
                 "the checkpoint save's piece tables (Allgatherv)")
    order = np.argsort(every[:, 0], kind="stable")  # by dataset, each dataset's rows in rank order
    bounds = np.searchsorted(every[order, 0], np.arange(len(mine) + 1, dtype=np.uint64))
    return {k: every[order[bounds[k] : bounds[k + 1]], 1 : 2 + 2 * mine[k].ndim]  # a new C-contiguous table
            for k, keep in enumerate(kept) if keep and bounds[k + 1] > bounds[k]}


def check_layout(dtype: np.dtype, table_shape: tuple[int, ...], shape: tuple[int, ...], what: str) -> None:
    """The stored table's type and shape, checked before it is read: a variable-length type
    could hold any amount of data behind an attribute whose own storage is small."""
    ndim = len(shape)
    bad = f"{what}: attribute {ATTRIBUTE!r} (the piece table)"
    if dtype.kind != "u" or dtype.itemsize != 8:
        raise CheckpointError(f"{bad} must be a uint64 array, got {dtype}; the file's metadata is damaged")
    if not table_shape:
        raise CheckpointError(f"{bad} must be a uint64 array, got a {dtype} scalar; the file's metadata is damaged")
    if len(table_shape) != 2 or table_shape[1] != 2 * ndim + 1 or not table_shape[0]:
        raise CheckpointError(f"{bad} has shape {table_shape}; a {ndim}-d dataset needs (pieces >= 1, {2 * ndim + 1}); "
                              f"the file's metadata is damaged")


def check(value: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    """A stored table, validated against the dataset's ``shape`` (``what`` names the dataset)."""
    ndim = len(shape)
    bad = f"{what}: attribute {ATTRIBUTE!r} (the piece table)"
    if not isinstance(value, np.ndarray):
        raise CheckpointError(f"{bad} must be a uint64 array, got {type(value).__name__}; the file's metadata is damaged")
    check_layout(value.dtype, value.shape, shape, what)
    table = value.astype(np.uint64, copy=False)
    offsets, sizes = table[:, :ndim], table[:, ndim : 2 * ndim]
    dims = np.array(shape, dtype=np.uint64)
    outside = ((sizes == 0) | (offsets > dims) | (sizes > dims - np.minimum(offsets, dims))).any(axis=1)
    if outside.any():
        n = int(np.flatnonzero(outside)[0])
        raise CheckpointError(f"{bad}: piece {n} (offset {offsets[n].tolist()}, shape {sizes[n].tolist()}) is empty or "
                              f"outside the dataset's shape {list(shape)}; the file's metadata is damaged")
    if len({region.tobytes() for region in table[:, : 2 * ndim]}) != len(table):
        raise CheckpointError(f"{bad} lists a region twice; the file's metadata is damaged")
    return table


def tiling(table: np.ndarray | None, offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[Tile, ...] | None:
    """The recorded pieces that tile the region at ``offset`` with ``shape`` exactly (offsets
    relative to the region), or None when they do not (or there is no table): a piece reaching
    partly into the region, two pieces overlapping, or a gap. An empty region needs none: ()."""
    if table is None:
        return None
    if not prod(shape):
        return ()
    ndim = len(shape)
    exact = np.flatnonzero((table[:, : 2 * ndim] == np.array([*offset, *shape], dtype=np.uint64)).all(axis=1))
    if exact.size:  # one recorded piece is the region (the usual reload): no tiling to work out
        return (((0,) * ndim, tuple(shape), int(table[exact[0], -1])),)
    lo = np.array(offset, dtype=np.uint64)
    hi = lo + np.array(shape, dtype=np.uint64)
    starts, sizes = table[:, :ndim], table[:, ndim : 2 * ndim]
    ends = starts + sizes  # no overflow: ``check`` keeps every piece inside the dataset
    inside = ((starts >= lo) & (ends <= hi)).all(axis=1)
    if (((starts < hi) & (ends > lo)).all(axis=1) & ~inside).any():
        return None
    starts, sizes, ends, digests = starts[inside], sizes[inside], ends[inside], table[inside, -1]
    if sum(prod(int(n) for n in row) for row in sizes) != prod(shape):
        return None
    if len(starts) > 1:  # pairwise disjoint, and the volumes add up: a tiling
        apart = ((ends[:, None, :] <= starts[None, :, :]) | (ends[None, :, :] <= starts[:, None, :])).any(axis=2)
        if not (apart | np.eye(len(starts), dtype=bool)).all():
            return None
    return tuple((tuple(int(a - b) for a, b in zip(start, offset)), tuple(int(n) for n in size), int(d))
                 for start, size, d in zip(starts, sizes, digests))


class TileDigests:
    """The running ``xxh3_64`` of each tile of a region, fed the region's rows in order (the
    whole region at once, or chunks along its first dim): a tile's rows arrive in order, so its
    digest is that of its bytes in C order, as the save computed it."""

    def __init__(self, tiles: tuple[Tile, ...]) -> None:
        self._tiles = tiles
        self._hashers = [running_digest() for _ in tiles]

    def update(self, row: int, block: np.ndarray) -> None:
        """Add ``block``: the region's rows from ``row`` on (a 0-d region is one block)."""
        for (offset, shape, _), hasher in zip(self._tiles, self._hashers):
            if not shape:
                hasher.update(canonical(block))
                continue
            lo, hi = max(offset[0], row), min(offset[0] + shape[0], row + block.shape[0])
            if lo < hi:
                part = block[(slice(lo - row, hi - row),) + tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:]))]
                for slab in _slabs(part):
                    hasher.update(canonical(slab))

    def mismatched(self) -> bool:
        """Whether any tile's bytes differ from its recorded digest."""
        return any(hasher.intdigest() != digest for (_, _, digest), hasher in zip(self._tiles, self._hashers))


def _slabs(part: np.ndarray) -> Iterator[np.ndarray]:
    """``part`` in C order as blocks of at most about ``SLAB_BYTES`` (each copied contiguous by
    ``canonical`` while it is still in cache): whole when contiguous, else runs along its first
    dim, and a first-dim slice bigger than that is cut along the next dim in turn."""
    if part.flags.c_contiguous or part.ndim < 2:
        yield part
        return
    step = SLAB_BYTES // max(1, part[:1].nbytes)
    if step:
        yield from (part[i : i + step] for i in range(0, part.shape[0], step))
        return
    for i in range(part.shape[0]):
        yield from _slabs(part[i])
