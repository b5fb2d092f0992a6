"""The divergence check (SPEC 5): ranks that make different collective calls get an error,
never each other's wrong data.

Every communicator the library moves data on (a mesh's, built in ``DeviceMesh``) gets a twin
(:func:`attach`: a ``Dup`` made collectively where the mesh builds it) that carries nothing but
checks, so a check can never be matched with data traffic. The prologue counts every collective
it starts on a communicator (``seq``), and before a collective it compares a fingerprint of the
call across the group: the sequence number, kind, group-wide shape, dtype, op, sizes, the
backend's own call, and what the caller adds (:func:`call_context`: a packed bucket's ordered
parameters, ``clip_grad_norm_``'s norm type). One ``Iallreduce`` of two int64 (the least ``h``
and the least ``-h``) on the twin, bounded by the collective deadline: equal on every rank, or
every rank exchanges the calls' texts (only then) and raises ``SPMDDivergenceError`` naming each
rank's call.

When it runs: in debug mode (``DTORCH_SPMD_DEBUG=1``) before every collective, the fingerprint
then also holding the user's call site (:func:`user_site`); by default before every collective
whose group-wide payload (the whole tensor's bytes, computed by the prologue from the call's
group-wide facts, so every rank making the same call decides alike; at least what any rank
sends or receives as one buffer) is :data:`CHECK_FROM` or more, on a communicator with a twin. A divergent call in which some rank moves
that much is then checked on that rank, which therefore never moves data before a rank made a
check with the same fingerprint at the same position: either the others' calls fingerprint
alike, or they raise with it, or (a side that made no checked call) the checking rank waits for
a check that never comes and raises ``CollectiveTimeoutError`` at the deadline, while the other
side's data call waits for a data call that never comes. Below the threshold on every rank the
default adds only the count. ``DTORCH_SPMD_CHECK=0`` turns the default check off (for a
benchmark of its cost; debug mode still checks).

Not caught by any metadata check: a call identical in every fingerprinted fact (a different
tensor of the same shape, dtype and layout, or parameters of equal shapes swapped in a bucket).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from .deadline import wait_request
from .group import Group

CHECK_FROM = 64 << 10
"""Group-wide bytes from which the default check runs (SPEC 5: 64 KiB)."""


class Twin:
    """A communicator's check twin and the count of collectives started on the original."""

    __slots__ = ("comm", "seq")

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.seq = 0


_TWINS: dict[int, Twin] = {}
"""By ``id`` of the library's communicator object (the mesh holds it, and detaches it at free)."""

_context: Callable[[], str] | None = None


def attach(comm: MPI.Intracomm) -> None:
    """Give ``comm`` its check twin (collective over ``comm``; a group of one needs none)."""
    if comm != MPI.COMM_NULL and comm.Get_size() > 1:
        _TWINS[id(comm)] = Twin(comm.Dup())


def detach(comm: MPI.Intracomm) -> None:
    """Free ``comm``'s twin (collective, where the mesh frees ``comm``)."""
    twin = _TWINS.pop(id(comm), None)
    if twin is not None:
        twin.comm.Free()


def twin_of(comm: MPI.Intracomm) -> Twin | None:
    return _TWINS.get(id(comm))


@contextmanager
def call_context(describe: Callable[[], str]) -> Iterator[None]:
    """The collectives started inside carry ``describe()`` in their fingerprint (evaluated only
    when a check runs): what the call means beyond its shapes (a bucket's parameters)."""
    global _context
    outer, _context = _context, describe
    try:
        yield
    finally:
        _context = outer


def current_context() -> str:
    return "" if _context is None else f" [{_context()}]"


_LIBRARY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_site() -> str:
    """The innermost frame outside dtorch_mpi as ``file:line`` (the file's name only: the same
    program may sit in different directories on different nodes). Debug mode compares it too,
    so a rank skipping a call before an identical one is caught."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "unknown"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


_CODES: dict[str, int] = {}


def code(text: str) -> int:
    """A digest of ``text`` equal on every rank (``hash`` of a string is salted per process),
    cached: the kinds, dtypes, ops and call sites a program uses are few."""
    value = _CODES.get(text)
    if value is None:
        value = _CODES[text] = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        if len(_CODES) > 4096:
            _CODES.clear()
    return value


def fingerprint(parts: tuple[object, ...]) -> int:
    """``parts`` (ints, tuples of ints, strings) as one int64, equal on every rank for equal parts:
    the strings as :func:`code`, then Python's ``hash`` of the tuple (deterministic for ints and
    tuples of them, on every rank running one interpreter version; the mesh agrees settings)."""
    return hash(tuple(code(p) if isinstance(p, str) else p for p in parts)) >> 1


_MINE = np.empty(2, dtype=np.int64)
_LOW = np.empty(2, dtype=np.int64)  # reused: a check is waited before the next one starts


def compare(group: Group, comm: MPI.Intracomm, fp: int, describe: Callable[[], str]) -> None:
    """Every rank of ``group`` makes the call fingerprinted ``fp`` (checked on ``comm``, the
    twin), or every rank raises ``SPMDDivergenceError`` naming each rank's call (``describe()``,
    built only then)."""
    _MINE[0] = fp
    _MINE[1] = -fp
    wait_request(comm.Iallreduce(_MINE, _LOW, op=MPI.MIN), "the SPMD divergence check (Allreduce)")
    if _LOW[0] == -_LOW[1]:
        return
    from ..errors import SPMDDivergenceError
    from ..spmd import _allgather_bytes

    calls = [r.decode(errors="replace") for r in _allgather_bytes(comm, describe().encode())]
    dim = "" if group.mesh_dim is None else f" along mesh dim {group.mesh_dim}"
    raise SPMDDivergenceError(
        f"SPMD divergence{dim}: the ranks of one group are making different collective calls:\n"
        + "\n".join(f"  group rank {r}: {c}" for r, c in enumerate(calls))
        + "\nEvery rank must run the same sequence of collective operations (#n: the call's number "
        "on its communicator; checked by default from 64 KiB, every call with DTORCH_SPMD_DEBUG=1)."
    )
