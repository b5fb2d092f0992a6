"""DeviceMesh: an n-D arrangement of MPI world ranks with one communicator per mesh dim."""

from __future__ import annotations

import itertools
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from . import abort, settings
from ._mpi import library_world, node_facts, node_id, node_local_rank
from .comm import divergence
from .comm.deadline import wait_request
from .errors import MeshMismatchError
from .spmd import require_same

DEVICE_TYPES = ("cpu", "cuda")
_CONSTRUCTED = itertools.count()
"""Meshes built so far: construction is collective over the world, so a mesh's serial number
is the same on every rank and tells apart meshes over the same ranks (see ``identity``)."""

F = TypeVar("F", bound=Callable[..., Any])
_PER_MESH: list[tuple[str, Callable[..., Any], int]] = []
_LIVE: "weakref.WeakValueDictionary[tuple[Any, ...], DeviceMesh]" = weakref.WeakValueDictionary()
"""Root meshes not yet freed, by identity (meshes compare equal by value, so no set of them)."""


def _settings() -> dict[str, object]:
    """The settings that decide which MPI calls the library makes or how long it waits on them:
    agreed at every mesh construction, so no rank runs another collective path, debug check or
    deadline."""
    return settings.agreed()


def cached_per_mesh(attr: str, maxsize: int) -> Callable[[F], F]:
    """Register a function whose results are cached per mesh: every mesh holds its own
    ``lru_cache`` of it as ``mesh.<attr>`` (a sub-mesh shares its root's), and
    ``DeviceMesh.free()`` empties only that mesh's. The function must check ``_check_alive``
    when it computes (on a miss), so a freed mesh is never served from a cache; the caches of
    other meshes survive a ``free()``. Per-communicator resources (NCCL communicators) are
    attached to the MPI communicator instead (:mod:`dtorch_mpi.comm.lifetime`)."""

    def register(fn: F) -> F:
        _PER_MESH.append((attr, fn, maxsize))
        return fn

    return register


_ON_FREE: list[Callable[[], None]] = []


def release_on_free(hook: Callable[[], None]) -> None:
    """Run ``hook`` at every ``DeviceMesh.free()``, for process-wide resources that may hold a
    freed mesh's memory (the collective buffer pool: comm/pool.py)."""
    _ON_FREE.append(hook)


def live_caches(attr: str) -> Iterator[Any]:
    """The ``attr`` cache of every live root mesh (for statistics and a global clear)."""
    return (getattr(mesh, attr) for mesh in list(_LIVE.values()))


class DeviceMesh:
    """World ranks arranged in a mesh; collective to construct (every world rank calls it).

    ``get_group(k)`` is the communicator of the ranks that differ only in mesh dim ``k``;
    the communicators are built once here (``Split``) and released by ``free()`` (collective),
    never by the garbage collector. A rank outside the mesh has ``get_coordinate() is None``.
    The first mesh installs the abort-on-exception hook (:mod:`dtorch_mpi.abort`).
    """

    # this mesh's caches (``cached_per_mesh``): redistribute plans, operator plans
    _plans: Callable[..., Any]
    _op_plans: Callable[..., Any]

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        *,
        mesh_dim_names: Sequence[str] | None = None,
    ) -> None:
        abort.install()  # an uncaught exception on one rank now ends the job (see abort.py)
        world = library_world(wait_request)
        problem: Exception | None = None
        try:
            array = _validate_mesh(device_type, mesh, mesh_dim_names, world.Get_size())
        except Exception as exc:
            problem = exc
        require_same(  # one collective carries every rank's verdict and its arguments
            world,
            {"device_type": device_type, "mesh": array.tolist() if problem is None else None,
             "mesh_dim_names": None if mesh_dim_names is None else tuple(mesh_dim_names)},
            what="ranks passed different meshes to DeviceMesh()", error=MeshMismatchError, problem=problem,
        )
        require_same(world, _settings(), what="ranks run with different dtorch_mpi settings (environment "
                     "variables or set_comm_path); every MPI call must be the same on every rank, so set them "
                     "alike on every rank")
        self._init_fields(device_type, array, mesh_dim_names)
        self._identity: tuple[Any, ...] = (next(_CONSTRUCTED),)
        me = world.Get_rank()
        where = np.argwhere(array == me)
        self._coordinate: tuple[int, ...] | None = (
            tuple(int(c) for c in where[0]) if len(where) else None
        )
        self._owns_comms = True
        self._parent: DeviceMesh | None = None
        self._make_caches(None)
        self._comm: MPI.Intracomm = world.Split(  # type: ignore[assignment]
            0 if self._coordinate is not None else MPI.UNDEFINED,
            int(np.ravel_multi_index(self._coordinate, array.shape)) if self._coordinate else 0,
        )
        self._groups: list[MPI.Intracomm] = []
        for k in range(array.ndim):
            if self._coordinate is None:
                color, key = MPI.UNDEFINED, 0
            else:
                rest = tuple(c for i, c in enumerate(self._coordinate) if i != k)
                rest_shape = tuple(n for i, n in enumerate(array.shape) if i != k)
                color = int(np.ravel_multi_index(rest, rest_shape)) if rest else 0
                key = self._coordinate[k]
            self._groups.append(world.Split(color, key))  # type: ignore[arg-type]
        for comm in (self._comm, *self._groups):
            divergence.attach(comm)  # the divergence check's own communicator (collective)
        node_facts()  # a world collective the first time: every world rank is here
        if array.ndim >= 2 and self._coordinate is not None:
            _warn_if_inner_dim_crosses_hosts(self._groups[-1], array.shape, self.mesh_dim_names)
        if device_type == "cuda":
            _prepare_cuda(self._coordinate is not None)

    def _init_fields(
        self, device_type: str, array: np.ndarray, names: Sequence[str] | None
    ) -> None:
        self.device_type = device_type
        self._mesh = array
        self._mesh.setflags(write=False)
        self.mesh_dim_names = tuple(names) if names is not None else None
        self._freed = False
        self._key = (device_type, array.shape, tuple(array.ravel().tolist()), self.mesh_dim_names)

    def _make_caches(self, parent: "DeviceMesh | None") -> None:
        """This mesh's caches (see ``cached_per_mesh``): its own, or its root's when a sub-mesh."""
        for attr, fn, maxsize in _PER_MESH:
            setattr(self, attr, getattr(parent, attr) if parent is not None else lru_cache(maxsize=maxsize)(fn))
        if parent is None:
            _LIVE[self._identity] = self

    @classmethod
    def _sub(cls, parent: "DeviceMesh", mesh_dim: int) -> "DeviceMesh":
        """The 1-D mesh along ``mesh_dim`` through this rank (shares the parent's communicator)."""
        self = cls.__new__(cls)
        coord = parent._coordinate or (0,) * parent.ndim
        index = tuple(slice(None) if i == mesh_dim else c for i, c in enumerate(coord))
        names = [parent.mesh_dim_names[mesh_dim]] if parent.mesh_dim_names else None
        self._init_fields(parent.device_type, np.array(parent._mesh[index]), names)
        self._coordinate = (parent._coordinate[mesh_dim],) if parent._coordinate else None
        self._identity = (parent._identity, mesh_dim)
        self._owns_comms = False
        self._parent = parent
        self._make_caches(parent)
        group = parent._groups[mesh_dim]
        self._comm = group
        self._groups = [group]
        return self

    # --- public members -------------------------------------------------------------------
    @property
    def mesh(self) -> np.ndarray:
        return self._mesh

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._mesh.shape)

    @property
    def ndim(self) -> int:
        return self._mesh.ndim

    def size(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            return int(self._mesh.size)
        return self.shape[self._dim_index(mesh_dim)]

    @property
    def identity(self) -> tuple[Any, ...]:
        """Equal on every world rank for one mesh (its construction serial; a sub-mesh adds the
        mesh dim to its parent's, so ``mesh["tp"]`` has one identity on every rank though its
        ranks differ); differs between meshes built separately, even over the same ranks."""
        return self._identity

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate (None outside the mesh); raises once the mesh is freed, so
        factories, ``from_local`` and ``distribute_tensor`` refuse a freed mesh."""
        self._check_alive()
        return self._coordinate

    def get_local_rank(self, mesh_dim: int | str = 0) -> int | None:
        if self._coordinate is None:
            return None
        return self._coordinate[self._dim_index(mesh_dim)]

    def get_group(self, mesh_dim: int | str = 0) -> MPI.Intracomm:
        """The communicator along ``mesh_dim`` (``COMM_NULL`` on a rank outside the mesh)."""
        self._check_alive()
        return self._groups[self._dim_index(mesh_dim)]

    def get_comm(self) -> MPI.Intracomm:
        """The communicator of all ranks of the mesh (``COMM_NULL`` outside it)."""
        self._check_alive()
        return self._comm  # type: ignore[return-value]

    def __getitem__(self, name: str | int) -> "DeviceMesh":
        return DeviceMesh._sub(self, self._dim_index(name))

    def free(self) -> None:
        """Release the mesh's communicators, what is attached to them (NCCL communicators) and
        the plans cached for it (:func:`cached_per_mesh`; other meshes keep theirs). Collective
        over the world; idempotent. Using the mesh afterwards raises ``MeshMismatchError``."""
        if self._freed:
            return
        self._freed = True
        _LIVE.pop(self._identity, None)
        for attr, _, _ in _PER_MESH:
            getattr(self, attr).cache_clear()
        for hook in _ON_FREE:
            hook()
        if self._owns_comms:
            for comm in (self._comm, *self._groups):
                divergence.detach(comm)
                if comm != MPI.COMM_NULL:
                    comm.Free()

    def __enter__(self) -> "DeviceMesh":
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self._mesh.tolist()}{names})"

    # --- helpers --------------------------------------------------------------------------
    def _dim_index(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(
                    f"mesh has no dim named {mesh_dim!r}; its dims are {self.mesh_dim_names}"
                )
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dim {mesh_dim} out of range for a {self.ndim}-D mesh")
        return mesh_dim % self.ndim

    @property
    def freed(self) -> bool:
        """Whether ``free()`` ran on this mesh (or on the mesh it was taken from)."""
        return self._freed or (self._parent is not None and self._parent.freed)

    def _check_alive(self) -> None:
        if self.freed:
            raise MeshMismatchError(
                f"{self!r} has been freed (DeviceMesh.free()); its DTensors can no longer be "
                f"redistributed, computed on or created: create a new mesh"
            )


def _validate_mesh(
    device_type: str, mesh: Any, names: Sequence[str] | None, world_size: int
) -> np.ndarray:
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type {device_type!r} is not supported; use 'cpu' or 'cuda'")
    array = np.array(mesh)
    if array.ndim == 0:
        array = array.reshape(1)
    if array.size == 0 or array.dtype.kind not in "iu":
        raise ValueError(f"mesh must be a non-empty (nested) list of int world ranks, got {mesh!r}")
    array = array.astype(np.int64)
    if len(set(array.ravel().tolist())) != array.size:
        raise ValueError(f"mesh {array.tolist()} names a rank twice; each rank appears once")
    bad = [int(r) for r in array.ravel() if not 0 <= r < world_size]
    if bad:
        raise ValueError(
            f"mesh ranks {bad} are not world ranks (world size is {world_size}); "
            f"launch with more ranks (mpiexec -n ...) or use a smaller mesh"
        )
    if names is not None:
        names = tuple(names)
        if len(names) != array.ndim or len(set(names)) != len(names):
            raise ValueError(
                f"mesh_dim_names {names} must name each of the {array.ndim} mesh dims once"
            )
    return array


CROSSING_HOSTS = (
    "the innermost mesh dim{name} of this {shape} mesh spans several hosts although each host runs "
    "at least {size} ranks: its collectives (tensor parallelism, every layer) then cross the network. "
    "Meshes put the last dim on consecutive world ranks; launch with block placement so that "
    "consecutive ranks share a host (MPICH: mpiexec -n N -ppn K or -hosts a:K,b:K; Open MPI: "
    "--map-by slot or --host a:K,b:K; Slurm: the default block distribution), not round robin "
    "(-hosts a,b / --map-by node / -m cyclic)"
)


def _warn_if_inner_dim_crosses_hosts(group: MPI.Intracomm, shape: tuple[int, ...],
                                     names: tuple[str, ...] | None) -> None:
    """Warn (once per mesh, on the group's first rank) when the innermost mesh dim's ranks are
    on several hosts although every host holds enough ranks to keep it within one: the rank
    order of the launch, not the cluster, put it across (docs/portability.md). One small
    ``Iallreduce`` over the innermost dim's group, bounded by the collective deadline."""
    size = group.Get_size()
    if size == 1:
        return
    mine = np.array([node_id(), -node_id(), -node_facts()[1]], dtype=np.int64)
    low = np.empty_like(mine)
    wait_request(group.Iallreduce(mine, low, op=MPI.MIN), "the mesh's host-placement check (Allreduce)")
    crosses, fewest_on_a_host = low[0] != -low[1], -low[2]
    if crosses and fewest_on_a_host >= size and group.Get_rank() == 0:
        name = f" {names[-1]!r}" if names else ""
        text = CROSSING_HOSTS.format(name=name, shape="x".join(map(str, shape)), size=size)
        warnings.warn(text, RuntimeWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the innermost caller outside dtorch_mpi (a warning names the user's line)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def _prepare_cuda(member: bool) -> None:
    """Every world rank (the device type is agreed): the node facts and the GPU backend choice
    are world collectives, made here once where every rank is present, never lazily by only
    the ranks of a mesh. A member rank then takes its GPU: node-local rank modulo the count."""
    from .comm.gpu import selected_backend

    node_facts()
    selected_backend()
    if member:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(node_local_rank() % count).use()


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int] | int,
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """A mesh of world ranks ``0..prod(mesh_shape)-1`` in row-major order."""
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    return DeviceMesh(
        device_type, np.arange(int(np.prod(shape))).reshape(shape), mesh_dim_names=mesh_dim_names
    )
