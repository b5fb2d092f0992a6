"""The backend contract (what every collective backend provides) and the one registry of
backends, which hands each out wrapped in the shared prologue (comm/prologue.py).
docs/backends.md explains the contract and how to add a backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .group import Group
from .prologue import Prologued


class Handle(Protocol):
    """A started collective. ``wait()`` returns the result (the ``out`` buffer, or a view with
    the same shape and values) and may be called more than once; ``done()`` tests without
    blocking. Neither ever starts another collective. A handle that is dropped unwaited must
    still leave every buffer alive until the transfer has ended (see comm/work.py)."""

    def done(self) -> bool: ...

    def wait(self) -> Any: ...


class Backend(Protocol):
    """Collectives over one mesh dim's group (``group.comm``, ``group.size``, ``group.rank``).

    Contract, for every method:
    - Buffers: ``send``/``buf`` and ``out`` are arrays of the mesh's array library (NumPy for
      ``"cpu"``, CuPy for ``"cuda"``), ``out`` allocated by the caller with its final shape and
      dtype; ``send`` may be non-contiguous and must not be modified.
    - Sizes: ``sizes``/``split_sizes``/``concat_sizes`` hold every rank's block length along
      the axis (the uneven split rule), the same list on every rank; blocks may be empty.
    - Padding: a backend needing equal-size buffers pads and unpads inside; callers never see it.
    - SPMD: every MPI (or NCCL) call made must be a function of the arguments above, which are
      the same on every rank of the group (never of this rank's own counts alone), so that
      every rank makes the same call; comm/routes.py is the MPI backend's route choice.
    - ``async_op=True`` returns a handle whose transfer proceeds while the caller works; the
      result is only read after ``wait()``. ``async_op=False`` returns a finished handle.
    - Prologue: ``backend_named`` wraps every backend in ``prologue.Prologued``, which does
      for each call what is common to all backends (start-order hook, SPMD debug check,
      the group-of-one and all-empty shortcuts, ``counter.record``, waiting a blocking call
      under the deadline). A method is therefore entered only for a group of two or more
      ranks with something to move, and with ``async_op=False`` may return an unfinished
      handle (the prologue waits on it).
    - ``overlaps_check`` (optional class attribute, default False): the default divergence
      check may overlap a blocking call's data (comm/divergence.py); the backend then waits
      for its request through ``deadline.wait_request`` (``work.waited``), abandoning it when
      the wait raises, and gets ``group`` on the communicator's data twin for such calls.
    """

    name: str

    def call_for(self, kind: str, send: Any, out: Any, facts: dict[str, Any]) -> tuple[str, bool]:
        """``(the call this backend makes, whether it pads)`` for collective ``kind`` (a method
        name) with ``send``/``out`` and the group-wide ``facts`` (its other arguments by name:
        ``axis sizes``, ``split concat split_sizes concat_sizes``, ``op``, ``root``). Named in
        the SPMD debug check and the ``CommCounter`` record; a function of group-wide facts."""
        ...

    def all_gather(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int],
                   async_op: bool = False) -> Handle:
        """Concatenate every rank's ``send`` (``sizes[i]`` long on ``axis``) into ``out``."""
        ...

    def all_to_all(self, group: Group, send: Any, out: Any, split_axis: int, split_sizes: Sequence[int],
                   concat_axis: int, concat_sizes: Sequence[int], async_op: bool = False) -> Handle:
        """Block ``j`` of ``send`` along ``split_axis`` goes to rank ``j``; the block from rank
        ``j`` fills block ``j`` of ``out`` along ``concat_axis``."""
        ...

    def all_reduce(self, group: Group, send: Any, out: Any, reduce_op: str, async_op: bool = False) -> Handle:
        """``out`` = the reduction (``sum avg max min``; NaN propagates like NumPy) of every ``send``."""
        ...

    def reduce_scatter(self, group: Group, send: Any, out: Any, axis: int, sizes: Sequence[int],
                       reduce_op: str, async_op: bool = False) -> Handle:
        """Reduce every rank's ``send``; rank ``i`` gets block ``i`` (``sizes[i]`` long on ``axis``)."""
        ...

    def broadcast(self, group: Group, buf: Any, root: int, async_op: bool = False) -> Handle:
        """Copy ``buf`` from group rank ``root`` to every rank, in place."""
        ...

    def scatter(self, group: Group, send: Any | None, out: Any, axis: int, sizes: Sequence[int], root: int,
                async_op: bool = False) -> Handle:
        """Rank ``i`` receives block ``i`` along ``axis`` of the root's ``send`` (None elsewhere)."""
        ...


_FACTORIES: dict[str, Callable[[], Backend]] = {}
_DEVICES: dict[str, str] = {}
_INSTANCES: dict[str, Backend] = {}


def register_backend(name: str, factory: Callable[[], Backend], device_type: str) -> None:
    """Make backend ``name`` selectable for meshes of ``device_type`` (a ``"cuda"`` backend
    becomes a value of ``DTORCH_GPU_BACKEND``)."""
    _FACTORIES[name] = factory
    _DEVICES[name] = device_type


def backend_named(name: str) -> Backend:
    """The process's one instance of backend ``name`` (made on first use), wrapped in the
    prologue: ``.inner`` is the backend's own object."""
    backend = _INSTANCES.get(name)
    if backend is None:
        if name not in _FACTORIES:
            raise ValueError(f"no communication backend named {name!r}; known: {', '.join(sorted(_FACTORIES))}")
        backend = _INSTANCES[name] = Prologued(_FACTORIES[name]())
    return backend


def backends_for(device_type: str) -> tuple[str, ...]:
    """The names of the backends registered for ``device_type``, in registration order."""
    return tuple(name for name, device in _DEVICES.items() if device == device_type)
