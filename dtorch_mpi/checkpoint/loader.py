"""Loading HDF5 checkpoints: validation, matching against the target, verified reads, install.

The file is untrusted (validate.py); everything is checked against the target before anything is
read, and every dataset is verified against its checksum before anything is installed
(reader.py). See hdf5.py for the file layout. A load first waits for this process's pending
asynchronous save (writer.py), then holds h5lib.LOCK while it uses h5py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, cast

from mpi4py import MPI

from .._mpi import library_world
from ..errors import CheckpointError
from ..spmd import agreed
from . import targets, validate
from .checksum import require_hasher
from .h5lib import LOCK, has_parallel_hdf5
from .h5lib import h5py as _h5py
from .reader import STAGING, own_checks, read_verified
from .writer import _same_everywhere, wait_pending


def load(path: str | os.PathLike, target: Any, *, strict: bool = True, staging: str = "all") -> Any:
    """Load a checkpoint into ``target`` in place and return it.

    ``target``: a Module, an Optimizer, a DTensor, or a mapping (nested like the saved object)
    of these, e.g. ``{"model": model, "optim": optimizer, "step": 0}``; any other value of a
    mutable mapping (``"step": 0``) is replaced by the stored value (Python scalars with their
    exact types; complete NumPy arrays for tensors). Modules and DTensors keep their current
    placements and mesh (resharding: each rank reads only its own hyperslab); an Optimizer gets
    the saved hyperparameters and scalar state, and its moments take their parameters' current
    placements. ``strict=False`` loads what both sides have.

    The file is validated (no links, external or virtual storage, filters, oversized chunks or
    malformed scalar metadata), everything is checked against the target before anything is
    read, and every dataset is verified against its checksum before anything is installed.
    Every rank raises ``CheckpointError`` (or the load's own error type) when any rank fails;
    the target is then unchanged.

    ``staging="all"`` (default) holds every piece read until all are verified (peak: one extra
    copy of this rank's share of the target); ``staging="chunks"`` reads twice instead and needs
    one chunk (at most one tensor's piece) extra. See reader.py.
    """
    wait_pending()  # the file may be the one a pending asynchronous save is writing
    with LOCK:  # one thread inside h5py at a time (h5lib.py)
        return _load(path, target, strict, staging)


def _load(path: str | os.PathLike, target: Any, strict: bool, staging: str) -> Any:
    from ..stateful import check_fill as _check

    world = library_world()
    path = os.path.abspath(os.fspath(path))
    handle = None
    try:
        with agreed(world):
            h5py = _h5py()  # h5py and xxhash on every rank (some may have nothing to hash)
            require_hasher()
            found = targets.parts(target)  # what cannot be loaded into raises on every rank
        with agreed(world):  # apart: a rank that failed above must not meet the others' comparison
            _same_everywhere(world, {"paths": ("path", path), "staging options": ("staging", repr(staging))})
            if staging not in STAGING:
                raise CheckpointError(f"load(staging={staging!r}): use one of {', '.join(STAGING)}")
            _check_openable(h5py, path, world)
        try:
            failed: Exception | None = None
            handle = _open(h5py, world, path)
        except Exception as exc:  # agreed below, with the validation
            failed = exc
        # one agreement for the open (collective with MPI-IO) and the validation; h5py's raw errors
        # on damaged metadata become a CheckpointError naming the file
        with agreed(world), validate.damaged(path):
            if failed is not None:
                raise failed
            version = validate.check_header(handle, path)
            listing = validate.scan(handle, path, legacy=version < 3)
            validate.check_layout(handle, listing, path, version)
            restore = targets.match(found, listing, path, strict)
            keys = _check(cast(Mapping[str, Any], restore.tensors),
                          {k: listing.tensors[k].dataset for k in restore.tensors}, strict=False)
            mine = own_checks(restore.tensors, listing.tensors, keys)
        try:
            read_verified(restore.tensors, listing.tensors, keys, path, staging, mine)
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path}: reading failed ({exc}); the file is damaged") from exc
        for commit in restore.commits:
            commit()
    finally:
        if handle is not None:
            handle.close()
    return target


def _check_openable(h5py: Any, path: str, world: MPI.Intracomm) -> None:
    """The file exists and is HDF5; before a collective MPI-IO open, rank 0 also opens it alone
    (agreed by the caller): HDF5's collective open hangs on some damaged superblocks (an error
    on one rank, the others waiting in its broadcast), where a serial open just fails."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    if not h5py.is_hdf5(path):
        raise CheckpointError(f"{path} is not an HDF5 file (truncated, corrupt or another format)")
    if has_parallel_hdf5() and world.Get_size() > 1 and world.Get_rank() == 0:
        try:
            h5py.File(path, "r").close()
        except Exception as exc:
            raise CheckpointError(f"{path} cannot be opened as HDF5: {exc}") from exc


def _open(h5py: Any, world: MPI.Intracomm, path: str) -> Any:
    """Open read-only (collectively with MPI-IO when h5py has it); every rank checked the path first."""
    try:
        if has_parallel_hdf5() and world.Get_size() > 1:
            return h5py.File(path, "r", driver="mpio", comm=world)
        return h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be opened as HDF5: {exc}") from exc
