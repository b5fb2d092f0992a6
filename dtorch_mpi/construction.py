"""Construction from pieces: the ``from_local`` protocol and the metadata checks it shares.

``DTensor.from_local`` (and ``distribute_tensor``, the factories and ``nn`` layers for the
shared checks) turn what each rank holds into a spec: the piece's array type and dtype, a
checked shape, the placements normalised, and, on the checked path, one fixed-size Allreduce
that agrees the ranks' metadata and derives the global shape. The result is ``(piece, spec)``;
dtensor.py wraps it, so this module does not import the DTensor class.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from math import prod
from typing import Any

import numpy as np
from mpi4py import MPI

from ._mpi import library_world
from .arrays import array_namespace
from .comm.config import spmd_debug
from .comm.deadline import wait_request
from .dtypes import check_dtype, dtype_code, reduction_op, to_native
from .errors import DTypeMismatchError, MeshMismatchError, ShapeMismatchError
from .mesh import DeviceMesh
from .placement import Partial, Placement, Shard, normalized_placements
from .spec import DTensorSpec
from .split import local_shape_and_offset
from .spmd import MAX_NDIM, agree, fingerprint, raise_divergence, require_same


def local_and_spec(local: Any, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int] | None,
                   run_check: bool) -> tuple[Any, DTensorSpec]:
    """``DTensor.from_local``'s piece (native, of the mesh's array type) and spec: trusted when
    ``shape`` is given without ``run_check`` (outside SPMD debug mode), else checked across
    the mesh (see ``DTensor.from_local`` for what each path checks)."""
    debug_check_mesh(mesh, "from_local")
    if shape is not None and not run_check and not spmd_debug():
        return _from_local_trusted(local, mesh, placements, shape)
    return _from_local_checked(local, mesh, placements, shape)


def _as_local(local: Any, mesh: DeviceMesh) -> Any:
    xp = array_namespace(mesh.device_type)
    if not hasattr(local, "shape") or not hasattr(local, "dtype"):
        raise TypeError(f"from_local needs an array piece, got {type(local).__name__}")
    if mesh.device_type == "cpu" and not isinstance(local, np.ndarray):
        raise TypeError(
            f"a 'cpu' mesh holds numpy.ndarray pieces, got {type(local).__module__}."
            f"{type(local).__name__}; convert it first (numpy.asarray / cupy.asnumpy)"
        )
    if mesh.device_type == "cuda" and not isinstance(local, xp.ndarray):
        raise TypeError(f"a 'cuda' mesh holds cupy.ndarray pieces, got {type(local).__name__}")
    return to_native(local)


_MAX_ELEMENTS = int(np.iinfo(np.int64).max)


def checked_shape(shape: Sequence[Any]) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, each and their product in ``[0, 2**63)`` (NumPy's limit).

    A clear error here instead of an overflow deep inside NumPy or an MPI metadata record.
    """
    try:
        dims = tuple(operator.index(s) for s in shape)
    except TypeError as exc:
        raise TypeError(f"a shape holds ints, got {tuple(shape)!r}") from exc
    if any(s < 0 for s in dims):
        raise ShapeMismatchError(f"negative dimension in shape {dims}")
    if any(s > _MAX_ELEMENTS for s in dims) or prod(dims) > _MAX_ELEMENTS:
        raise ShapeMismatchError(
            f"shape {dims} has {prod(dims)} elements; at most 2**63 - 1 (NumPy's limit) are supported"
        )
    return dims


def make_spec(mesh: DeviceMesh, placements: tuple[Placement, ...], shape: tuple[int, ...],
              dtype: np.dtype) -> DTensorSpec:
    """The spec of a new DTensor; every Partial's reduce op must be defined for ``dtype``
    (``reduction_op`` refuses max/min of complex numbers now, not at the first reduction)."""
    for p in placements:
        if isinstance(p, Partial):
            reduction_op(dtype, p.reduce_op)
    return DTensorSpec(mesh, placements, shape, dtype)


def mesh_name(mesh: DeviceMesh) -> str:
    """How ranks compare and name a mesh: the same text on every rank for one (sub-)mesh, and
    different for two meshes built separately over the same ranks (their serials differ)."""
    return f"{mesh.device_type} mesh of shape {mesh.shape}, serial {mesh.identity}"


def debug_check_mesh(mesh: DeviceMesh, call: str) -> None:
    """``DTORCH_SPMD_DEBUG=1``: every world rank makes ``call`` on the same mesh.

    Over the library's world, ranks outside the mesh included: ranks passing different meshes
    would otherwise wait in collectives on different communicators, which no check on the
    mesh's own communicator can see. So in debug mode every world rank must make the call (as
    every rank of an SPMD program does).
    """
    if spmd_debug():
        require_same(library_world(), {"call": call, "mesh": mesh_name(mesh)},
                     what=f"{call} (DTORCH_SPMD_DEBUG=1)")


def _from_local_trusted(
    local: Any, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]
) -> tuple[Any, DTensorSpec]:
    """``shape`` given, no check across ranks: this rank's piece must fit the split rule."""
    xp_local = _as_local(local, mesh)
    dtype = check_dtype(xp_local.dtype)
    global_shape = checked_shape(shape)
    if len(global_shape) != xp_local.ndim:
        raise ShapeMismatchError(
            f"shape={global_shape} has {len(global_shape)} dims but the local piece has {xp_local.ndim}"
        )
    spec = make_spec(mesh, normalized_placements(placements, mesh.ndim, len(global_shape)), global_shape, dtype)
    coord = mesh.get_coordinate()
    if coord is not None and tuple(xp_local.shape) != spec.local_shape:
        raise ShapeMismatchError(
            f"from_local(shape={global_shape}, placements={list(spec.placements)}): this rank "
            f"(coordinate {coord}) holds a piece of shape {tuple(xp_local.shape)}, the split rule "
            f"gives {spec.local_shape}. Checked on this rank only (shape given, run_check=False); "
            f"pass run_check=True to check every rank's piece with one error on every rank"
        )
    return xp_local, spec


# the fields of from_local's record: what must agree (each reduced as min and max), then the
# piece's contribution to each global dim (summed)
_FL_PLACEMENTS, _FL_MESH, _FL_NDIM, _FL_DTYPE, _FL_GIVEN = 0, 1, 2, 3, 4
_FL_AGREED = _FL_GIVEN + MAX_NDIM


def _from_local_checked(
    local: Any, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int] | None
) -> tuple[Any, DTensorSpec]:
    """``from_local`` with every rank's metadata checked: O(1) integers per rank whatever the
    mesh size (issue 27 item 7; was a ranks x 69 table on every rank). One Allreduce carries
    the status and the min and max of each field that must agree (placements, mesh, ndim,
    dtype, shape=), and the sum of the pieces' extents along the dims that shard them (the
    derived global shape); then each rank checks its own piece against the split rule and the
    ranks agree on that (errors name a few ranks and the count: spmd.agree)."""
    if mesh.get_coordinate() is None:
        if shape is None:
            raise MeshMismatchError(
                "from_local on a rank outside the mesh cannot derive the global shape; pass shape="
            )
        return _from_local_trusted(local, mesh, placements, shape)  # an outside piece is empty
    comm = mesh.get_comm()
    coord = mesh.get_coordinate()
    assert coord is not None
    row = np.zeros(_FL_AGREED, dtype=np.int64)
    extent = np.zeros(MAX_NDIM, dtype=np.int64)
    problem: Exception | None = None
    xp_local: Any = None
    plc: tuple[Placement, ...] = ()
    try:
        xp_local = _as_local(local, mesh)
        if xp_local.ndim > MAX_NDIM:
            raise ShapeMismatchError(f"pieces have {xp_local.ndim} dims; at most {MAX_NDIM} are supported")
        plc = normalized_placements(placements, mesh.ndim, xp_local.ndim)
        row[_FL_PLACEMENTS] = fingerprint(plc)
        row[_FL_MESH] = fingerprint(mesh_name(mesh))
        row[_FL_NDIM] = xp_local.ndim
        row[_FL_DTYPE] = dtype_code(xp_local.dtype)
        row[_FL_GIVEN:] = -1
        if shape is not None:
            given = checked_shape(shape)
            if len(given) != xp_local.ndim:
                raise ShapeMismatchError(
                    f"shape={given} has {len(given)} dims but the local piece has {xp_local.ndim}"
                )
            row[_FL_GIVEN : _FL_GIVEN + len(given)] = given
        for d, n in enumerate(xp_local.shape):  # counted once per slice of the tensor along d
            sharding = {k for k, p in enumerate(plc) if isinstance(p, Shard) and p.dim == d}
            if all(c == 0 for k, c in enumerate(coord) if k not in sharding):
                extent[d] = n
    except Exception as exc:
        problem = exc
    status = np.array([0 if problem is None else -1], dtype=np.int64)  # min: -1 when any rank failed
    mine = np.concatenate([status, row, -row])
    low = np.empty_like(mine)
    wait_request(comm.Iallreduce(mine, low, op=MPI.MIN), "from_local's metadata check (Allreduce)")
    if low[0] != 0:
        agree(comm, problem)
    lo, hi = low[1 : 1 + _FL_AGREED], -low[1 + _FL_AGREED :]
    if lo[_FL_NDIM] != hi[_FL_NDIM]:
        raise ShapeMismatchError(
            f"from_local pieces differ in ndim across ranks: from {lo[_FL_NDIM]}-D to {hi[_FL_NDIM]}-D"
        )
    if lo[_FL_PLACEMENTS] != hi[_FL_PLACEMENTS] or lo[_FL_MESH] != hi[_FL_MESH]:
        values = {"placements": list(plc), "mesh": mesh_name(mesh)}
        raise_divergence(comm, {k: values[k] for k, col in (("placements", _FL_PLACEMENTS), ("mesh", _FL_MESH))
                                if lo[col] != hi[col]}, "from_local")
    if lo[_FL_DTYPE] != hi[_FL_DTYPE]:
        raise_divergence(comm, {"dtype": str(xp_local.dtype)},
                         "from_local pieces differ in dtype across ranks (cast every piece to one dtype)",
                         DTypeMismatchError)
    ndim = xp_local.ndim
    if (lo[_FL_GIVEN : _FL_GIVEN + ndim] != hi[_FL_GIVEN : _FL_GIVEN + ndim]).any():
        raise_divergence(comm, {"shape=": tuple(int(v) for v in row[_FL_GIVEN : _FL_GIVEN + ndim])},
                         "from_local: ranks passed different shape= values", ShapeMismatchError)
    if shape is None:
        total = np.empty_like(extent)
        wait_request(comm.Iallreduce(extent, total, op=MPI.SUM), "from_local's global shape (Allreduce)")
        global_shape = tuple(int(v) for v in total[:ndim])
    else:
        global_shape = tuple(int(v) for v in row[_FL_GIVEN : _FL_GIVEN + ndim])
    want = local_shape_and_offset(global_shape, mesh.shape, plc, coord)[0]
    got = tuple(xp_local.shape)
    agree(comm, None if got == want else ShapeMismatchError(
        f"from_local pieces do not form a global shape {global_shape} with placements {list(plc)}: "
        f"rank {comm.Get_rank()} (coordinate {coord}) has {got}, the split rule gives {want}. "
        f"Pieces must follow the balanced split rule (see compute_local_shape_and_offset)"))
    return xp_local, make_spec(mesh, plc, global_shape, check_dtype(xp_local.dtype))
