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
import threading
from math import prod
from typing import Any

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1
_UNIFORM_CHUNK = 32768  # elements per block: uniform's passes work in place in reused scratch
_NORMAL_CHUNK = 8192  # the Ziggurat's per-block temporaries (64 KB) stay below malloc's mmap
# threshold, so they reuse heap memory instead of faulting in fresh pages on every block

# the mixing constants as uint64 scalars, made once (CuPy's uint64 is NumPy's)
_S11, _S12, _S27, _S30, _S31 = (np.uint64(n) for n in (11, 12, 27, 30, 31))
_UM1, _UM2, _UGOLDEN = np.uint64(_M1), np.uint64(_M2), np.uint64(_GOLDEN)
_LAYER_BITS, _SIGN_BIT = np.uint64(0xFF), np.uint64(0x100)

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
    xp.right_shift(x, _S30, out=t)
    xp.bitwise_xor(x, t, out=x)
    xp.multiply(x, _UM1, out=x)
    xp.right_shift(x, _S27, out=t)
    xp.bitwise_xor(x, t, out=x)
    xp.multiply(x, _UM2, out=x)
    xp.right_shift(x, _S31, out=t)
    xp.bitwise_xor(x, t, out=x)


class _Counters:
    """``key + (g + 1) * golden`` (mod 2**64) for the global indices ``g`` of a local piece,
    produced in row blocks that fit in cache (the piece is never materialised as indices).

    ``g = lead[r] + tail[c]`` where ``r`` runs over the piece's leading dims and ``c`` over its
    last dim, so a block of rows is one broadcast add.
    """

    def __init__(self, key: int, global_shape: tuple[int, ...], local_shape: tuple[int, ...],
                 offset: tuple[int, ...], xp: Any, chunk: int) -> None:
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
            tail *= _UGOLDEN
        else:
            tail = xp.zeros(1, dtype=xp.uint64)
        self.tail = tail
        self.add = xp.add
        self.rows_per_block = max(1, chunk // max(self.width, 1))

    def blocks(self, out: Any) -> Any:
        """Yield ``(start, stop)`` flat ranges, writing their counters into ``out[:stop-start]``."""
        for r0 in range(0, self.rows, self.rows_per_block):
            r1 = min(self.rows, r0 + self.rows_per_block)
            n = (r1 - r0) * self.width
            self.add(self.lead[r0:r1, None], self.tail[None, :], out=out[:n].reshape(r1 - r0, self.width))
            yield r0 * self.width, r1 * self.width


def _uniform_bits_to_float(bits: Any, out: Any, xp: Any) -> None:
    dtype = out.dtype
    mant = {np.dtype("float64"): 53, np.dtype("float32"): 24, np.dtype("float16"): 11}[dtype]
    xp.right_shift(bits, xp.uint64(64 - mant), out=bits)
    xp.multiply(bits, dtype.type(2.0**-mant), out=out, casting="unsafe")


_SCRATCH_KEPT = 1 << 18  # elements (2 MiB per buffer): longer blocks (rows wider than this) get fresh buffers
_scratch = threading.local()  # this thread's kept host work buffers


def _memory(xp: Any) -> Any:
    """Where ``xp`` allocates: host memory (None), or the current GPU's id."""
    return None if xp is np else xp.cuda.Device().id


def _work_buffers(xp: Any, n: int) -> tuple[Any, Any, Any]:
    """Three uint64 work buffers of ``n`` elements. Host buffers up to ``_SCRATCH_KEPT``
    elements are kept from call to call (one set per thread, as large as the largest block
    asked for): a fresh buffer of a few hundred KB is a fresh mmap whose page faults cost more
    than the arithmetic on it. CuPy's memory pool already reuses device memory (and orders it
    by stream)."""
    if xp is not np or n > _SCRATCH_KEPT:
        return xp.empty(n, dtype=xp.uint64), xp.empty(n, dtype=xp.uint64), xp.empty(n, dtype=xp.uint64)
    kept = getattr(_scratch, "buffers", None)
    if kept is None or kept[0].size < n:
        kept = _scratch.buffers = (np.empty(n, np.uint64), np.empty(n, np.uint64), np.empty(n, np.uint64))
    return kept[0][:n], kept[1][:n], kept[2][:n]


def uniform(key: int, global_shape: tuple[int, ...], local_shape: tuple[int, ...],
            offset: tuple[int, ...], dtype: np.dtype, xp: Any) -> Any:
    """Uniform [0, 1) values of the local piece."""
    ctr = _Counters(key, global_shape, local_shape, offset, xp, _UNIFORM_CHUNK)
    out = xp.empty(ctr.size, dtype=dtype)
    block, scratch, _ = _work_buffers(xp, ctr.rows_per_block * max(ctr.width, 1))
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


_DEVICE_TABLES: dict[Any, tuple[Any, Any, Any]] = {None: (_ZIG_K, _ZIG_W, _ZIG_F)}


def _tables(xp: Any) -> tuple[Any, Any, Any]:
    """The layer tables in ``xp``'s memory (copied to each GPU once)."""
    where = _memory(xp)
    tables = _DEVICE_TABLES.get(where)
    if tables is None:
        tables = _DEVICE_TABLES[where] = (xp.asarray(_ZIG_K), xp.asarray(_ZIG_W), xp.asarray(_ZIG_F))
    return tables


def _zig_draw(bits: Any, xp: Any) -> tuple[Any, Any, Any, Any]:
    """One Ziggurat draw from 64 random bits: (x, layer, negative, accepted by the fast test)."""
    k, w, _ = _tables(xp)
    layer = xp.bitwise_and(bits, _LAYER_BITS).view(xp.int64)  # < 256: the same bits as int64
    negative = xp.bitwise_and(bits, _SIGN_BIT).astype(bool)
    rabs = xp.right_shift(bits, _S12)
    x = rabs.astype(xp.float64)
    x *= xp.take(w, layer)
    accepted = rabs < xp.take(k, layer)
    if xp is np:
        xp.negative(x, out=x, where=negative)
    else:  # CuPy ufuncs take no where=
        x = xp.where(negative, -x, x)
    return x, layer, negative, accepted


def _attempt_bits(counters: Any, attempt: int, xp: Any) -> Any:
    """The element's three keyed draws of one attempt, mixed in one pass: rows (u1, u2, fresh
    Ziggurat draw), each ``mix(counter ^ mix(attempt * golden ^ purpose))``."""
    tags = [_mix_int(attempt * _GOLDEN ^ p) for p in (_PURPOSE_U1, _PURPOSE_U2, _PURPOSE_DRAW)]
    b = counters[None, :] ^ xp.asarray(tags, dtype=xp.uint64)[:, None]
    _mix(b, xp.empty_like(b), xp)
    return b


def _open_uniform(bits: Any, xp: Any) -> Any:
    """Uniform (0, 1) from mixed bits."""
    u = xp.right_shift(bits, _S11).astype(xp.float64)
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
        bits = _attempt_bits(c, attempt, xp)
        u1, u2 = _open_uniform(bits[:2], xp)
        tail = layer == 0
        # tail (layer 0): x = -ln(u1)/r, y = -ln(u2); accept when 2y > x^2; keep looping in the tail
        xx = -xp.log(u1) / _ZIG_R
        yy = -xp.log(u2)
        tail_ok = tail & (yy + yy > xx * xx)
        shifted = xx + _ZIG_R
        value = xp.where(tail_ok, xp.where(negative, -shifted, shifted), x)
        # wedge (other layers): accept under the density, else draw afresh
        f_layer = f[layer]
        prev = f[xp.maximum(layer - 1, 0)]
        wedge_ok = ~tail & ((prev - f_layer) * u1 + f_layer < xp.exp(-0.5 * x * x))
        done = tail_ok | wedge_ok
        redraw = ~(tail | wedge_ok)
        if bool(redraw.any()):
            fx, flayer, fneg, fok = _zig_draw(bits[2][redraw], xp)
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
    ctr = _Counters(key, global_shape, local_shape, offset, xp, _NORMAL_CHUNK)
    out = xp.empty(ctr.size, dtype=dtype)
    block, bits, mixing = _work_buffers(xp, ctr.rows_per_block * max(ctr.width, 1))
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
        def joined(parts: list[Any]) -> Any:
            return parts[0] if len(parts) == 1 else xp.concatenate(parts)

        out[joined(slow_at)] = _ziggurat_slow(
            joined(slow_ctr), joined(slow_x), joined(slow_layer), joined(slow_neg), xp)
    return out.reshape(local_shape)
