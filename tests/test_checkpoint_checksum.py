"""The lin64 dataset checksum (dtorch_mpi/checkpoint/checksum.py) against its definition,
computed element by element with Python integers, and its partition invariance: the terms of
any set of blocks that tile an array add up to the whole array's checksum. The fast path's
step sizes are shrunk so that small arrays cross every loop boundary (column windows, widening
steps, row blocks). A pure function: every rank checks the same cases."""

from __future__ import annotations

import itertools
from math import prod

import numpy as np
import pytest
from conftest import RUN_ONCE

from dtorch_mpi.checkpoint import checksum as ck

# a pure function: every rank checks the same cases, no communication
pytestmark = RUN_ONCE

MASK = (1 << 64) - 1


def splitmix(x: int) -> int:
    z = x * 0x9E3779B97F4A7C15 & MASK
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK
    return (z ^ (z >> 31)) | 1


def weight(n: int, seed: int, digit: int) -> int:
    out = 1
    for k in range(4):
        out = out * splitmix(seed + k * ck.DIGIT + (n >> (16 * k)) % digit) & MASK
    return out


def reference(full: np.ndarray) -> int:
    """The docstring's definition, element by element, for a whole array."""
    le = full.astype(full.dtype.newbyteorder("<"))
    width = full.dtype.itemsize
    per = max(1, width // 4)
    total = 0
    for index in itertools.product(*(range(s) for s in full.shape)):
        row = int(np.ravel_multi_index(index[:-1], full.shape[:-1])) if full.ndim > 1 else 0
        raw = le[index].tobytes() if full.ndim else le.tobytes()
        words = [int.from_bytes(raw, "little")] if width < 4 else \
            [int.from_bytes(raw[4 * k : 4 * k + 4], "little") for k in range(per)]
        col0 = (index[-1] if full.ndim else 0) * per
        for k, u in enumerate(words):
            total += weight(row, ck.ROW_SEED, ck.DIGIT) * weight(col0 + k, ck.COL_SEED, ck.DIGIT) * u
    return total & MASK


DTYPES = ["<f4", ">f8", "<i2", "u1", "?", "<c16", "<i8", ">u4"]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (5, 1), (1, 9)]


def make(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "?":
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, size=prod(shape) * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(np.dtype(dtype)).reshape(shape)


@pytest.fixture
def small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny widening steps and row blocks, so that small arrays take every loop several times."""
    monkeypatch.setattr(ck, "STEP_WORDS", 8)
    monkeypatch.setattr(ck, "BLOCK_ROWS", 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_checksum_matches_its_definition(dtype: str, small_steps: None) -> None:
    for n, shape in enumerate(SHAPES):
        full = make(shape, dtype, n)
        assert ck.checksum(full, (0,) * full.ndim, full.shape) == (reference(full) if full.size else 0), shape


@pytest.mark.parametrize("dtype", ["<f4", ">f8", "u1"])
def test_checksum_terms_of_any_tiling_add_up(dtype: str, small_steps: None) -> None:
    full = make((7, 6, 5), dtype, 1)
    whole = ck.checksum(full, (0, 0, 0), full.shape)
    assert whole == reference(full)
    for cuts in ([0, 3, 7], [0, 7]), ([0, 1, 4, 7], [0, 2, 6]), ([0, 2, 5, 7], [0, 5, 6], [0, 1, 3, 5]):
        bounds = [*cuts, *([[0, s] for s in full.shape[len(cuts):]])]
        terms = []
        for box in itertools.product(*(list(itertools.pairwise(b)) for b in bounds)):
            block = full[tuple(slice(lo, hi) for lo, hi in box)]
            terms.append(ck.checksum(block, tuple(lo for lo, _ in box), full.shape))
        assert ck.combine(np.array(terms, dtype=np.uint64)) == whole, cuts
        assert not all(t == terms[0] for t in terms)  # the terms depend on where the blocks sit


def test_checksum_crosses_column_windows() -> None:
    """Rows longer than one 2**16-word window, at an offset that is not window aligned (real step sizes)."""
    rng = np.random.default_rng(3)
    full = rng.integers(0, 2**32, size=(3, ck.DIGIT + 40), dtype=np.uint32)
    left, right = full[:, : ck.DIGIT - 7], full[:, ck.DIGIT - 7 :]
    terms = [ck.checksum(left, (0, 0), full.shape), ck.checksum(right, (0, ck.DIGIT - 7), full.shape)]
    cols = [0, 1, ck.DIGIT - 8, ck.DIGIT - 7, ck.DIGIT - 1, ck.DIGIT, ck.DIGIT + 39]
    expected = 0
    for i in range(full.shape[0]):
        for j in cols:
            expected += weight(i, ck.ROW_SEED, ck.DIGIT) * weight(j, ck.COL_SEED, ck.DIGIT) * int(full[i, j])
    sparse = np.zeros_like(full)  # the reference on the columns above, the fast path on the same sparse array
    sparse[:, cols] = full[:, cols]
    assert ck.checksum(sparse, (0, 0), full.shape) == expected & MASK
    assert ck.combine(np.array(terms, dtype=np.uint64)) == ck.checksum(full, (0, 0), full.shape)


def test_any_single_bit_flip_changes_the_checksum(small_steps: None) -> None:
    full = make((4, 5), "<f8", 7)
    whole = ck.checksum(full, (0, 0), full.shape)
    raw = full.view(np.uint8).reshape(-1)
    for byte in range(raw.size):
        for bit in range(8):
            damaged = raw.copy()
            damaged[byte] ^= 1 << bit
            assert ck.checksum(damaged.view(full.dtype).reshape(full.shape), (0, 0), full.shape) != whole
