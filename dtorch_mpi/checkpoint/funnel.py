"""The save without MPI in h5py: one writer per node, the nodes in turn.

Plain HDF5 has one writer per file at a time, so the ranks cannot write together. Taking one
turn per rank cost a file open, a write and a world barrier per rank (8 small tensors: 22 ms
at 4 ranks, 512 ms at 32 on one host). Instead each node's lowest rank (its *leader*,
``_mpi.node_id``) writes the pieces of every rank of its node: the others send theirs to it
(a header of slab indices, offsets and shapes, then each piece's bytes, point to point on the
save's communicator); the leader takes the headers, then dataset by dataset receives the
pieces in rank order and writes those that continue each other along dim 0 as one hyperslab
(consecutive ranks' ``Shard(0)`` pieces: one write per dataset and node; it holds at most
about ``RUN_BYTES`` of other ranks' pieces, or one piece if larger). The leaders take turns,
one world barrier between two nodes' turns. Which rank leads each rank's node comes from one
Allgather of ``_mpi.node_id`` that the save makes anyway (it agrees on its errors too). A write
that fails on a leader stops its writes but not its receives (its node's ranks finish their
sends); the caller agrees the error across ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import numpy as np
from mpi4py import MPI

from ..comm.deadline import wait_request

_TAG = 0x2F5A  # the funnel's point-to-point messages (a tag of their own; collectives never match them)
RUN_BYTES = 16 << 20  # a leader joins adjacent pieces into writes of about this size at most

Piece = tuple[Any, Any, Any]  # (offset, shape, data) of one rank's part of one dataset
WritePiece = Callable[[int, Piece], None]  # (slab index, piece) -> written


def send(world: MPI.Intracomm, leader: int, mine: list[tuple[int, Piece]]) -> list[MPI.Request]:
    """Start sending this rank's pieces (slab index, piece) to its node's leader."""
    header = [len(mine)]
    for index, (offset, shape, _) in mine:
        header += [index, *offset, *shape]
    head = np.array(header, dtype=np.int64)
    size = np.array([head.size], dtype=np.int64)
    requests = [world.Isend(size, dest=leader, tag=_TAG), world.Isend(head, dest=leader, tag=_TAG)]
    requests += [world.Isend([np.ascontiguousarray(data), MPI.BYTE], dest=leader, tag=_TAG)
                 for _, (_, _, data) in mine]
    return requests


def _header(world: MPI.Intracomm, member: int, ndims: list[int]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``member``'s list of (slab index, offset, shape), in the order it sends the pieces."""
    what = f"the checkpoint save's pieces from rank {member} (the node's writer receives them)"
    size = np.empty(1, dtype=np.int64)
    wait_request(world.Irecv(size, source=member, tag=_TAG), what)
    head = np.empty(int(size[0]), dtype=np.int64)
    wait_request(world.Irecv(head, source=member, tag=_TAG), what)
    out, at = [], 1
    for _ in range(int(head[0])):
        index = int(head[at])
        nd = ndims[index]
        out.append((index, tuple(int(v) for v in head[at + 1:at + 1 + nd]),
                    tuple(int(v) for v in head[at + 1 + nd:at + 1 + 2 * nd])))
        at += 1 + 2 * nd
    return out


def _adjacent(run: list[Piece], piece: Piece) -> bool:
    """``piece`` continues ``run`` along dim 0 (the same other dims: one hyperslab together)."""
    offset, shape, _ = run[-1]
    return (len(shape) > 0 and tuple(piece[0][1:]) == tuple(offset[1:]) and tuple(piece[1][1:]) == tuple(shape[1:])
            and piece[0][0] == offset[0] + shape[0])


def write_node(world: MPI.Intracomm, members: list[int], mine: list[tuple[int, Piece]], ndims: list[int],
               dtypes: list[np.dtype], write: WritePiece, run_bytes: int = RUN_BYTES) -> Exception | None:
    """On a leader: every member's header first, then dataset by dataset its own piece and its
    members' (received in rank order, each member's in the order it sent them), pieces that
    continue each other along dim 0 written as one hyperslab of at most about ``run_bytes``
    (consecutive ranks' ``Shard(0)`` pieces: one write per dataset and node, not per rank). The
    first error stops the writes, never the receives (so no member is left sending)."""
    error: Exception | None = None

    def put(index: int, run: list[Piece]) -> None:
        nonlocal error
        if error is None and run:
            try:  # (joining the run too: a MemoryError must not leave the members sending)
                if len(run) == 1:
                    write(index, run[0])
                else:  # row-adjacent pieces (``_adjacent``: never 0-d): one hyperslab
                    offset, shape, _ = run[0]
                    rows = sum(p[1][0] for p in run)
                    write(index, (offset, (rows, *shape[1:]), np.concatenate([p[2] for p in run])))
            except Exception as exc:
                error = exc

    heads = {member: _header(world, member, ndims) for member in members}
    sources: dict[int, list[tuple[int, Any]]] = {}
    for index, piece in mine:
        sources.setdefault(index, []).append((-1, piece))
    for member in members:
        for index, offset, shape in heads[member]:
            sources.setdefault(index, []).append((member, (offset, shape)))
    for index in sorted(sources):
        run: list[Piece] = []
        for member, got in sources[index]:
            if member < 0:
                piece = got
            else:
                data = np.empty(got[1], dtype=dtypes[index])
                wait_request(world.Irecv([data, MPI.BYTE], source=member, tag=_TAG),
                             f"the checkpoint save's pieces from rank {member} (the node's writer receives them)")
                piece = (got[0], got[1], data)
            if not prod(piece[1]):
                continue
            if run and (not _adjacent(run, piece) or sum(p[2].nbytes for p in run) >= run_bytes):
                put(index, run)
                run = []
            run.append(piece)
        put(index, run)
    return error
