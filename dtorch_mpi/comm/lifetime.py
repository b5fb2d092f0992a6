"""Resources that live exactly as long as an MPI communicator (MPI's attribute caching).

A resource built for a communicator (an NCCL communicator for a mesh dim's group) must never
be handed to another one. Keying a dictionary by the communicator's handle is wrong: MPICH
reuses a handle after ``Free()``, so a new mesh would receive a freed mesh's resource. MPI's
own answer is an attribute on the communicator: ``Set_attr`` stores it, ``Free()`` deletes it
(calling our ``release``), and a new communicator starts with none, whatever its handle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar, cast

from mpi4py import MPI

T = TypeVar("T")


class CommAttached(Generic[T]):
    """One kind of per-communicator resource: ``get(comm, make)`` returns the resource this
    communicator holds, making it on first use; freeing the communicator releases it."""

    def __init__(self, what: str, release: Callable[[T], None]) -> None:
        self.what = what
        self._release = release
        self._keyval: int | None = None  # made on first use (local, not collective)

    def _key(self) -> int:
        if self._keyval is None:
            self._keyval = MPI.Comm.Create_keyval(delete_fn=self._deleted)
        return self._keyval

    def _deleted(self, comm: MPI.Comm, keyval: int, value: T) -> None:
        """Called by MPI when the communicator is freed (must not raise into MPI)."""
        try:
            self._release(value)
        except Exception as exc:  # pragma: no cover - a failing release must not abort MPI_Comm_free
            import warnings

            warnings.warn(f"releasing {self.what} failed: {exc!r}", RuntimeWarning, stacklevel=1)

    def get(self, comm: MPI.Comm, make: Callable[[], T]) -> T:
        """The resource attached to ``comm``; ``make()`` builds it on first use (collective
        over ``comm`` when ``make`` is: every rank of the group reaches this together)."""
        key = self._key()
        value = comm.Get_attr(key)
        if value is None:
            value = make()
            comm.Set_attr(key, value)
        return cast(T, value)
