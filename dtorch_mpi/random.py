"""Sharding-invariant random numbers: a counter-based generator keyed on the global index.

The value of element ``g`` (flat C-order index in the global tensor) of the ``c``-th random
call after ``manual_seed(s)`` is a pure function of ``(s, c, g)``: a SplitMix64-style mix of
``key(s, c) + (g + 1) * golden``. So every rank generates only its own piece, and the global
value is the same for any mesh shape, size and placements. Normals use the Marsaglia polar
method; a rejected element retries with a per-attempt key, so it stays a function of ``g``.
The arithmetic is plain array operations, so CuPy produces the same numbers.

Default seed: 0 (or ``DTORCH_SEED``); every rank must make the same sequence of random calls.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1
_CHUNK = 16384

_seed = int(os.environ.get("DTORCH_SEED", "0"))
_calls = 0


def manual_seed(seed: int) -> None:
    """Restart the random sequence (same on every rank): values depend only on (seed, call)."""
    global _seed, _calls
    _seed = int(seed) & _MASK
    _calls = 0


def next_key() -> int:
    """The key of the next random call (advances the call counter)."""
    global _calls
    key = _mix_int(_mix_int(_seed) ^ ((_calls + 1) * 0xD1B54A32D192ED03 & _MASK))
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


def counters(
    key: int, global_shape: tuple[int, ...], local_shape: tuple[int, ...],
    offset: tuple[int, ...], xp: Any,
) -> Any:
    """``key + (g + 1) * golden`` (mod 2**64) for every global index ``g`` of the local piece."""
    out = xp.full(local_shape, (key + _GOLDEN) & _MASK, dtype=xp.uint64)
    if out.size == 0 or not local_shape:
        return out.reshape(-1)
    stride = 1
    for d in reversed(range(len(global_shape))):
        step = (stride * _GOLDEN) & _MASK
        term = (xp.arange(offset[d], offset[d] + local_shape[d], dtype=xp.uint64)
                * xp.uint64(step))
        out += term.reshape((-1,) + (1,) * (len(global_shape) - d - 1))
        stride *= global_shape[d]
    return out.reshape(-1)


def _uniform_bits_to_float(bits: Any, out: Any, xp: Any) -> None:
    dtype = out.dtype
    mant = {np.dtype("float64"): 53, np.dtype("float32"): 24, np.dtype("float16"): 11}[dtype]
    xp.right_shift(bits, xp.uint64(64 - mant), out=bits)
    xp.multiply(bits, dtype.type(2.0**-mant), out=out, casting="unsafe")


def uniform(key: int, global_shape: tuple[int, ...], local_shape: tuple[int, ...],
            offset: tuple[int, ...], dtype: np.dtype, xp: Any) -> Any:
    """Uniform [0, 1) values of the local piece."""
    ctr = counters(key, global_shape, local_shape, offset, xp)
    out = xp.empty(ctr.size, dtype=dtype)
    scratch = xp.empty(min(_CHUNK, ctr.size), dtype=xp.uint64)
    for s in range(0, ctr.size, _CHUNK):
        x = ctr[s : s + _CHUNK]
        _mix(x, scratch[: x.size], xp)
        _uniform_bits_to_float(x, out[s : s + _CHUNK], xp)
    return out.reshape(local_shape)


def _polar(bits: Any, xp: Any) -> tuple[Any, Any]:
    """Polar-method candidates from 64 random bits: (normal value, accepted mask)."""
    x = xp.right_shift(bits, xp.uint64(32)).astype(xp.float64)
    x *= 2.0**-31
    x -= 1.0
    y = xp.bitwise_and(bits, xp.uint64(0xFFFFFFFF)).astype(xp.float64)
    y *= 2.0**-31
    y -= 1.0
    s = x * x
    s += y * y
    ok = (s < 1.0) & (s > 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        f = xp.log(s)
        f *= -2.0
        f /= s
        xp.sqrt(f, out=f)
    f *= x
    return f, ok


def normal(key: int, global_shape: tuple[int, ...], local_shape: tuple[int, ...],
           offset: tuple[int, ...], dtype: np.dtype, xp: Any) -> Any:
    """Standard normal values of the local piece."""
    ctr = counters(key, global_shape, local_shape, offset, xp)
    out = xp.empty(ctr.size, dtype=dtype)
    scratch = xp.empty(min(_CHUNK, ctr.size), dtype=xp.uint64)
    bits = xp.empty(min(_CHUNK, ctr.size), dtype=xp.uint64)
    for s in range(0, ctr.size, _CHUNK):
        c = ctr[s : s + _CHUNK]
        b = bits[: c.size]
        b[...] = c
        _mix(b, scratch[: c.size], xp)
        value, ok = _polar(b, xp)
        pending = xp.nonzero(~ok)[0]
        attempt = 1
        while pending.size:
            retry = c[pending] ^ xp.uint64(_mix_int(attempt * _GOLDEN))
            _mix(retry, xp.empty_like(retry), xp)
            v2, ok2 = _polar(retry, xp)
            value[pending[ok2]] = v2[ok2]
            pending = pending[~ok2]
            attempt += 1
        out[s : s + c.size] = value
    return out.reshape(local_shape)
