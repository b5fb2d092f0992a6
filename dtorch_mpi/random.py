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

import threading
from math import prod
from typing import Any, NamedTuple

import numpy as np

from . import settings

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1
_UNIFORM_CHUNK = 32768  # elements per block: uniform's passes work in place in reused scratch
_NORMAL_CHUNK = 8192  # the Ziggurat's per-block temporaries (64 KB) stay below malloc's mmap
# threshold, so they reuse heap memory instead of faulting in fresh pages on every block

_UGOLDEN = np.uint64(_GOLDEN)

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
        _seed = int(settings.get("DTORCH_SEED")) & _MASK
    return _seed, _calls


def set_state(state: tuple[int, int]) -> None:
    """Put the generator back at ``state`` (a ``state()``): the next calls draw the keys drawn
    from there before (activation checkpointing replays a forward's dropout masks)."""
    global _seed, _calls
    _seed, _calls = int(state[0]) & _MASK, int(state[1])


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


def _mix(x: Any, t: Any, xp: Any, kit: _Kit, src: Any = None) -> None:
    """SplitMix64 finaliser on a uint64 array, in place or of ``src`` into ``x`` (``t`` is
    scratch of the same size)."""
    src = x if src is None else src
    xp.right_shift(src, kit.s30, out=t)
    xp.bitwise_xor(src, t, out=x)
    xp.multiply(x, kit.m1, out=x)
    xp.right_shift(x, kit.s27, out=t)
    xp.bitwise_xor(x, t, out=x)
    xp.multiply(x, kit.m2, out=x)
    xp.right_shift(x, kit.s31, out=t)
    xp.bitwise_xor(x, t, out=x)


_TERMS_KEPT, _TERMS_KEPT_LEN = 64, 1 << 14  # pieces whose index terms are kept, and their longest
_terms: dict[tuple[Any, ...], tuple[Any, Any]] = {}  # (shapes, offset, memory) -> (lead, tail)


def _index_terms(global_shape: tuple[int, ...], local_shape: tuple[int, ...], offset: tuple[int, ...],
                 xp: Any) -> tuple[Any, Any]:
    """``golden * g`` split as ``lead[r] + tail[c]`` over a piece's rows and last-dim columns.
    They do not depend on the call's key, so the latest small pieces' are kept: a training loop
    draws the same shapes again and again, and making them is most of a small call's cost."""
    where = (global_shape, local_shape, offset, _memory(xp))
    terms = _terms.get(where)
    if terms is not None:
        return terms
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    lead = xp.zeros(1, dtype=xp.uint64)
    for d in range(len(local_shape) - 1):
        term = xp.arange(offset[d], offset[d] + local_shape[d], dtype=xp.uint64)
        term *= xp.uint64((strides[d] * _GOLDEN) & _MASK)
        lead = (lead[:, None] + term[None, :]).reshape(-1)
    if local_shape:
        tail = xp.arange(offset[-1], offset[-1] + local_shape[-1], dtype=xp.uint64)
        tail *= _UGOLDEN
    else:
        tail = xp.zeros(1, dtype=xp.uint64)
    if lead.size + tail.size <= _TERMS_KEPT_LEN:
        if len(_terms) >= _TERMS_KEPT:
            del _terms[next(iter(_terms))]  # the oldest
        _terms[where] = lead, tail
    return lead, tail


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
        lead, self.tail = _index_terms(global_shape, local_shape, offset, xp)
        self.lead = lead + xp.uint64((key + _GOLDEN) & _MASK)  # wraps mod 2**64, as the mix wants
        self.add = xp.add
        # a piece of fewer rows than a block is one block of its own size: the work buffers are
        # sized by it (a fresh device allocation per call would otherwise be a whole chunk)
        self.rows_per_block = max(1, min(self.rows, chunk // max(self.width, 1)))

    def blocks(self, out: Any) -> Any:
        """Yield ``(start, stop)`` flat ranges, writing their counters into ``out[:stop-start]``."""
        for r0 in range(0, self.rows, self.rows_per_block):
            r1 = min(self.rows, r0 + self.rows_per_block)
            n = (r1 - r0) * self.width
            self.add(self.lead[r0:r1, None], self.tail[None, :], out=out[:n].reshape(r1 - r0, self.width))
            yield r0 * self.width, r1 * self.width


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
    kit = _kit(xp)
    ctr = _Counters(key, global_shape, local_shape, offset, xp, _UNIFORM_CHUNK)
    out = xp.empty(ctr.size, dtype=dtype)
    shift, scale = kit.unit[out.dtype]  # the dtype's mantissa bits of the mixed value, to [0, 1)
    block, scratch, _ = _work_buffers(xp, ctr.rows_per_block * max(ctr.width, 1))
    for start, stop in ctr.blocks(block):
        x = block[: stop - start]
        _mix(x, scratch[: x.size], xp, kit)
        xp.right_shift(x, shift, out=x)
        xp.multiply(x, scale, out=out[start:stop], casting="unsafe")
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
_MANY_REJECTED = 16  # from this many rejected draws a slow pass makes two attempts, else one


class _Kit(NamedTuple):
    """What a call needs, in one array module's memory, made once per memory: the constants
    as 0-d arrays (a ufunc converts a NumPy scalar operand on every call, which costs more
    than the operation on a small block) and the Ziggurat's tables, indexed by a draw's low
    9 bits (``layer + 256 * negative``): one gather gives what an if-chain on layer and sign
    would, and the products are exact, since ``r * -w`` is ``-(r * w)`` bit for bit."""

    s11: Any
    s12: Any
    s27: Any
    s30: Any
    s31: Any
    m1: Any
    m2: Any
    draw_bits: Any  # a draw's low 9 bits: layer (bits 0-7) + 256 * negative (bit 8)
    half: Any
    ulp53: Any
    neg_half: Any
    r: Any  # where the tail starts
    neg_r: Any
    neg_two: Any
    k: Any  # fast-test thresholds (52-bit ints)
    w: Any  # signed layer widths: x = (bits >> 12) * w
    f: Any  # the layer's density
    df: Any  # the next layer's density minus this one's: the wedge's height
    tail: Any  # the base layer, whose rejected draws go to the tail
    unit: dict[np.dtype, tuple[Any, Any]]  # float dtype -> (shift, scale) of uniform [0, 1)


def _host_kit() -> _Kit:
    def u64(n: int) -> np.ndarray:
        return np.array(n, dtype=np.uint64)

    def signed(t: np.ndarray) -> np.ndarray:
        return np.concatenate([t, t])

    mantissa: dict[np.dtype, int] = {np.dtype(np.float64): 53, np.dtype(np.float32): 24, np.dtype(np.float16): 11}
    return _Kit(s11=u64(11), s12=u64(12), s27=u64(27), s30=u64(30), s31=u64(31), m1=u64(_M1), m2=u64(_M2),
                draw_bits=u64(0x1FF), half=np.array(0.5), ulp53=np.array(2.0**-53), neg_half=np.array(-0.5),
                r=np.array(_ZIG_R), neg_r=np.array(-_ZIG_R), neg_two=np.array(-2.0),
                k=signed(_ZIG_K), w=np.concatenate([_ZIG_W, -_ZIG_W]), f=signed(_ZIG_F),
                df=signed(_ZIG_F[np.maximum(np.arange(256) - 1, 0)] - _ZIG_F), tail=signed(np.arange(256) == 0),
                unit={dt: (u64(64 - m), np.array(2.0**-m, dtype=dt)) for dt, m in mantissa.items()})


_KITS: dict[Any, _Kit] = {None: _host_kit()}


def _kit(xp: Any) -> _Kit:
    """The constants and tables in ``xp``'s memory (copied to each GPU once)."""
    where = _memory(xp)
    kit = _KITS.get(where)
    if kit is None:
        host = _KITS[None]
        unit = {dt: (xp.asarray(s), xp.asarray(v)) for dt, (s, v) in host.unit.items()}
        kit = _KITS[where] = _Kit._make([xp.asarray(a) for a in host[:-1]] + [unit])
    return kit


def _tag(attempt: int, purpose: int) -> int:
    return _mix_int(attempt * _GOLDEN ^ purpose)


_pass_tags: dict[tuple[Any, int, int], Any] = {}  # (memory, first attempt, attempts) -> tags


def _tags(first: int, attempts: int, xp: Any) -> Any:
    """A pass's keys, one row each: u1 and u2 of attempts ``first..first+A-1``, 0 (the state's
    own draw: ``mix(counter ^ 0)`` is the element's first draw), the fresh draws of those
    attempts. Each keyed draw is ``mix(counter ^ mix(attempt * golden ^ purpose))``."""
    key = (_memory(xp), first, attempts)
    tags = _pass_tags.get(key)
    if tags is None:
        span = range(first, first + attempts)
        rows = ([_tag(a, _PURPOSE_U1) for a in span] + [_tag(a, _PURPOSE_U2) for a in span]
                + [0] + [_tag(a, _PURPOSE_DRAW) for a in span])
        tags = _pass_tags[key] = xp.asarray(rows, dtype=xp.uint64)[:, None]
    return tags


def _ziggurat_slow(counters: Any, xp: Any, t: _Kit) -> Any:
    """Finish the elements the fast test rejected, exactly as the scalar algorithm would:
    at each attempt the wedge test (else a fresh draw, taken if it passes the fast test), or
    in the tail (x = -ln(u1)/r, y = -ln(u2), accept when 2y > x^2) its own rejection loop;
    every draw keyed on (element, attempt, purpose).

    The draws of an attempt do not depend on the outcome of the ones before, so a pass makes
    ``A`` (1 or 2) attempts' draws for all elements at once, evaluates every attempt from the
    state it would start in, and takes each element's first accepted one: about 30 array
    operations a pass (40 with a tail draw among them), where the scalar loop's order cost 60
    an attempt. With two attempts a pass, 3 in 1000 calls of 2 K elements need a second pass."""
    out: Any = None
    todo = None  # the unfinished elements' indices in ``out`` (None: all)
    state_tag = None  # the tag of each one's current draw (None: its first draw)
    first = 1
    while True:
        n = counters.size
        A = 2 if n >= _MANY_REJECTED else 1  # a few: a second attempt is rare
        tags = _tags(first, A, xp)
        bits = counters ^ tags
        if state_tag is not None:
            xp.bitwise_xor(counters, state_tag, out=bits[2 * A])
        _mix(bits, xp.empty_like(bits), xp, t)
        # the draws: row 0 the state the pass starts from, row i the fresh draw of its attempt i
        drawn = bits[2 * A:]
        idx = xp.bitwise_and(drawn, t.draw_bits).view(xp.int64)
        rabs = xp.right_shift(drawn, t.s12)
        x = rabs * t.w[idx]
        sidx, sx = idx[:A], x[:A]  # attempt i starts from draw i-1 (unless in the tail)
        tails = t.tail[sidx]
        has_tail = bool(tails.any())
        u = xp.add(xp.right_shift(bits[: 2 * A if has_tail else A], t.s11), t.half)  # (m + 0.5) / 2**53
        u *= t.ulp53
        wedge_ok = t.df[sidx] * u[:A] + t.f[sidx] < xp.exp(t.neg_half * sx * sx)
        done = wedge_ok | (rabs[1:] < t.k[idx[1:]])
        value = xp.where(wedge_ok, sx, x[1:])
        if has_tail:  # once in the tail an element stays there: x = -ln(u1) / r, 2 * -ln(u2) > x^2
            logs = xp.log(u)
            xx = logs[:A] / t.neg_r
            in_tail = tails | tails[0]
            tail_x = xp.where(tails[0], sx[0], sx)  # the tail's draw: its sign is the value's
            done = xp.where(in_tail, logs[A:] * t.neg_two > xx * xx, done)
            value = xp.where(in_tail, xp.copysign(xx + t.r, tail_x), value)
        if A == 1:
            ok, value = done[0], value[0]
        else:  # each element's first accepted attempt
            ok, value = done[0] | done[1], xp.where(done[0], value[0], value[1])
        if todo is None:
            if bool(ok.all()):
                return value
            out, todo = xp.empty(n, dtype=xp.float64), xp.arange(n)
        out[todo[ok]] = value[ok]
        # the rest start the next pass from their last fresh draw, or from their tail draw
        keep = ~ok
        row = xp.where(in_tail[-1], tails.argmax(axis=0), A) if has_tail else xp.full(n, A)
        row_tags = xp.concatenate([xp.zeros((1, n), dtype=xp.uint64) if state_tag is None else state_tag[None],
                                   xp.broadcast_to(tags[2 * A + 1:], (A, n))])
        state_tag = row_tags[row, xp.arange(n)][keep]
        todo, counters = todo[keep], counters[keep]
        if not todo.size:
            return out
        first += A


def normal(key: int, global_shape: tuple[int, ...], local_shape: tuple[int, ...],
           offset: tuple[int, ...], dtype: np.dtype, xp: Any) -> Any:
    """Standard normal values of the local piece: the fast test here, its ~1.5% rejected
    draws finished together by ``_ziggurat_slow`` (its fixed cost paid once per call)."""
    t = _kit(xp)
    ctr = _Counters(key, global_shape, local_shape, offset, xp, _NORMAL_CHUNK)
    out = xp.empty(ctr.size, dtype=dtype)
    block, bits, scratch = _work_buffers(xp, ctr.rows_per_block * max(ctr.width, 1))
    slow_at, slow_ctr = [], []
    for start, stop in ctr.blocks(block):
        c = block[: stop - start]
        b = bits[: c.size]
        _mix(b, scratch[: c.size], xp, t, src=c)
        idx = xp.bitwise_and(b, t.draw_bits, out=scratch[: c.size]).view(xp.int64)
        xp.right_shift(b, t.s12, out=b)
        xp.multiply(b, t.w[idx], out=out[start:stop], casting="unsafe")
        slow = (b >= t.k[idx]).nonzero()[0]
        if slow.size:
            slow_at.append(slow + start if start else slow)
            slow_ctr.append(c[slow])
    if slow_at:
        if len(slow_at) > 1:
            slow_at, slow_ctr = [xp.concatenate(slow_at)], [xp.concatenate(slow_ctr)]
        out[slow_at[0]] = _ziggurat_slow(slow_ctr[0], xp, t)
    return out.reshape(local_shape)
