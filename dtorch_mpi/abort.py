"""Abort on exception: an uncaught exception on one rank ends the whole MPI job within seconds.

A rank that dies while the others wait in a collective leaves them hanging (until the
collective deadline, or forever). ``python -m mpi4py script.py`` answers this with
``MPI_Abort``; this module does the same for a plain ``python script.py``: a ``sys.excepthook``
(and ``threading.excepthook``) wrapper prints which rank failed, lets the previous hook print
the traceback, flushes, then calls ``MPI.COMM_WORLD.Abort(1)``, which the MPI launcher turns
into the end of every rank of the job.

Explicit rather than an import-time side effect: the first ``DeviceMesh`` construction calls
:func:`install` (a program that builds no mesh is left alone), and only when the world has
more than one rank and the session is not interactive. ``DTORCH_ABORT_ON_EXCEPTION=0`` opts
out. pytest catches test exceptions itself, so the hook never fires inside a test.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import Any

from mpi4py import MPI

from . import settings

ENV = "DTORCH_ABORT_ON_EXCEPTION"

_installed = False
_FORWARD_GRACE_S = 0.2


def enabled() -> bool:
    """On unless ``DTORCH_ABORT_ON_EXCEPTION`` is ``0``/``false``/``no``/``off``."""
    return bool(settings.get(ENV))


def installed() -> bool:
    return _installed


def install() -> bool:
    """Install the hooks once (idempotent); returns whether they are installed."""
    global _installed
    if _installed:
        return True
    interactive = hasattr(sys, "ps1") or bool(sys.flags.interactive)
    if not enabled() or interactive or MPI.COMM_WORLD.Get_size() == 1:
        return False
    previous_sys, previous_thread = sys.excepthook, threading.excepthook

    def sys_hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _abort(kind.__name__, "", lambda: previous_sys(kind, value, tb))

    def thread_hook(args: Any) -> None:
        name = args.thread.name if args.thread is not None else "a thread"
        _abort(args.exc_type.__name__, f" in thread {name!r}", lambda: previous_thread(args))

    sys.excepthook = sys_hook
    threading.excepthook = thread_hook
    _installed = True
    return True


def _abort(kind: str, where: str, print_traceback: Any) -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    try:
        sys.stderr.write(
            f"dtorch_mpi: uncaught {kind}{where} on rank {rank} of {size}; aborting the whole job "
            f"with MPI_Abort so that no rank waits forever ({ENV}=0 disables this)\n"
        )
        print_traceback()
        sys.stderr.flush()
        sys.stdout.flush()
        # give the launcher a moment to forward what was just printed: MPI_Abort tears down
        # its output forwarding, and under load the traceback was sometimes lost
        time.sleep(_FORWARD_GRACE_S)
    finally:
        world.Abort(1)
