"""SPMD agreement: a check that one rank fails makes every rank raise the same error.

Errors travel as UTF-8 bytes in buffer collectives (no pickles). Use ``agreed(comm)`` as a
context manager around any check whose outcome can differ between ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from .errors import ERROR_TYPES, DTensorError


def _allgather_bytes(comm: MPI.Intracomm, payload: bytes) -> list[bytes]:
    lengths = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([len(payload)], dtype=np.int64), lengths)
    displs = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    comm.Allgatherv(
        np.frombuffer(payload, dtype=np.uint8) if payload else np.empty(0, np.uint8),
        [out, (lengths.tolist(), displs.tolist()), MPI.BYTE],
    )
    raw = out.tobytes()
    return [raw[int(s) : int(s) + int(n)] for s, n in zip(displs, lengths)]


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
    comm.Allreduce(flag, any_failed, op=MPI.MAX)
    if not any_failed[0]:
        return
    payload = b""
    if error is not None:
        payload = f"{type(error).__name__}\0{error}".encode("utf-8", "replace")
    reports = _allgather_bytes(comm, payload)
    failures = [(rank, rep.decode("utf-8", "replace")) for rank, rep in enumerate(reports) if rep]
    kinds = [f.split("\0", 1) for _, f in failures]
    cls = ERROR_TYPES.get(kinds[0][0], DTensorError)
    messages = {msg for _, msg in kinds}
    ranks = [rank for rank, _ in failures]
    if len(messages) == 1:
        text = f"{kinds[0][1]} [on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}]"
    else:
        text = "; ".join(f"rank {rank}: {msg}" for rank, (_, msg) in zip(ranks, kinds))
    if error is not None and type(error) is cls and str(error) == text:
        raise error
    raise cls(text) from error


@contextmanager
def agreed(comm: MPI.Intracomm | None) -> Iterator[None]:
    """Run the body; agree on its outcome across ``comm``; every rank raises if any failed."""
    try:
        yield
    except Exception as exc:
        agree(comm, exc)
        raise
    agree(comm, None)
