"""Layout arithmetic of the collectives: pure functions of shapes, sizes and ranks.

The ``(outer, axis, inner)`` views, block offsets, ``v``-collective counts and displacements,
the padded path's block widths and kept rows, and the per-shape plans of an all-gather, an
all-to-all and an exchange (``gather_layout``, ``a2a_layout``, ``exchange_plan``). None of it
calls MPI or touches a buffer; the plans are cached (``by_identity``) so a repeated call of one
shape computes nothing. The backends (comm/mpi_backend.py, comm/nccl_backend.py) move data by
these layouts; which MPI call a collective makes is comm/routes.py's decision.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from math import prod
from typing import Any, NamedTuple, TypeVar

import numpy as np

from .routes import Route, all_to_all_bytes, all_to_all_route, gather_route


def view3(shape: Sequence[int], axis: int) -> tuple[int, int, int]:
    """``(prod(shape[:axis]), shape[axis], prod(shape[axis+1:]))``."""
    return prod(shape[:axis]), shape[axis], prod(shape[axis + 1 :])


def offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def with_dim(shape: Sequence[int], axis: int, length: int) -> tuple[int, ...]:
    return tuple(length if i == axis else n for i, n in enumerate(shape))


F = TypeVar("F", bound=Callable[..., Any])


def by_identity(maxsize: int) -> Callable[[F], F]:
    """Cache a pure layout function on its arguments, a long tuple argument (over 16 items) by
    *identity*: hashing a tuple of every rank's sizes costs O(ranks) per call (tuples do not keep their hash), and the
    sizes a compiled plan passes are one object on every call (``split_sizes`` is cached). An
    entry keeps its arguments alive, so an id in a key is never reused while the entry lives;
    another tuple of equal sizes is a miss that computes the same layout again."""
    def wrap(fn: F) -> F:
        cache: "OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], Any]]" = OrderedDict()

        def cached(*args: Any) -> Any:
            if list in map(type, args):  # a caller's list of sizes: by value
                args = tuple(tuple(a) if type(a) is list else a for a in args)
            key = tuple([(id(a),) if type(a) is tuple and len(a) > 16 else a for a in args])
            hit = cache.get(key)
            if hit is not None:
                return hit[1]
            value = fn(*args)
            cache[key] = (args, value)
            if len(cache) > maxsize:
                cache.popitem(last=False)
            return value

        cached.cache_clear = cache.clear  # type: ignore[attr-defined]
        cached.__wrapped__ = fn  # type: ignore[attr-defined]
        cached.__doc__ = fn.__doc__
        return cached  # type: ignore[return-value]

    return wrap


@by_identity(maxsize=256)
def destination_runs(sizes: tuple[int, ...], per_row: int, width: int | None) -> tuple[Any, int]:
    """``mpi_backend._pack_by_destination``'s copies as runs of equal blocks (``block_runs``) and its length."""
    slot = None if width is None else width * per_row
    counts = [(width if width is not None else n) * per_row for n in sizes]
    return block_runs(list(zip(offsets(counts), sizes, offsets(sizes))), per_row, slot), sum(counts)


@by_identity(maxsize=256)
def size_facts(sizes: Sequence[int]) -> tuple[bool, int]:
    """``(whether the blocks are unequal, the largest)``, once per size list."""
    return len(set(sizes)) > 1, max(sizes)


@by_identity(maxsize=1024)
def gather_layout(path: str, out_shape: tuple[int, ...], axis: int, sizes: tuple[int, ...],
                  itemsize: int) -> tuple[int, int, int, Route, list[int]]:
    """An all-gather's ``(outer, length, inner)`` view, route and block offsets: a pure function
    of its arguments, computed once instead of per call."""
    outer, length, inner = view3(out_shape, axis)
    route = gather_route(path, sizes, outer, prod(out_shape) * itemsize)
    return outer, length, inner, route, offsets(sizes)


@by_identity(maxsize=256)
def gather_v_spec(sizes: Sequence[int], inner: int) -> tuple[list[int], list[int]]:
    """An ``Allgatherv``'s receive counts and displacements (elements)."""
    counts = [n * inner for n in sizes]
    return counts, offsets(counts)


@by_identity(maxsize=256)
def padded_runs(sizes: tuple[int, ...], width: int) -> tuple[tuple[int, int, int, int], ...]:
    """A gather padded to ``width`` rows per rank, compacted: ``(source row, blocks, rows per
    block, destination row)`` per run of consecutive ranks with the same non-zero size (an
    uneven split has at most three such runs, so compacting is a few strided copies, not a
    copy per rank or a gather of every row)."""
    runs: list[tuple[int, int, int, int]] = []
    dst = 0
    for i, n in enumerate(sizes):
        if n and runs and runs[-1][2] == n and runs[-1][0] + runs[-1][1] * width == i * width:
            src, k, _, at = runs[-1]
            runs[-1] = (src, k + 1, n, at)
        elif n:
            runs.append((i * width, 1, n, dst))
        dst += n
    return tuple(runs)


@by_identity(maxsize=256)
def padded_rows(sizes: Sequence[int], width: int) -> np.ndarray:
    """The rows of a gather padded to ``width`` rows per rank that hold data, in order."""
    starts = np.repeat(np.arange(len(sizes)) * width, sizes)
    within = np.arange(sum(sizes)) - np.repeat(np.asarray(offsets(sizes), dtype=np.int64), sizes)
    return starts + within


class A2ALayout(NamedTuple):
    """An all-to-all's block arithmetic for one (path, shapes, axes, sizes, itemsize, group
    rank): a pure function of them, computed once (``a2a_layout``) instead of per call."""

    route: Route
    width: int  # elements per block of an equal-block Alltoall (padded: the largest block)
    own: tuple[tuple[slice, ...], tuple[slice, ...]] | None  # (send index, out index) of the block kept here
    pack_len: int | None  # elements of the pack buffer, None when ``send`` moves in place
    unpack_len: int | None  # elements of the receive buffer, None when MPI writes into ``out``
    packs: tuple[tuple[int, int, int, int, int], ...]  # runs of equal blocks: (at, blocks, length, offset, stride)
    unpacks: tuple[tuple[int, int, int, int, int], ...]
    send3: tuple[int, int, int]  # the (rows, axis, inner) views the runs index
    recv3: tuple[int, int, int]
    send_spec: tuple[list[int], list[int]]  # Alltoallv (counts, displacements)
    recv_spec: tuple[list[int], list[int]]
    send_vector: tuple[int, int, int] | None  # a strided send side read in place: (rows, run, stride)
    recv_vector: tuple[int, int, int] | None  # a strided output written in place


def block_runs(blocks: list[tuple[int, int, int]], per_row: int, slot: int | None) -> tuple[tuple[int, int, int, int, int], ...]:
    """Consecutive blocks ``(at, length, axis offset)`` of equal length, adjacent on the axis and
    evenly spaced in the buffer, as runs ``(at, blocks, length, offset, stride)``: the split
    rule makes at most two lengths, so a pack or unpack is a few NumPy copies, not one per rank
    (``slot``: the padded path's fixed spacing, else each block's own size)."""
    runs: list[list[int]] = []
    for at, n, o in blocks:
        if n == 0:
            continue
        stride = slot if slot is not None else n * per_row
        last = runs[-1] if runs else None
        if last is not None and last[2] == n and last[4] == stride and last[3] + last[1] * n == o \
                and last[0] + last[1] * stride == at:
            last[1] += 1
        else:
            runs.append([at, 1, n, o, stride])
    return tuple((a, k, n, o, st) for a, k, n, o, st in runs)


@by_identity(maxsize=1024)
def a2a_layout(path: str, send_shape: tuple[int, ...], out_shape: tuple[int, ...], split_axis: int,
               split_sizes: tuple[int, ...], concat_axis: int, concat_sizes: tuple[int, ...], itemsize: int,
               variable_from: int, strided_below: int, m: int, me: int) -> A2ALayout:
    """The ``A2ALayout`` of an all-to-all on group rank ``me`` of ``m`` (``variable_from`` and
    ``strided_below``: the backend's ``ALLTOALLV_FROM`` and ``STRIDED_A2A_BELOW``)."""
    route = all_to_all_route(path, send_shape, split_axis, split_sizes, concat_axis, concat_sizes, itemsize,
                             variable_from)
    s_offs, c_offs = offsets(split_sizes), offsets(concat_sizes)
    padded = route is Route.A2A_PADDED
    send_blocks = [with_dim(send_shape, split_axis, n) for n in split_sizes]
    recv_blocks = [with_dim(out_shape, concat_axis, n) for n in concat_sizes]
    send_counts = [prod(b) for b in send_blocks]
    recv_counts = [prod(b) for b in recv_blocks]
    send_at_axis = [(slice(None),) * split_axis + (slice(o, o + n),) for n, o in zip(split_sizes, s_offs)]
    out_at_axis = [(slice(None),) * concat_axis + (slice(o, o + n),) for n, o in zip(concat_sizes, c_offs)]
    own_local = route is Route.A2A_V
    moved_send = [0 if own_local and j == me else n for j, n in enumerate(send_counts)]
    moved_recv = [0 if own_local and j == me else n for j, n in enumerate(recv_counts)]
    # a side whose blocks are already contiguous moves in place, with no copy; a packed side
    # holds only the blocks MPI moves; a small equal-block one is read/written in place through
    # a vector datatype (block j: ``rows`` runs of ``run`` elements, ``stride`` apart)
    s_rows, s_len, s_inner = view3(send_shape, split_axis)
    r_rows, r_len, r_inner = view3(out_shape, concat_axis)
    typed = route is Route.A2A_EQUAL and all_to_all_bytes(
        send_shape, split_axis, split_sizes, concat_axis, concat_sizes, itemsize) < strided_below
    send_vector = (s_rows, split_sizes[0] * s_inner, s_len * s_inner) if typed and s_rows > 1 else None
    recv_vector = (r_rows, concat_sizes[0] * r_inner, r_len * r_inner) if typed and r_rows > 1 else None
    pack_needed = padded or (s_rows > 1 and send_vector is None)
    unpack_needed = padded or (r_rows > 1 and recv_vector is None)
    width = send_counts[0]
    if padded:
        width = global_block(send_shape, split_axis, split_sizes, concat_axis, concat_sizes)
        send_at, recv_at = [j * width for j in range(m)], [j * width for j in range(m)]
    else:
        send_at = offsets(moved_send if pack_needed else send_counts)
        recv_at = offsets(moved_recv if unpack_needed else recv_counts)
    keep = [j for j in range(m) if not (own_local and j == me)]
    return A2ALayout(
        route=route,
        width=width,
        own=(send_at_axis[me], out_at_axis[me]) if own_local else None,
        pack_len=(m * width if padded else sum(moved_send)) if pack_needed else None,
        unpack_len=(m * width if padded else sum(moved_recv)) if unpack_needed else None,
        packs=block_runs([(send_at[j], split_sizes[j], s_offs[j]) for j in keep], s_rows * s_inner,
                    width if padded else None) if pack_needed else (),
        unpacks=block_runs([(recv_at[j], concat_sizes[j], c_offs[j]) for j in keep], r_rows * r_inner,
                      width if padded else None) if unpack_needed else (),
        send3=(s_rows, s_len, s_inner),
        recv3=(r_rows, r_len, r_inner),
        send_spec=(moved_send, send_at),
        recv_spec=(moved_recv, recv_at),
        send_vector=send_vector,
        recv_vector=recv_vector,
    )


class ExchangePlan(NamedTuple):
    """An exchange layout as buffers and ``Alltoallv`` specs (made once per layout)."""

    own: tuple[tuple[slice, ...], tuple[slice, ...]] | None
    pack_len: int
    unpack_len: int
    packs: tuple[tuple[int, int, tuple[slice, ...]], ...]  # (at, stop, send index)
    unpacks: tuple[tuple[int, int, tuple[int, ...], tuple[slice, ...]], ...]  # (at, stop, shape, out index)
    send_spec: tuple[list[int], list[int]]
    recv_spec: tuple[list[int], list[int]]


_EXCHANGE_PLANS: "OrderedDict[int, tuple[Any, ExchangePlan]]" = OrderedDict()


def exchange_plan(layout: Any, m: int) -> ExchangePlan:
    """The buffers and specs of ``layout`` (an ``ExchangeLayout``), cached by the layout object
    (the planner's cache hands out one object per exchange; the entry keeps it alive)."""
    hit = _EXCHANGE_PLANS.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]

    def blocks(entries: Any) -> tuple[list[int], list[int], list[tuple[int, int, tuple[int, ...], tuple[slice, ...]]]]:
        counts, displs, table, at = [0] * m, [0] * m, [], 0
        for peer, ranges in entries:
            shape = tuple(b - a for a, b in ranges)
            n = prod(shape)
            counts[peer], displs[peer] = n, at
            table.append((at, at + n, shape, tuple(slice(a, b) for a, b in ranges)))
            at += n
        return counts, displs, table

    scounts, sdispls, packs = blocks(layout.sends)
    rcounts, rdispls, unpacks = blocks(layout.recvs)
    own = None if layout.own is None else (tuple(slice(a, b) for a, b in layout.own[0]),
                                           tuple(slice(a, b) for a, b in layout.own[1]))
    plan = ExchangePlan(own, sum(scounts), sum(rcounts), tuple((a, b, w) for a, b, _, w in packs), tuple(unpacks),
                         (scounts, sdispls), (rcounts, rdispls))
    _EXCHANGE_PLANS[id(layout)] = (layout, plan)
    if len(_EXCHANGE_PLANS) > 256:
        _EXCHANGE_PLANS.popitem(last=False)
    return plan


def global_block(
    send_shape: tuple[int, ...], split_axis: int, split_sizes: Sequence[int],
    concat_axis: int, concat_sizes: Sequence[int],
) -> int:
    """The largest all-to-all block any rank sends, the same number on every rank."""
    shape = list(send_shape)
    shape[split_axis] = max(split_sizes)
    if concat_axis != split_axis:
        shape[concat_axis] = max(concat_sizes)
    return prod(shape)

