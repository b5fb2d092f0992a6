"""Dataset checksums that any partition of the array can compute and combine ("lin64").

A checkpoint is written by one layout and read by another, so the checksum must be a sum of
per-hyperslab terms: every rank hashes the block it wrote (or read), and the terms add up to
the same value whatever the partition. Definition, for a dataset of global shape ``G``:

- each element's value, little-endian, is cut into 32-bit words (1- and 2-byte types are one
  zero-extended word); the array is seen as a matrix ``u[i, j]`` whose row ``i`` is the C-order
  index over all dims but the last and whose column ``j`` is ``last index * words + word``
  (a 0-d array is one row);
- ``checksum = sum(w(i, ROW_SEED) * w(j, COL_SEED) * u[i, j]) mod 2**64`` where the odd weight
  ``w(n, seed)`` is the product over ``k = 0..3`` of ``s(seed + k * 2**16 + (n >> 16 k) % 2**16)``
  and ``s(x) = splitmix64(x) | 1`` (tables of 2**16 entries: no per-element hashing).

Any single flipped bit changes the sum (an odd weight times ``2**b``, ``b < 32``, is never 0
mod ``2**64``); other damage (zeroed regions, fill values) goes unnoticed with probability about
``2**-32`` or less. It is a check against accidental damage, not a cryptographic hash. Cost: one
pass that widens tiles of up to 2**18 words to uint64 in one reused 2 MiB buffer (runs that long
widen about twice as fast as 2**16-word ones) and multiply-adds them window by window with
``einsum`` (rows of at most 7 words are reduced over rows first: einsum's row sums are slow on
short rows): about 9 GB/s on one core for 4- and 8-byte types, 2.4 GB/s for 1-byte ones (a
word per element), against 6.9 for zlib.crc32 and 4.1 for adler32 timed in the same run (and
neither of those can be combined across partitions).

The fast path (pieces.py): a load that reads whole pieces a save wrote needs no partition
invariance, so beside lin64 every dataset records each written piece's ``xxh3_64`` (``digest``:
the piece's bytes in the file's canonical form, little-endian and C order; ~34 GB/s on one
core, faster than the read it checks). A load whose every read region is tiled by recorded
pieces (the saving layout or a coarser one) verifies each tile against its digest; any other
load (a finer or crossing layout, a file without the table) verifies with lin64, which covers
every layout and every file written.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from math import prod
from typing import Any

import numpy as np
from mpi4py import MPI

from ..comm.deadline import wait_request
from ..errors import CheckpointError
from ..spmd import agree

MASK = (1 << 64) - 1
ROW_SEED = 0x6474_6F72_6368_0001
COL_SEED = 0x6474_6F72_6368_0002
DIGIT = 1 << 16  # weights are products of 4 table entries, one per 16-bit digit of the index
STEP_WORDS = 1 << 18  # words widened to uint64 per tile (a reused 2 MiB buffer; 1.4x faster than 512 KiB tiles)
BLOCK_ROWS = 1 << 17  # rows weighted at a time (bounds the row weights to 1 MiB)
NARROW = 7  # rows of at most this many words reduce over rows first (einsum's row sums are slow on short rows)
_WORD: dict[int, np.dtype] = {1: np.dtype("<u1"), 2: np.dtype("<u2")}  # anything wider is cut into 32-bit words
_tables: dict[int, np.ndarray] = {}


def _splitmix(index: np.ndarray) -> np.ndarray:
    z = index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


def _table(seed: int) -> np.ndarray:
    """(4, DIGIT) odd weights: row k holds the factors of the index's k-th 16-bit digit."""
    if seed not in _tables:
        _tables[seed] = _splitmix(np.arange(4 * DIGIT, dtype=np.uint64) + np.uint64(seed)).reshape(4, DIGIT)
    return _tables[seed]


def _weights(index: np.ndarray, seed: int) -> np.ndarray:
    table, n = _table(seed), index.astype(np.uint64)
    out = table[0][n & np.uint64(DIGIT - 1)]
    top = int(n.max()) if n.size else 0
    constant = 1
    for k in range(1, 4):
        if top >> (16 * k):
            out = out * table[k][(n >> np.uint64(16 * k)) & np.uint64(DIGIT - 1)]
        else:  # every index has digit k == 0
            constant = constant * int(table[k][0]) & MASK
    return out * np.uint64(constant)


def _high_factor(index: int, seed: int) -> int:
    """The product of the factors of the index's digits 1..3 (the same across a DIGIT window)."""
    table, out = _table(seed), 1
    for k in range(1, 4):
        out = out * int(table[k][(index >> (16 * k)) % DIGIT]) & MASK
    return out


def _windows(start: int, count: int) -> Iterator[tuple[int, int]]:
    """(first, width) of the runs that the indices start..start+count make in DIGIT-aligned windows
    (``first`` counts from ``start``): in a window, the low digit's factors are a table slice and
    the other digits' product is one number."""
    first = 0
    while first < count:
        width = min(count - first, DIGIT - (start + first) % DIGIT)
        yield first, width
        first += width


def _consecutive_weights(start: int, count: int) -> np.ndarray:
    """Row weights of the global rows start..start+count, window by window (no per-row gathers)."""
    out, low = np.empty(count, dtype=np.uint64), _table(ROW_SEED)[0]
    for first, width in _windows(start, count):
        g = start + first
        np.multiply(low[g % DIGIT : g % DIGIT + width], np.uint64(_high_factor(g, ROW_SEED)), out=out[first : first + width])
    return out


def _little_endian(block: np.ndarray) -> np.ndarray:
    """The block C-contiguous with little-endian elements (a copy only when it is not already)."""
    a = np.ascontiguousarray(block)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def _word_matrix(block: np.ndarray) -> tuple[np.ndarray, int]:
    """The block as a (rows, words) matrix of little-endian words, and words per element."""
    a = _little_endian(block)
    width = a.dtype.itemsize
    word = _WORD.get(width, np.dtype("<u4"))
    last = a.shape[-1] if a.ndim else 1
    rows = prod(a.shape[:-1]) if a.ndim else 1
    return a.reshape(rows, last).view(word), max(1, width // 4)


def _row_weights(first: int, count: int, block: np.ndarray, offset: tuple[int, ...],
                 global_shape: tuple[int, ...]) -> np.ndarray:
    """Weights of the block's rows first..first+count (global C-order index over all dims but the last)."""
    lead = block.shape[:-1]
    if not lead:
        return _weights(np.zeros(1, dtype=np.uint64), ROW_SEED)
    if lead[1:] == tuple(global_shape[1:-1]):  # whole rows below dim 0: contiguous global rows
        return _consecutive_weights(offset[0] * prod(lead[1:]) + first, count)
    local = np.unravel_index(np.arange(first, first + count), lead)
    rows = np.ravel_multi_index(tuple(i + o for i, o in zip(local, offset[:-1])), global_shape[:-1])
    return _weights(np.asarray(rows), ROW_SEED)


def _weighted_sum(words: np.ndarray, row_weights: np.ndarray, col_weights: np.ndarray) -> int:
    """``row_weights . words . col_weights`` mod 2**64, reducing the longer axis first."""
    if words.shape[1] <= NARROW:
        return int(np.dot(row_weights @ words, col_weights))
    return int(np.dot(row_weights, np.einsum("ij,j->i", words, col_weights)))  # uint64: wraps mod 2**64


def checksum(block: np.ndarray, offset: tuple[int, ...], global_shape: tuple[int, ...]) -> int:
    """This block's term of the dataset checksum (``block`` sits at ``offset`` in ``global_shape``)."""
    if block.size == 0:
        return 0
    words, per = _word_matrix(block)
    n_rows, n_cols = words.shape
    col0 = (offset[-1] if block.ndim else 0) * per
    low = _table(COL_SEED)[0]
    rows, cols = max(1, STEP_WORDS // n_cols), min(n_cols, STEP_WORDS)  # a tile: widened at once
    wide = np.empty(min(words.size, rows * cols), dtype=np.uint64)  # reused for every tile
    total = 0
    for r0 in range(0, n_rows, BLOCK_ROWS):
        rw = _row_weights(r0, min(BLOCK_ROWS, n_rows - r0), block, offset, global_shape)
        for r in range(0, len(rw), rows):
            for c in range(0, n_cols, cols):
                source = words[r0 + r : r0 + min(r + rows, len(rw)), c : c + cols]
                tile = wide[: source.size].reshape(source.shape)
                np.copyto(tile, source)
                for first, width in _windows(col0 + c, source.shape[1]):  # one weight table slice each
                    g = col0 + c + first
                    cw = low[g % DIGIT : g % DIGIT + width]
                    term = _weighted_sum(tile[:, first : first + width], rw[r : r + len(tile)], cw)
                    total += _high_factor(g, COL_SEED) * term
    return total & MASK


def canonical(block: np.ndarray) -> memoryview:
    """The block's bytes as the file stores them: little-endian, C order (a view where it can be)."""
    return memoryview(_little_endian(block).reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def digest(block: np.ndarray) -> int:
    """``xxh3_64`` of the block in canonical form (one recorded piece's digest)."""
    return int(running_digest(block).intdigest())


def require_hasher() -> Any:
    """The ``xxhash`` module, or ``CheckpointError``. ``xxhash`` comes with checkpoints (the
    ``hdf5`` extra, like h5py), so it is imported here, not with the package. ``save`` and
    ``load`` call this on every rank inside their first agreement: a rank that hashes nothing
    (empty pieces) must fail with the others, before any collective that depends on hashing."""
    try:
        import xxhash
    except ImportError as exc:
        raise CheckpointError("checkpoints need xxhash: pip install xxhash (or dtorch_mpi[hdf5])") from exc
    return xxhash


def running_digest(first: np.ndarray | None = None) -> Any:
    """An ``xxh3_64`` hasher (``update(canonical(block))`` adds blocks in turn)."""
    return require_hasher().xxh3_64(canonical(first) if first is not None else b"")


def combine(terms: np.ndarray) -> int:
    """Sum of per-block terms mod 2**64 (order-free)."""
    return int(sum(int(t) for t in terms.ravel())) & MASK


def reduced_sums(world: Any, terms: Sequence[int], problem: BaseException | None = None,
                 what: str = "the checkpoint load's checksum exchange") -> list[int]:
    """Each dataset's terms summed over the ranks mod 2**64 (one Allreduce of ``len(terms) + 1``
    words under the collective deadline: an unsigned MPI_SUM wraps as ``combine`` does), the same
    list on every rank, whatever the rank count. ``problem``, this rank's failure while computing
    its terms, travels in the same Allreduce (a count of failed ranks): if any rank had one, every
    rank raises (spmd.agree), so the terms are never compared."""
    mine = np.array([problem is not None, *terms], dtype=np.uint64)
    total = np.empty_like(mine)
    wait_request(world.Iallreduce(mine, total, op=MPI.SUM), f"{what} (Allreduce)")
    if total[0]:
        agree(world, problem)
    return [int(t) for t in total[1:]]
