"""The collective deadline: every collective the library starts completes within
``DTORCH_COLLECTIVE_TIMEOUT`` seconds (default 600; ``0`` turns the deadline off) or raises
``CollectiveTimeoutError`` on the ranks waiting (PyTorch's process-group timeout is the anchor).

Collectives are started nonblocking and waited on by polling ``Test``: MPI has no timed wait,
and a blocking call cannot be interrupted. The loop spins (MPICH's own blocking wait spins
too, and nonblocking collectives progress only inside MPI calls); every 16 polls it yields
the CPU (``sched_yield``, so a peer rank sharing the core runs) and reads the clock. With the
deadline off the same loop runs without the clock: the calls MPI sees do not depend on the
setting, and the polled nonblocking forms are as fast as MPICH 5's blocking ones or faster
(``Allgatherv`` 2-3.5x faster at 1-64 MB, far more on a busy machine; ``Alltoallv`` 1.3-1.7x;
docs/performance.md).
"""

from __future__ import annotations

import os
import time
import traceback

from mpi4py import MPI

from .. import settings
from ..errors import CollectiveTimeoutError


def collective_timeout() -> float:
    """Seconds a collective may take (``DTORCH_COLLECTIVE_TIMEOUT``); 0 means no deadline."""
    return settings.get("DTORCH_COLLECTIVE_TIMEOUT")


def set_collective_timeout(seconds: float) -> None:
    """Set the deadline for this process (every rank must set the same)."""
    settings.put("DTORCH_COLLECTIVE_TIMEOUT", float(seconds))


def call_site() -> str:
    """The innermost frame outside dtorch_mpi: where the user started the collective."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not os.path.abspath(frame.filename).startswith(here):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "unknown"


def wait_request(request: MPI.Request, what: str) -> None:
    """Wait until ``request`` completes, or raise ``CollectiveTimeoutError`` naming ``what``."""
    limit = collective_timeout()
    start = time.monotonic()
    polls = 0
    while not request.Test():
        polls += 1
        if polls % 16 == 0:
            os.sched_yield()  # let a peer rank sharing this core run (blocking MPI waits yield too)
            if limit > 0 and time.monotonic() - start > limit:
                raise CollectiveTimeoutError(
                    f"{what} did not complete within DTORCH_COLLECTIVE_TIMEOUT={limit:g}s "
                    f"(started at {call_site()}, rank {MPI.COMM_WORLD.Get_rank()}): some rank of the group "
                    f"did not make the matching call (it failed, hangs, or runs another collective). "
                    f"The communicator is unusable after this; end the job."
                )
