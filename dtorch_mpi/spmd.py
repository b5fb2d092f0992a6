"""SPMD agreement: a check that one rank fails makes every rank raise the same error.

Errors travel as UTF-8 bytes in buffer collectives (no pickles). The rules, each named once:
- ``agreed(comm)`` / ``agree(comm, error)``: a check whose outcome can differ between ranks;
  ``agreed_min`` / ``agreed_allgather``: the same agreement carried by a collective that the
  caller needs anyway (one collective instead of two where no rank failed);
- ``require_same(comm, values, ...)``: every rank holds the same values (one small Allreduce
  of fingerprints, carrying the caller's own status too);
- ``raise_divergence``: the slow path that names each rank's value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NoReturn

import numpy as np
from mpi4py import MPI

from .comm.deadline import allgather_bytes, wait_request
from .errors import ERROR_TYPES, DTensorError, SPMDDivergenceError

MAX_NDIM = 32
"""The most tensor dims a metadata record carries (from_local, distribute_tensor)."""

SHOWN = 4
"""The most ranks an agreed error names one by one (the rest are counted: issue 27 item 7)."""


def _some_ranks(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 0, 1, 2, 3 and 12 more`` (a few named, the rest counted)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    named = ", ".join(map(str, ranks[:SHOWN]))
    return f"ranks {named}" + (f" and {len(ranks) - SHOWN} more" if len(ranks) > SHOWN else "")


def agree(comm: MPI.Intracomm | None, error: BaseException | None) -> None:
    """Collectively combine each rank's optional error; raise on every rank if any failed.

    The raised type is the lowest failing rank's (when it is a known error type); the message
    names the failing ranks and what each reported.
    """
    if comm is None or comm == MPI.COMM_NULL or comm.Get_size() == 1:
        if error is not None:
            raise error
        return
    flag = np.array([1 if error is not None else 0], dtype=np.int32)
    any_failed = np.zeros(1, dtype=np.int32)
    wait_request(comm.Iallreduce(flag, any_failed, op=MPI.MAX), "the library's error agreement (Allreduce)")
    if not any_failed[0]:
        return
    payload = b""
    if error is not None:
        payload = f"{type(error).__name__}\0{error}".encode("utf-8", "replace")
    reports = allgather_bytes(comm, payload)
    failures = [(rank, rep.decode("utf-8", "replace")) for rank, rep in enumerate(reports) if rep]
    kinds = [f.split("\0", 1) for _, f in failures]
    cls = ERROR_TYPES.get(kinds[0][0], DTensorError)
    messages = {msg for _, msg in kinds}
    ranks = [rank for rank, _ in failures]
    if len(messages) == 1:
        text = f"{kinds[0][1]} [on {_some_ranks(ranks)}]"
    else:
        text = "; ".join(f"rank {rank}: {msg}" for rank, (_, msg) in zip(ranks[:SHOWN], kinds))
        if len(ranks) > SHOWN:
            text += f"; and {len(ranks) - SHOWN} more of the {len(ranks)} failing ranks"
    if error is not None and type(error) is cls and str(error) == text:
        raise error
    raise cls(text) from error


def agreed_min(comm: MPI.Intracomm | None, problem: BaseException | None, values: Sequence[int]) -> np.ndarray:
    """:func:`agree` on ``problem`` and the element-wise least of ``values`` over the ranks, in one
    Allreduce (MIN) where none failed. Where some rank failed, every rank raises as ``agree``
    does (``values`` then may be placeholders of the same length). A value one rank chooses for
    all, such as a random name from rank 0, travels as that rank's value with every other rank
    giving ``INT64_MAX``."""
    mine = np.array([-1 if problem is not None else 0, *values], dtype=np.int64)
    if comm is None or comm == MPI.COMM_NULL or comm.Get_size() == 1:
        agree(comm, problem)
        return mine[1:]
    low = np.empty_like(mine)
    wait_request(comm.Iallreduce(mine, low, op=MPI.MIN), "the library's error agreement (Allreduce)")
    if low[0]:
        agree(comm, problem)
    return low[1:]


def agreed_allgather(comm: MPI.Intracomm, problem: BaseException | None, value: int) -> np.ndarray:
    """:func:`agree` on ``problem`` and every rank's ``value`` (an int64 per rank, in rank order),
    in one Allgather where none failed; where some rank failed, every rank raises as ``agree`` does."""
    mine = np.array([1 if problem is not None else 0, value], dtype=np.int64)
    every = np.empty((comm.Get_size(), 2), dtype=np.int64)
    wait_request(comm.Iallgather(mine, every), "the library's error agreement (Allgather)")
    if every[:, 0].any():
        agree(comm, problem)
    return every[:, 1].copy()


@contextmanager
def agreed(comm: MPI.Intracomm | None) -> Iterator[None]:
    """Run the body; agree on its outcome across ``comm``; every rank raises if any failed."""
    try:
        yield
    except Exception as exc:
        agree(comm, exc)
        raise
    agree(comm, None)


def fingerprint(value: object) -> int:
    """A 62-bit digest of ``repr(value)``: how ranks compare values in an integer collective."""
    digest = hashlib.blake2b(repr(value).encode("utf-8", "replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def raise_divergence(comm: MPI.Intracomm, values: Mapping[str, object], what: str,
                     error: type[Exception] = SPMDDivergenceError) -> NoReturn:
    """Every rank calls this once all know that ``values`` differ between ranks: one exchange of
    their texts (a string as it is, anything else as its repr; each cut at 200 characters),
    then ``error`` naming each rank's value."""
    mine = "\0".join((v if isinstance(v, str) else repr(v))[:200] for v in values.values())
    code = np.array([fingerprint(mine)], dtype=np.int64)  # O(1) per rank: which ranks hold which values
    codes = np.empty(comm.Get_size(), dtype=np.int64)
    wait_request(comm.Iallgather(code, codes), "the library's divergence report (Allgather)")
    distinct, first = np.unique(codes, return_index=True)
    shown = sorted(first.tolist())[:SHOWN]  # the first rank holding each of a few distinct values
    speaks = comm.Get_rank() in shown
    reports = allgather_bytes(comm, mine.encode() if speaks else b"")
    texts = {r: reports[r].decode("utf-8", "replace").split("\0") for r in shown}
    more = "" if len(codes) == len(shown) else \
        f" (the other {len(codes) - len(shown)} of {len(codes)} ranks each hold " + \
        ("one of these" if len(distinct) <= SHOWN else f"one of {len(distinct)} distinct values") + ")"
    parts = [f"{name}: " + "; ".join(f"rank {r}: {texts[r][i]}" for r in shown) + more
             for i, name in enumerate(values)]
    raise error(
        f"{what}: ranks disagree on " + " | ".join(parts)
        + ". Every rank must make the same call with the same arguments"
    )


def require_same(comm: MPI.Intracomm | None, values: Mapping[str, object], *, what: str | Mapping[str, str],
                 error: type[Exception] = SPMDDivergenceError,
                 problem: BaseException | None = None) -> None:
    """Every rank of ``comm`` holds the same ``values``, or ``error`` is raised on every rank.

    One Allreduce of ``[status, fingerprints...]`` and their negatives (``MIN`` gives the least
    and, negated, the greatest of each: equal means every rank agrees). ``problem``, this
    rank's own failure before the check, is agreed first (see :func:`agree`). ``what`` names
    the call; a mapping (value name -> text) names each value's own error instead, and the
    first value that differs raises alone (several unrelated arguments in one collective).
    """
    if comm is None or comm == MPI.COMM_NULL or comm.Get_size() == 1:
        if problem is not None:
            raise problem
        return
    mine = np.array([1 if problem is not None else 0, *(fingerprint(v) for v in values.values())],
                    dtype=np.int64)
    low = np.empty(2 * mine.size, dtype=np.int64)
    both = np.concatenate([mine, -mine])
    label = what if isinstance(what, str) else ", ".join(what.values())
    wait_request(comm.Iallreduce(both, low, op=MPI.MIN), f"the library's agreement check for {label} (Allreduce)")
    if low[mine.size] != 0:  # -max(status): some rank failed
        agree(comm, problem)
    differ = [name for i, name in enumerate(values, 1) if low[i] != -low[mine.size + i]]
    if differ:
        if not isinstance(what, str):
            what, differ = what[differ[0]], differ[:1]
        raise_divergence(comm, {name: values[name] for name in differ}, what, error)


