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
sizes it). A table over the limit is neither computed nor written, and neither is an empty one.

Where a table is left out (too many pieces), the fast check stays by a *sum* instead: a
non-empty DTensor dataset without a table carries ``xxsum``, the sum mod 2**64 of its written
pieces' digests, each seeded with the piece's global offset (``seeded_digest``: swapping two
pieces changes the sum), and every DTensor dataset carries ``written`` beside ``mesh_shape``: the
tensor dim each mesh dim of the writing mesh split (-1: none), from which the split rule gives
every written piece (``layout_tiling``). The sums take one more Allreduce of a word per such
dataset, made only when some table is left out. A load whose regions are made of whole written
pieces adds the seeded digests of the pieces in its region; the sum over the ranks must be
``xxsum`` once per copy read (as lin64's terms are). Enumerating the pieces inside a region is
O(its pieces), never O(ranks). Any other load, and an empty dataset, is checked with lin64.

A checkpoint is untrusted: ``check`` refuses a table of the wrong type or shape, a piece that is
empty or reaches outside the dataset, and a region listed twice. A table only chooses which
check runs: a region read that its listed pieces do not tile exactly (one reaching partly into
it, two overlapping, a gap) is verified with lin64.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
from mpi4py import MPI

from ..comm.deadline import wait_request
from ..errors import CheckpointError
from ..split import split_range
from .checksum import MASK, canonical, digest, reduced_sums, require_hasher, running_digest

ATTRIBUTE = "pieces"
SUM, WRITTEN, MESH = "xxsum", "written", "mesh_shape"  # the sum check's attributes
MAX_TABLE_BYTES = 1 << 15
MAX_MESH_DIMS = 16
MAX_TILES = 1 << 16  # a region made of more written pieces than this is checked with lin64
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
    ``written`` by all ranks (each piece counted once per writer), its piece ``table`` (None when
    no rank wrote a non-empty piece or the table is over ``MAX_TABLE_BYTES``) and ``xxsum``, the
    sum of the written pieces' seeded digests."""

    checksum: int
    written: int
    table: np.ndarray | None
    xxsum: int = 0


@dataclass(frozen=True)
class Layout:
    """How a dataset was written: the writing mesh's shape and, per mesh dim, the tensor dim it
    split (-1: it did not; the Partial tensors a save reduces are recorded as written)."""

    mesh_shape: tuple[int, ...]
    written: tuple[int, ...]


def seed(offset: Sequence[int]) -> int:
    """The digest seed of the piece at global ``offset``: ``xxh3_64`` of the offset's words."""
    return int(require_hasher().xxh3_64_intdigest(np.asarray(offset, dtype="<u8").tobytes()))


def seeded_digest(data: np.ndarray, offset: Sequence[int]) -> int:
    """``xxh3_64`` of a piece's canonical bytes, seeded with its offset (``seed``)."""
    return int(require_hasher().xxh3_64(canonical(data), seed=seed(offset)).intdigest())


def table_bytes(pieces: int, ndim: int) -> int:
    """The stored size of a table of ``pieces`` rows for a ``ndim``-d dataset."""
    return pieces * (2 * ndim + 1) * 8


def exchange(world: Any, mine: Sequence[Own], problem: BaseException | None = None) -> list[Summary]:
    """Every dataset's ``Summary`` from each rank's ``Own`` parts (collective over ``world``):
    one Allreduce of ``3 * len(mine) + 1`` words (``checksum.reduced_sums``), then the rows of the
    tables that are kept (see the module's docstring): per rank, O(datasets + the rows kept) bytes
    whatever the rank count. The extra word counts the ranks that bring a ``problem``: where any
    does, every rank raises (``spmd.agree``) before the tables."""
    terms = [value for own in mine for value in (own.term, prod(own.piece[1]) if own.piece else 0, own.piece is not None)]
    total = np.array(reduced_sums(world, terms, problem, "the checkpoint save's checksum exchange"),
                     dtype=np.uint64).reshape(len(mine), 3).T
    kept = [bool(n) and table_bytes(int(n), own.ndim) <= MAX_TABLE_BYTES for n, own in zip(total[2], mine)]
    tables = _gather_rows(world, mine, kept) if any(kept) else {}
    left_out = [k for k, (n, keep) in enumerate(zip(total[2], kept)) if n and not keep]
    xxsums = _summed_digests(world, mine, left_out) if left_out else {}
    return [Summary(int(term), int(written), tables.get(k), xxsums.get(k, 0))
            for k, (term, written) in enumerate(zip(total[0], total[1]))]


def _summed_digests(world: Any, mine: Sequence[Own], left_out: Sequence[int]) -> dict[int, int]:
    """The sum check's ``xxsum`` of each dataset whose table is ``left_out`` (index -> sum of its
    pieces' seeded digests over the ranks): one Allreduce of a word per such dataset, made only
    when some table is left out (above ~800 pieces), so smaller saves hash nothing more."""
    digests = [seeded_digest(mine[k].piece[2], mine[k].piece[0]) if mine[k].piece else 0  # type: ignore[index]
               for k in left_out]
    return dict(zip(left_out, reduced_sums(world, digests, what="the checkpoint save's digest sums")))


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


def check_written(mesh_shape: Any, written: Any, shape: tuple[int, ...], what: str) -> Layout | None:
    """The stored ``mesh_shape`` and ``written`` attributes, validated: int64 vectors of one
    length (1 to ``MAX_MESH_DIMS``), mesh sizes >= 1, written dims >= -1. None (no sum check:
    lin64) when a written dim is not a dim of the dataset's ``shape``."""
    bad = f"{what}: attributes {MESH!r} and {WRITTEN!r} (how the dataset was written)"
    for name, value in ((MESH, mesh_shape), (WRITTEN, written)):
        if not isinstance(value, np.ndarray) or value.dtype != np.int64 or value.ndim != 1:
            raise CheckpointError(f"{bad}: {name!r} must be an int64 vector, got "
                                  f"{getattr(value, 'dtype', type(value).__name__)}; the file's metadata is damaged")
    if not 1 <= len(mesh_shape) <= MAX_MESH_DIMS or len(written) != len(mesh_shape):
        raise CheckpointError(f"{bad}: lengths {len(mesh_shape)} and {len(written)} (1 to {MAX_MESH_DIMS}, equal); "
                              f"the file's metadata is damaged")
    if (mesh_shape < 1).any() or (written < -1).any():
        raise CheckpointError(f"{bad}: mesh shape {mesh_shape.tolist()} or written dims {written.tolist()} out of "
                              f"range; the file's metadata is damaged")
    if (written >= len(shape)).any():
        return None  # it does not fit this dataset (one refused as a tensor later): lin64 checks it
    return Layout(tuple(int(n) for n in mesh_shape), tuple(int(d) for d in written))


def _piece_index(x: int, base: int, extra: int) -> int:
    """Which piece of the balanced split (``extra`` pieces of ``base + 1``, then ``base``) holds ``x``."""
    big = base + 1
    return x // big if x < extra * big else extra + (x - extra * big) // base


def _spans(lo: int, hi: int, start: int, length: int, parts: Sequence[int], limit: int) -> list[tuple[int, int]] | None:
    """The non-empty written pieces, as ``(begin, end)``, of ``[start, start + length)`` split by
    ``parts`` in turn (nested shards) that lie in ``[lo, hi)``; None when one reaches partly into
    it, or when more than ``limit`` do. Only the pieces overlapping ``[lo, hi)`` are visited."""
    if not length or hi <= start or lo >= start + length:
        return []
    if not parts:
        return [(start, start + length)] if lo <= start and start + length <= hi else None
    base, extra = divmod(length, parts[0])
    first = _piece_index(max(lo, start) - start, base, extra)
    last = _piece_index(min(hi, start + length) - 1 - start, base, extra)
    if last - first >= limit:
        return None
    out: list[tuple[int, int]] = []
    for i in range(first, last + 1):
        size, at = split_range(length, parts[0], i)
        inner = _spans(lo, hi, start + at, size, parts[1:], limit)
        if inner is None or len(out) + len(inner) > limit:
            return None
        out += inner
    return out


def layout_tiling(layout: Layout, shape: tuple[int, ...], offset: tuple[int, ...], region: tuple[int, ...],
                  limit: int = MAX_TILES) -> tuple[Tile, ...] | None:
    """The written pieces (from ``layout`` and the split rule) that tile the region at ``offset``
    with shape ``region`` of a dataset of ``shape``, each as (offset in the region, shape, its
    ``seed``), or None when they do not tile it exactly (or more than ``limit`` would). An empty
    region needs none: ()."""
    if not prod(region):
        return ()
    per_dim = []
    for dim, (length, lo, size) in enumerate(zip(shape, offset, region)):
        parts = [n for n, d in zip(layout.mesh_shape, layout.written) if d == dim]
        spans = _spans(lo, lo + size, 0, length, parts, limit)
        if spans is None:
            return None
        per_dim.append(spans)
    if prod(len(spans) for spans in per_dim) > limit:
        return None
    return tuple((tuple(a - o for (a, _), o in zip(combo, offset)), tuple(b - a for a, b in combo),
                  seed(tuple(a for a, _ in combo))) for combo in itertools.product(*per_dim))


class TileDigests:
    """The running ``xxh3_64`` of each tile of a region, fed the region's rows in order (the
    whole region at once, or chunks along its first dim): a tile's rows arrive in order, so its
    digest is that of its bytes in C order, as the save computed it."""

    def __init__(self, tiles: tuple[Tile, ...], seeded: bool = False) -> None:
        """``seeded``: the tiles' third field is each one's seed (``layout_tiling``), not a
        recorded digest; ``total`` then gives the sum of their seeded digests."""
        self._tiles = tiles
        self._hashers = [require_hasher().xxh3_64(seed=tile[2]) if seeded else running_digest() for tile in tiles]

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

    def total(self) -> int:
        """The sum mod 2**64 of the tiles' digests (seeded ones: the sum check's term)."""
        return sum(hasher.intdigest() for hasher in self._hashers) & MASK


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
