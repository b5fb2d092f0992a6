"""h5py as the checkpoint modules use it: the import, its MPI build, one process-wide lock.

HDF5 is not thread-safe (a build without ``--enable-threadsafe`` is the rule), and an
asynchronous save writes from a background thread: every h5py use in checkpoint/ holds
``LOCK``, so only one thread of the process is ever inside h5py.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..errors import CheckpointError

LOCK = threading.RLock()


def h5py() -> Any:
    try:
        import h5py as module
    except ImportError as exc:  # pragma: no cover - h5py is a test dependency
        raise CheckpointError("checkpoints need h5py: pip install h5py") from exc
    return module


def has_parallel_hdf5() -> bool:
    """True when h5py was built with MPI (``driver="mpio"`` available)."""
    return bool(h5py().get_config().mpi)


def group_path(name: str) -> str:
    return "/" + name.replace(".", "/")


def fixed(text: str) -> np.bytes_:
    """A fixed-length string attribute (h5py writes a ``str`` variable-length, in the global heap)."""
    return np.bytes_(text.encode("utf-8"))
