"""UCX's rendezvous threshold, lowered where only TCP carries messages between hosts.

MPICH's ch4:ucx device (and Open MPI's UCX layer) send a message over TCP in one of two ways.
Up to UCX's rendezvous threshold, which it sets by itself to ~3 MB over TCP, a message goes
"multi-frag eager": 64 KiB fragments, each of which the receiver takes in only when a call into
MPI polls the socket. Above it, the receiver is told where the data goes and the data streams
in. A blocking call polls all the time, so the two cost the same there. A collective that runs
beside compute is polled only every so often, by the progress thread (comm/progress.py). Then a
2 MB message waits for ~30 polls and takes 3x as long. Raw mpi4py between two fake hosts,
polled every 50 µs (scripts/bench_polled.py): a 2 MB exchange took 6.1-6.2 ms (1.7-1.8
blocking), and 2.1-2.4 with the threshold at 256 KiB; a 2 MB all-reduce took 6.4-6.9 ms, and
3.2-3.3. Messages of 8 MB and more, rendezvous either way, kept their times. Blocking calls
moved by no more than noise. Raising the fragment size (``UCX_TCP_RX_SEG_SIZE``) instead
helped 2 MB too, but it raises UCX's own threshold with it: a polled 24 MB all-reduce went from
24 to 38 ms (docs/performance.md, "Polled transfers between hosts").

So, at import, the library sets ``UCX_RNDV_THRESH`` (``DTORCH_UCX_RNDV_THRESH``, default
256 KiB, the threshold UCX itself picks over TCP for sends marked to complete fast), before
MPI starts and reads it. It is left alone:

- where the process chose (``UCX_RNDV_THRESH`` set);
- where the host has an RDMA device (``/sys/class/infiniband``: InfiniBand, RoCE, EFA,
  Omni-Path). There UCX's own threshold is tuned for the device, and a single setting would
  also apply to it;
- where MPI started before this package was imported (``from mpi4py import MPI`` first):
  UCX has read its configuration by then. Import ``dtorch_mpi`` first, or set the variable
  in the launch (``mpiexec -genv UCX_RNDV_THRESH 256k``);
- with ``DTORCH_UCX_RNDV_THRESH=off``.

Within one host MPICH's own shared memory carries the messages, not UCX, so without an RDMA
device this changes only the messages sent between hosts over TCP. The variable is inert where
the MPI does not use UCX (MPICH's ofi device; Open MPI without UCX).

The variable is set in ``os.environ``, so programs this process starts inherit it, as they
would a value set in the launch.

This module must be imported before anything imports ``mpi4py.MPI``: ``dtorch_mpi/__init__.py``
imports it first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from . import settings

VARIABLE = "UCX_RNDV_THRESH"
RDMA_DEVICES = "/sys/class/infiniband"

state = "not yet"
"""What :func:`choose` did: ``set`` (``UCX_RNDV_THRESH`` now holds the setting's value),
``off`` (not asked for), ``the process's own`` (the variable was set), ``RDMA device``,
or ``MPI already started``."""


def _has_rdma_device(path: str = RDMA_DEVICES) -> bool:
    try:
        return bool(os.listdir(path))
    except OSError:  # no such class: no RDMA stack at all
        return False


def choose(environ: MutableMapping[str, str] = os.environ, *, rdma_devices: str = RDMA_DEVICES,
           mpi_started: bool | None = None) -> str:
    """Set ``UCX_RNDV_THRESH`` in ``environ`` unless one of the module docstring's cases
    leaves it alone; what was done (also kept in :data:`state`)."""
    global state
    threshold = settings.get("DTORCH_UCX_RNDV_THRESH")
    if mpi_started is None:
        mpi_started = "mpi4py.MPI" in sys.modules
    if threshold is None:
        state = "off"
    elif VARIABLE in environ:
        state = "the process's own"
    elif mpi_started:
        state = "MPI already started"
    elif _has_rdma_device(rdma_devices):
        state = "RDMA device"
    else:
        environ[VARIABLE] = threshold
        state = "set"
    return state


choose()
