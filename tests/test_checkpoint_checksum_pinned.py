"""lin64 values pinned: checkpoint files already written record them, so every later kernel must
give the same value bit for bit. Each case is hard-coded (computed once by the einsum kernel that
wrote the first files) and also checked against a vectorised NumPy reference written from the
module docstring's definition, on blocks larger than the element-by-element reference in
test_checkpoint_checksum.py can afford: every dtype width, big-endian, 0-d to 3-d, blocks at
offsets inside larger global shapes (whole rows and not), rows crossing the 2**16-word column
window, more than 2**17 rows, and indices whose upper 16-bit digits are not zero."""

from __future__ import annotations

import hashlib
from math import prod

import numpy as np
import pytest
from conftest import RUN_ONCE

from dtorch_mpi.checkpoint import checksum as ck

# a pure function: every rank checks the same cases, no communication
pytestmark = RUN_ONCE

W = 1 << 16
# name: (dtype, block shape, offset, global shape, pinned lin64)
CASES: dict[str, tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int]] = {
    "i1-1d": ("i1", (1000,), (0,), (1000,), 0x68E7C27D4E7AA5C0),
    "u2-2d": ("<u2", (37, 53), (0, 0), (37, 53), 0xA0B251FE7042B4DC),
    "u2-be-2d": (">u2", (37, 53), (0, 0), (37, 53), 0x0D2C064AB358ECA9),
    "i4-3d": ("<i4", (5, 7, 11), (0, 0, 0), (5, 7, 11), 0x5528BE6A6E69D480),
    "i4-be-3d": (">i4", (5, 7, 11), (0, 0, 0), (5, 7, 11), 0xE80DE1CDDAFA59E1),
    "f4-2d": ("<f4", (64, 129), (0, 0), (64, 129), 0x65A0091E89FD3E53),
    "f4-be-2d": (">f4", (64, 129), (0, 0), (64, 129), 0xE7660F1BC53A8C9C),
    "f8-2d": ("<f8", (33, 70), (0, 0), (33, 70), 0x03C01E425E327CBF),
    "f8-be-1d": (">f8", (4097,), (0,), (4097,), 0x289E08550A38D6A6),
    "c16-2d": ("<c16", (9, 31), (0, 0), (9, 31), 0x211628570A9E4D24),
    "c16-be-3d": (">c16", (2, 3, 5), (0, 0, 0), (2, 3, 5), 0x7AF3E2CC270DB6FB),
    "bool-2d": ("?", (50, 41), (0, 0), (50, 41), 0x912C1E6541A5295E),
    "f8-0d": ("<f8", (), (), (), 0xC27C3986A394F02D),
    "i1-0d": ("i1", (), (), (), 0x2F43E2F63DAA1450),
    "c16-0d": (">c16", (), (), (), 0x5AD3E8A229C0606F),
    "f4-3d-part-rows": ("<f4", (3, 4, 5), (2, 1, 3), (9, 8, 10), 0xEC7D9B5A109283FB),
    "f8-3d-whole-rows": ("<f8", (4, 8, 10), (3, 0, 0), (9, 8, 10), 0xE574C2B040F3BCB8),
    "i4-3d-whole-planes": ("<i4", (2, 8, 10), (5, 0, 0), (9, 8, 10), 0x801F8469D22EF9EA),
    "u2-2d-offset": ("<u2", (20, 30), (7, 11), (40, 50), 0x5E759CE2877B607F),
    "u4-window-crossing": ("<u4", (2, W + 100), (1, W - 50), (4, 2 * W + 200), 0xA10FBC72A7D87813),
    "f8-window-crossing": ("<f8", (3, W // 2 + 10), (0, 0), (3, W // 2 + 10), 0x209518AB0781995D),
    "c16-window-offset": ("<c16", (2, 40), (0, W // 4 - 5), (2, W), 0xF1C006E69FCC0188),
    "i1-tall": ("i1", (2 * W + 5, 2), (0, 0), (2 * W + 5, 2), 0x779D38C7965C022C),
    "f4-tall-narrow": ("<f4", (3 * W + 7, 3), (0, 0), (3 * W + 7, 3), 0xC754A4EB4CE9032D),
    "f8-rows-digit1": ("<f8", (10, 3), (70000, 0), (2 * W + 10, 3), 0x4AFC65D5C3C08B20),
    "f4-rows-digit2": ("<f4", (2, 3), (2**33, 0), (2**34, 3), 0xD43AC3425AE95484),
    "u1-rows-digit3-3d": ("u1", (2, 2, 3), (2**40, 5, 0), (2**41, 7, 3), 0x8DC5851E33216599),
    "f8-cols-digit2": ("<f8", (2, 3), (0, 2**40), (2, 2**41), 0x04C9219F18AB7600),
    "i4-cols-digit3": ("<i4", (3, 4), (1, 2**50), (5, 2**51), 0x5BF4DB02908CD07B),
    "f8-1d-tiles": (">f8", (2 * W + 3,), (5,), (2 * W + 20,), 0x9C8F948122622F61),
    "u4-long-rows": ("<u4", (2, 4 * W + 100), (1, 70000), (4, 8 * W), 0x01005CB8747DE872),
    "empty-1d": ("<f8", (0,), (0,), (0,), 0x0000000000000000),
    "empty-rows": ("<f4", (0, 5), (3, 0), (6, 5), 0x0000000000000000),
    "empty-cols": ("<i4", (3, 0), (0, 2), (3, 4), 0x0000000000000000),
}


def block_of(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic bytes from the case's name (SHAKE-128: the same on every platform and NumPy)."""
    dt = np.dtype(dtype)
    raw = np.frombuffer(hashlib.shake_128(name.encode()).digest(prod(shape) * dt.itemsize), dtype=np.uint8)
    if dt.kind == "b":
        return (raw & 1).astype(bool).reshape(shape)
    return raw.view(dt).reshape(shape)


def splitmix(x: np.ndarray) -> np.ndarray:
    z = x * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


def weights(n: np.ndarray, seed: int) -> np.ndarray:
    """w(n, seed): the product of s(seed + k * 2**16 + digit k of n) over k = 0..3 (wraps mod 2**64)."""
    out = np.ones(n.shape, dtype=np.uint64)
    for k in range(4):
        digit = (n >> np.uint64(16 * k)) & np.uint64(W - 1)
        out *= splitmix(np.uint64(seed) + np.uint64(k * W) + digit)
    return out


def reference(block: np.ndarray, offset: tuple[int, ...], global_shape: tuple[int, ...]) -> int:
    """The definition vectorised: u[i, j] times row and column weights of the global indices, summed mod 2**64."""
    if block.size == 0:
        return 0
    a = np.ascontiguousarray(block.astype(block.dtype.newbyteorder("<"))).reshape(block.shape or (1,))
    width = a.dtype.itemsize
    word = {1: np.uint8, 2: np.uint16}.get(width, np.uint32)
    per = max(1, width // 4)
    u = a.reshape(-1, a.shape[-1]).view(word).astype(np.uint64)
    lead = [np.arange(o, o + s, dtype=np.uint64) for o, s in zip(offset[:-1], block.shape[:-1])]
    rows = np.zeros(1, dtype=np.uint64)
    for axis, index in enumerate(lead):  # C-order global row index over all dims but the last
        rows = (rows[:, None] * np.uint64(global_shape[axis]) + index[None, :]).reshape(-1)
    cols = np.uint64((offset[-1] if block.ndim else 0) * per) + np.arange(u.shape[1], dtype=np.uint64)
    terms = weights(rows, ck.ROW_SEED)[:, None] * weights(cols, ck.COL_SEED)[None, :] * u
    return int(terms.sum(dtype=np.uint64))


@pytest.mark.parametrize("narrow", [0, 1 << 20], ids=["row-sums-first", "column-sums-first"])
@pytest.mark.parametrize("name", list(CASES))
def test_lin64_is_pinned(name: str, narrow: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case in both reduction orders (the kernel picks one by row width)."""
    monkeypatch.setattr(ck, "NARROW", narrow)
    dtype, shape, offset, global_shape, pinned = CASES[name]
    block = block_of(name, dtype, shape)
    value = ck.checksum(block, offset, global_shape)
    assert value == reference(block, offset, global_shape)
    assert value == pinned


def test_lin64_of_a_strided_view_is_that_of_its_copy() -> None:
    """A non-contiguous block (a slice of a larger local array) hashes as its contiguous copy."""
    base = block_of("strided", "<f8", (20, 30))
    view = base[3:15:2, 5:27:3]
    assert ck.checksum(view, (4, 9), (50, 60)) == ck.checksum(view.copy(), (4, 9), (50, 60)) \
        == reference(view, (4, 9), (50, 60))
