"""Sharding-invariant random numbers: a counter-based generator keyed on the global index.

The value of element ``g`` (flat C-order index in the global tensor) of the ``c``-th random
call after ``manual_seed(s)`` is a pure function of ``(s, c, g)``: a SplitMix64-style mix of
``key(s, c) + (g + 1) * golden``. So every rank generates only its own piece, and the global
value is the same for any mesh shape, size and placements. Normals use the Ziggurat method
vectorised: the ~1% of draws that the fast test rejects are finished on a small subset with
extra draws keyed on (element, attempt, purpose), so each value stays a function of ``g``.
The arithmetic is plain array operations, so CuPy produces the same numbers.

Default seed: 0 (or ``DTORCH_SEED``); every rank must make the same sequence of random calls.
"""

from __future__ import annotations

import os
from math import prod
from typing import Any

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1
_CHUNK = 32768

_seed: int | None = None  # read from DTORCH_SEED at the first random call, not at import
_calls = 0


def manual_seed(seed: int) -> None:
    """Restart the random sequence (same on every rank): values depend only on (seed, call)."""
    global _seed, _calls
    _seed = int(seed) & _MASK
    _calls = 0


def state() -> tuple[int, int]:
    """``(seed, calls so far)``: what must agree across ranks (checked in SPMD debug mode)."""
    global _seed
    if _seed is None:
        _seed = int(os.environ.get("DTORCH_SEED", "0")) & _MASK
    return _seed, _calls


def next_key() -> int:
    """The key of the next random call (advances the call counter)."""
    global _calls
    seed, calls = state()
    key = _mix_int(_mix_int(seed) ^ ((calls + 1) * 0xD1B54A32D192ED03 & _MASK))
    _calls += 1
    return key


def _mix_int(x: int) -> int:
    x &= _MASK
    x = ((x ^ (x >> 30)) * _M1) & _MASK
    x = ((x ^ (x >> 27)) * _M2) & _MASK
    return x ^ (x >> 31)


def _mix(x: Any, t: Any, xp: Any) -> None:
    """In-place SplitMix64 finaliser on a uint64 array (``t`` is scratch of the same size)."""
    xp.right_shift(x, xp.uint64(30), out=t)
    xp.bitwise_xor(x, t, out=x)
    xp.multiply(x, xp.uint64(_M1), out=x)
    xp.right_shift(x, xp.uint64(27), out=t)
    xp.bitwise_xor(x, t, out=x)
    xp.multiply(x, xp.uint64(_M2), out=x)
    xp.right_shift(x, xp.uint64(31), out=t)
    xp.bitwise_xor(x, t, out=x)


class _Counters:
    """``key + (g + 1) * golden`` (mod 2**64) for the global indices ``g`` of a local piece,
    produced in row blocks that fit in cache (the piece is never materialised as indices).

    ``g = lead[r] + tail[c]`` where ``r`` runs over the piece's leading dims and ``c`` over its
    last dim, so a block of rows is one broadcast add.
    """

    def __init__(self, key: int, global_shape: tuple[int, ...], local_shape: tuple[int, ...],
                 offset: tuple[int, ...], xp: Any) -> None:
        self.size = prod(local_shape)
        self.width = local_shape[-1] if local_shape else 1
        self.rows = self.size // self.width if self.width else 0
        strides = [1] * len(global_shape)
        for d in range(len(global_shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * global_shape[d + 1]
        lead = xp.full((1,), (key + _GOLDEN) & _MASK, dtype=xp.uint64)
        for d in range(len(local_shape) - 1):
            term = xp.arange(offset[d], offset[d] + local_shape[d], dtype=xp.uint64)
            term *= xp.uint64((strides[d] * _GOLDEN) & _MASK)
            lead = (lead[:, None] + term[None, :]).reshape(-1)
        self.lead = lead
        if local_shape:
            tail = xp.arange(offset[-1], offset[-1] + local_shape[-1], dtype=xp.uint64)
            tail *= xp.uint64(_GOLDEN)
        else:
            tail = xp.zeros(1, dtype=xp.uint64)
        self.tail = tail
        self.rows_per_block = max(1, _CHUNK // max(self.width, 1))

    def blocks(self, out: Any) -> Any:
        """Yield ``(start, stop)`` flat ranges, writing their counters into ``out[:stop-start]``."""
        for r0 in range(0, self.rows, self.rows_per_block):
            r1 = min(self.rows, r0 + self.rows_per_block)
            n = (r1 - r0) * self.width
            view = out[:n].reshape(r1 - r0, self.width)
            view[...] = self.lead[r0:r1, None]
            view += self.tail[None, :]
            yield r0 * self.width, r1 * self.width


def _uniform_bits_to_float(bits: Any, out: Any, xp: Any) -> None:
    dtype = out.dtype
    mant = {np.dtype("float64"): 53, np.dtype("float32"): 24, np.dtype("float16"): 11}[dtype]
    xp.right_shift(bits, xp.uint64(64 - mant), out=bits)
    xp.multiply(bits, dtype.type(2.0**-mant), out=out, casting="unsafe")


def uniform(key: int, global_shape: tuple[int, ...], local_shape: tuple[int, ...],
            offset: tuple[int, ...], dtype: np.dtype, xp: Any) -> Any:
    """Uniform [0, 1) values of the local piece."""
    ctr = _Counters(key, global_shape, local_shape, offset, xp)
    out = xp.empty(ctr.size, dtype=dtype)
    block = xp.empty(ctr.rows_per_block * max(ctr.width, 1), dtype=xp.uint64)
    scratch = xp.empty_like(block)
    for start, stop in ctr.blocks(block):
        x = block[: stop - start]
        _mix(x, scratch[: x.size], xp)
        _uniform_bits_to_float(x, out[start:stop], xp)
    return out.reshape(local_shape)


# --- normals: the Ziggurat method (Marsaglia & Tsang, 256 layers, 52-bit) -----------------
_ZIG_R = 3.6541528853610088
_ZIG_V = 0.00492867323399
_M52 = float(1 << 52)


def _ziggurat_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer tables: accept thresholds ``k`` (52-bit ints), widths ``w`` and densities ``f``."""
    k = np.zeros(256, dtype=np.uint64)
    w = np.zeros(256)
    f = np.zeros(256)
    dn = tn = _ZIG_R
    q = _ZIG_V / np.exp(-0.5 * dn * dn)
    k[0] = np.uint64((dn / q) * _M52)
    k[1] = 0
    w[0] = q / _M52
    w[255] = dn / _M52
    f[0] = 1.0
    f[255] = np.exp(-0.5 * dn * dn)
    for i in range(254, 0, -1):
        dn = np.sqrt(-2.0 * np.log(_ZIG_V / dn + np.exp(-0.5 * dn * dn)))
        k[i + 1] = np.uint64((dn / tn) * _M52)
        tn = dn
        f[i] = np.exp(-0.5 * dn * dn)
        w[i] = dn / _M52
    return k, w, f


_ZIG_K, _ZIG_W, _ZIG_F = _ziggurat_tables()
_PURPOSE_DRAW, _PURPOSE_U1, _PURPOSE_U2 = 0x5851F42D4C957F2D, 0x14057B7EF767814F, 0x2545F4914F6CDD1D


def _tables(xp: Any) -> tuple[Any, Any, Any]:
    if xp is np:
        return _ZIG_K, _ZIG_W, _ZIG_F
    return xp.asarray(_ZIG_K), xp.asarray(_ZIG_W), xp.asarray(_ZIG_F)


def _zig_draw(bits: Any, xp: Any) -> tuple[Any, Any, Any, Any]:
    """One Ziggurat draw from 64 random bits: (x, layer, negative, accepted by the fast test)."""
    k, w, _ = _tables(xp)
    layer = xp.bitwise_and(bits, xp.uint64(0xFF)).astype(xp.intp)
    negative = xp.bitwise_and(bits, xp.uint64(0x100)).astype(bool)
    rabs = xp.right_shift(bits, xp.uint64(12))
    x = rabs.astype(xp.float64)
    x *= w[layer]
    accepted = rabs < k[layer]
    if xp is np:
        xp.negative(x, out=x, where=negative)
    else:  # CuPy ufuncs take no where=
        x = xp.where(negative, -x, x)
    return x, layer, negative, accepted


def _open_uniform(counters: Any, attempt: int, purpose: int, xp: Any) -> Any:
    """Uniform (0, 1) from the element's counter, the attempt number and a purpose tag."""
    b = counters ^ xp.uint64(_mix_int(attempt * _GOLDEN ^ purpose))
    _mix(b, xp.empty_like(b), xp)
    u = xp.right_shift(b, xp.uint64(11)).astype(xp.float64)
    u += 0.5
    u *= 2.0**-53
    return u


def _ziggurat_slow(counters: Any, x: Any, layer: Any, negative: Any, xp: Any) -> Any:
    """Finish the elements the fast test rejected, exactly as the scalar algorithm would:
    the wedge test, the tail's own rejection loop, or a fresh draw; all keyed per element."""
    _, _, f = _tables(xp)
    out = xp.empty(counters.size, dtype=xp.float64)
    todo = xp.arange(counters.size)
    attempt = 1
    while todo.size:
        c = counters[todo]
        u1 = _open_uniform(c, attempt, _PURPOSE_U1, xp)
        tail = layer == 0
        value = x.copy()
        # tail (layer 0): x = -ln(u1)/r, y = -ln(u2); accept when 2y > x^2; keep looping in the tail
        xx = -xp.log(u1) / _ZIG_R
        yy = -xp.log(_open_uniform(c, attempt, _PURPOSE_U2, xp))
        tail_ok = tail & (yy + yy > xx * xx)
        tail_value = xp.where(negative, -(xx + _ZIG_R), xx + _ZIG_R)
        value[tail_ok] = tail_value[tail_ok]
        # wedge (other layers): accept under the density, else draw afresh
        prev = f[xp.maximum(layer - 1, 0)]
        wedge_ok = ~tail & ((prev - f[layer]) * u1 + f[layer] < xp.exp(-0.5 * x * x))
        done = tail_ok | wedge_ok
        redraw = ~tail & ~wedge_ok
        if bool(redraw.any()):
            fresh = c[redraw] ^ xp.uint64(_mix_int(attempt * _GOLDEN ^ _PURPOSE_DRAW))
            _mix(fresh, xp.empty_like(fresh), xp)
            fx, flayer, fneg, fok = _zig_draw(fresh, xp)
            x[redraw], layer[redraw], negative[redraw] = fx, flayer, fneg
            sub = xp.flatnonzero(redraw)
            value[sub[fok]] = fx[fok]
            done[sub[fok]] = True
        out[todo[done]] = value[done]
        keep = ~done
        todo, x, layer, negative = todo[keep], x[keep], layer[keep], negative[keep]
        attempt += 1
    return out


def normal(key: int, global_shape: tuple[int, ...], local_shape: tuple[int, ...],
           offset: tuple[int, ...], dtype: np.dtype, xp: Any) -> Any:
    """Standard normal values of the local piece."""
    ctr = _Counters(key, global_shape, local_shape, offset, xp)
    out = xp.empty(ctr.size, dtype=dtype)
    n = ctr.rows_per_block * max(ctr.width, 1)
    block = xp.empty(n, dtype=xp.uint64)
    bits = xp.empty(n, dtype=xp.uint64)
    mixing = xp.empty(n, dtype=xp.uint64)
    slow_at, slow_ctr, slow_x, slow_layer, slow_neg = [], [], [], [], []
    for start, stop in ctr.blocks(block):
        c = block[: stop - start]
        b = bits[: c.size]
        b[...] = c
        _mix(b, mixing[: c.size], xp)
        x, layer, negative, accepted = _zig_draw(b, xp)
        out[start:stop] = x
        slow = xp.flatnonzero(~accepted)
        if slow.size:
            slow_at.append(slow + start)
            slow_ctr.append(c[slow])
            slow_x.append(x[slow])
            slow_layer.append(layer[slow])
            slow_neg.append(negative[slow])
    if slow_at:  # finished together: the slow path's fixed cost is paid once per call
        out[xp.concatenate(slow_at)] = _ziggurat_slow(
            xp.concatenate(slow_ctr), xp.concatenate(slow_x), xp.concatenate(slow_layer),
            xp.concatenate(slow_neg), xp)
    return out.reshape(local_shape)
