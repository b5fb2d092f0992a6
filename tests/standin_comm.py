"""A stand-in communicator for simulated-scale checks (issue 27 item 1): the mpi4py methods
the MPI backend calls, on a group of any size, moving no data. ``calls`` counts each method."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np


class DoneRequest:
    """A request that has already completed."""

    def Test(self) -> bool:
        return True

    def Wait(self) -> None:
        return None

    def Cancel(self) -> None:
        return None


_DONE = DoneRequest()
_METHODS = ("Iallgather", "Iallgatherv", "Ialltoall", "Ialltoallv", "Ialltoallw", "Iallreduce",
            "Ireduce_scatter", "Ireduce_scatter_block", "Ibcast", "Iscatter", "Iscatterv")


class StandInComm:
    """``Get_size() == size``; every ``I`` collective returns a completed request at once.
    ``mirror=True``: as if every rank held this rank's values, an ``Iallreduce`` of MIN/MAX
    writes the send buffer into the receive buffer (``sizes`` records each call's elements)."""

    def __init__(self, size: int, rank: int = 0, mirror: bool = False) -> None:
        self.size, self.rank, self.mirror = size, rank, mirror
        self.calls: Counter[str] = Counter()
        self.sizes: list[tuple[str, int]] = []

    def Iallreduce(self, send: Any, recv: Any, op: Any = None) -> DoneRequest:
        self.calls["Iallreduce"] += 1
        buffer = send[0] if isinstance(send, list) else send  # mpi4py's [buffer, datatype] form
        self.sizes.append(("Iallreduce", int(buffer.size)))
        if self.mirror:
            np.copyto(recv, send)
        return _DONE

    def Get_size(self) -> int:
        return self.size

    def Get_rank(self) -> int:
        return self.rank

    def __getattr__(self, name: str) -> Any:
        if name not in _METHODS:
            raise AttributeError(name)

        def start(*args: Any, **kwargs: Any) -> DoneRequest:
            self.calls[name] += 1
            return _DONE

        return start
