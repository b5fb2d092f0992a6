"""Creating DTensors: distribute_tensor and factories that allocate only the local piece."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from . import random as _random
from .arrays import array_namespace
from .comm import Group, backend_for
from .comm.config import spmd_debug
from .comm.deadline import wait_request
from .comm.layout import with_dim
from .construction import checked_shape, debug_check_mesh, make_spec, mesh_name
from .dtensor import DTensor
from .dtypes import check_dtype, dtype_code, dtype_from_code, identity_value, to_native
from .errors import DTypeMismatchError, MeshMismatchError, ShapeMismatchError
from .mesh import DeviceMesh
from .placement import Partial, Placement, Replicate, Shard, normalize_placements
from .spec import DTensorSpec
from .split import local_shape_and_offset, split_sizes
from .spmd import MAX_NDIM, agree, fingerprint, raise_divergence, require_same

DEFAULT_DTYPE = np.dtype("float32")


def _parse_shape(shape: tuple[Any, ...]) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return checked_shape(shape)


def _partial_fill(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> str | None:
    """The reduce op whose identity this rank's piece holds, or None when it holds the value.

    SPEC: with Partial the value sits at mesh coordinate 0 and the reduce op's identity
    elsewhere (the outermost Partial mesh dim off coordinate 0 decides); ``avg`` has no
    identity, so its pieces all hold the value.
    """
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    for k, p in enumerate(placements):
        if isinstance(p, Partial) and p.reduce_op != "avg" and coord[k] != 0:
            return p.reduce_op
    return None


def _build(
    shape: tuple[int, ...], dtype: np.dtype, mesh: DeviceMesh, placements: Sequence[Placement],
    fill: Callable[[tuple[int, ...], tuple[int, ...], Any], Any],
) -> DTensor:
    plc = normalize_placements(placements, mesh.ndim, len(shape))
    spec = make_spec(mesh, plc, shape, dtype)
    return DTensor(make_piece(spec, fill), spec)


Fill = Callable[[tuple[int, ...], tuple[int, ...], Any], Any]
"""``fill(local_shape, offset, xp)``: the values of a piece, from where it lies in the whole."""


def make_piece(spec: DTensorSpec, fill: Fill) -> Any:
    """This rank's piece of ``spec`` made by ``fill`` (only the piece is allocated; a Partial
    piece off coordinate 0 holds the reduce op's identity instead)."""
    local_shape, offset = spec.local_shape_and_offset
    xp = array_namespace(spec.mesh.device_type)
    op = _partial_fill(spec.mesh, spec.placements)
    if op is None:
        return fill(local_shape, offset, xp)
    return xp.full(local_shape, identity_value(spec.dtype, op), dtype=spec.dtype)


def random_fill(kind: str, shape: tuple[int, ...], dtype: Any, mesh: DeviceMesh) -> Fill:
    """The fill of the next ``rand`` (``kind="rand"``) or ``randn`` call of ``shape``: its key is
    drawn now, as the factory call would draw it, so a piece made later, in any placements,
    has the values that call would have given (a deferred parameter: nn/deferred.py)."""
    dt = check_dtype(DEFAULT_DTYPE if dtype is None else dtype)
    _require_float(dt, kind)
    dims = checked_shape(shape)
    key = _random_key(mesh, kind)
    draw = {"rand": _random.uniform, "randn": _random.normal}[kind]
    return lambda s, o, xp: draw(key, dims, s, o, dt, xp)


def _factory_args(dtype: Any, device_mesh: DeviceMesh | None, placements: Any) -> tuple[np.dtype, DeviceMesh, Any]:
    if device_mesh is None:
        raise TypeError("factories need device_mesh=...")
    if placements is None:
        placements = (Replicate(),) * device_mesh.ndim
    return check_dtype(DEFAULT_DTYPE if dtype is None else dtype), device_mesh, placements


def full(shape: Sequence[int] | int, fill_value: Any, *, dtype: Any = None,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None, requires_grad: bool = False) -> DTensor:
    """A DTensor of ``fill_value``; each rank allocates only its piece."""
    dims = _parse_shape((shape,))
    dt, mesh, plc = _factory_args(
        dtype if dtype is not None else _infer_fill_dtype(fill_value), device_mesh, placements)
    return _build(dims, dt, mesh, plc, lambda s, o, xp: xp.full(s, fill_value, dtype=dt)).requires_grad_(requires_grad)


def _infer_fill_dtype(value: Any) -> np.dtype | None:
    """torch.full's rule: bool -> bool, int -> int64, float -> the default, complex -> complex64."""
    if isinstance(value, (bool, np.bool_)):
        return np.dtype(bool)
    if isinstance(value, (int, np.integer)):
        return np.dtype(np.int64)
    if isinstance(value, (complex, np.complexfloating)):
        return np.dtype(np.complex64)
    return None


def zeros(*shape: Any, dtype: Any = None, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None, requires_grad: bool = False) -> DTensor:
    dt, mesh, plc = _factory_args(dtype, device_mesh, placements)
    return _build(_parse_shape(shape), dt, mesh, plc, lambda s, o, xp: xp.zeros(s, dtype=dt)).requires_grad_(requires_grad)


def ones(*shape: Any, dtype: Any = None, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None, requires_grad: bool = False) -> DTensor:
    dt, mesh, plc = _factory_args(dtype, device_mesh, placements)
    return _build(_parse_shape(shape), dt, mesh, plc, lambda s, o, xp: xp.ones(s, dtype=dt)).requires_grad_(requires_grad)


def empty(*shape: Any, dtype: Any = None, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None, requires_grad: bool = False) -> DTensor:
    """Uninitialised pieces (Partial pieces off coordinate 0 hold the identity, as for all)."""
    dt, mesh, plc = _factory_args(dtype, device_mesh, placements)
    return _build(_parse_shape(shape), dt, mesh, plc, lambda s, o, xp: xp.empty(s, dtype=dt)).requires_grad_(requires_grad)


def _like(name: str, x: Any, dtype: Any, placements: Any) -> tuple[tuple[int, ...], dict[str, Any]]:
    if not isinstance(x, DTensor):
        raise TypeError(f"{name}: x must be a DTensor, got {type(x).__name__} (use {name[:-5]}(shape, "
                        f"device_mesh=..., placements=...) for a new tensor)")
    return x.shape, {"dtype": x.dtype if dtype is None else dtype, "device_mesh": x.device_mesh,
                     "placements": x.placements if placements is None else placements}


def zeros_like(x: DTensor, *, dtype: Any = None, placements: Sequence[Placement] | None = None,
               requires_grad: bool = False) -> DTensor:
    """Zeros with ``x``'s shape, dtype, mesh and placements (each overridable but the mesh)."""
    shape, kw = _like("zeros_like", x, dtype, placements)
    return zeros(*shape, **kw, requires_grad=requires_grad)


def ones_like(x: DTensor, *, dtype: Any = None, placements: Sequence[Placement] | None = None,
              requires_grad: bool = False) -> DTensor:
    """Ones with ``x``'s shape, dtype, mesh and placements (a Partial one: 1 at coordinate 0)."""
    shape, kw = _like("ones_like", x, dtype, placements)
    return ones(*shape, **kw, requires_grad=requires_grad)


def empty_like(x: DTensor, *, dtype: Any = None, placements: Sequence[Placement] | None = None,
               requires_grad: bool = False) -> DTensor:
    """Uninitialised pieces with ``x``'s shape, dtype, mesh and placements."""
    shape, kw = _like("empty_like", x, dtype, placements)
    return empty(*shape, **kw, requires_grad=requires_grad)


def full_like(x: DTensor, fill_value: Any, *, dtype: Any = None, placements: Sequence[Placement] | None = None,
              requires_grad: bool = False) -> DTensor:
    """``fill_value`` with ``x``'s shape, dtype (NumPy's rule: ``x``'s, not the value's), mesh
    and placements."""
    shape, kw = _like("full_like", x, dtype, placements)
    return full(shape, fill_value, **kw, requires_grad=requires_grad)


def arange(start: Any, stop: Any = None, step: Any = 1, *, dtype: Any = None,
           device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None, requires_grad: bool = False) -> DTensor:
    """``numpy.arange`` as a 1-D DTensor (dtype inferred from the arguments like NumPy)."""
    if stop is None:
        start, stop = 0, start
    if step == 0:
        raise ValueError("arange step must not be zero")
    length = max(0, math.ceil((stop - start) / step))
    inferred = np.result_type(*(np.asarray(v) for v in (start, stop, step)))
    dt, mesh, plc = _factory_args(dtype if dtype is not None else inferred, device_mesh, placements)

    def fill(s: tuple[int, ...], o: tuple[int, ...], xp: Any) -> Any:
        idx = xp.arange(o[0], o[0] + s[0], dtype=np.float64 if dt.kind == "f" or inferred.kind == "f" else np.int64)
        return (start + idx * step).astype(dt)

    return _build((length,), dt, mesh, plc, fill).requires_grad_(requires_grad)


def rand(*shape: Any, dtype: Any = None, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None, requires_grad: bool = False) -> DTensor:
    """Uniform [0, 1) values, the same global value for any mesh and placements."""
    return _sampled("rand", _random.uniform, shape, dtype, device_mesh, placements, requires_grad)


def randn(*shape: Any, dtype: Any = None, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None, requires_grad: bool = False) -> DTensor:
    """Standard normal values, the same global value for any mesh and placements."""
    return _sampled("randn", _random.normal, shape, dtype, device_mesh, placements, requires_grad)


def _sampled(call: str, sample: Callable[..., Any], shape: tuple[Any, ...], dtype: Any,
             device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None, requires_grad: bool) -> DTensor:
    """``rand``/``randn``: each rank draws only its piece of the counter-based stream
    ``sample(key, global shape, local shape, offset, dtype, xp)``, so any layout sees one array."""
    dt, mesh, plc = _factory_args(dtype, device_mesh, placements)
    _require_float(dt, call)
    dims = _parse_shape(shape)
    key = _random_key(mesh, call)
    return _build(dims, dt, mesh, plc, lambda s, o, xp: sample(key, dims, s, o, dt, xp)).requires_grad_(requires_grad)


def _random_key(mesh: DeviceMesh, call: str) -> int:
    """The next random key; with ``DTORCH_SPMD_DEBUG=1`` the ranks of the mesh first check that
    their generator states (seed, calls so far) agree: a divergent ``manual_seed`` or an extra
    random call on one rank would otherwise give silently different "global" values."""
    if spmd_debug():
        require_same(mesh.get_comm(), {"random state (seed, calls)": _random.state()},
                     what=f"{call} (DTORCH_SPMD_DEBUG=1)")
    return _random.next_key()


def _require_float(dt: np.dtype, name: str) -> None:
    if dt.kind != "f":
        raise DTypeMismatchError(f"{name} makes floating-point values; got dtype {dt}")


# the fields of distribute_tensor's record: what must agree, then the holders' array metadata
_DT_SOURCE, _DT_MESH, _DT_PLACEMENTS, _DT_NDIM, _DT_DTYPE, _DT_SHAPE = 0, 1, 2, 3, 4, 5
_NO_SOURCE = -2  # src_data_rank=None in the record


def distribute_tensor(
    array: Any,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
    requires_grad: bool = False,
) -> DTensor:
    """Turn a complete array into a DTensor; each rank receives only its piece.

    ``src_data_rank``: the mesh rank (position in ``device_mesh.mesh.flatten()``; equal to the
    world rank for ``init_device_mesh``) holding the array; other ranks may pass ``None`` or
    an array of the same shape, which is ignored. The source sends each rank its piece as a
    buffer. ``None``: every rank holds the array and slices locally (no data moves). The pieces
    never alias ``array``. One small all-reduce (O(1) integers per rank) first agrees ``src_data_rank``, the mesh, the
    placements and the array's shape and dtype across the mesh: a difference raises on every
    rank (``SPMDDivergenceError``, ``ShapeMismatchError``). A rank outside the mesh makes an
    empty piece from ``array``'s shape and dtype without communicating. ``requires_grad=True``
    makes the result a leaf that collects a gradient (see docs/autograd.md). ``placements=None``
    is ``[Replicate()] * device_mesh.ndim``, as in PyTorch.
    """
    if placements is None:
        placements = [Replicate()] * device_mesh.ndim
    return _distribute(array, device_mesh, placements, src_data_rank).requires_grad_(requires_grad)


def _distribute(array: Any, device_mesh: DeviceMesh, placements: Sequence[Placement],
                src_data_rank: int | None) -> DTensor:
    mesh = device_mesh
    debug_check_mesh(mesh, "distribute_tensor")
    if mesh.get_coordinate() is None:
        return _outside_the_mesh(array, mesh, placements)
    comm = mesh.get_comm()
    size, me = comm.Get_size(), comm.Get_rank()

    # one Allreduce (MIN) of [-status, fields, -fields]: the least and greatest of each field
    # over the mesh, O(1) integers per rank whatever the mesh size (issue 27 item 7). The
    # array's fields come from its holders alone: a rank without the array adds the largest
    # int64 to both halves, which changes no minimum.
    agreed = np.zeros(_DT_NDIM, dtype=np.int64)
    held = np.full(1 + 1 + MAX_NDIM, np.iinfo(np.int64).max, dtype=np.int64)  # ndim, dtype, shape
    problem: Exception | None = None
    holds = src_data_rank is None or me == src_data_rank
    try:
        agreed[_DT_SOURCE] = _NO_SOURCE if src_data_rank is None else operator.index(src_data_rank)
        agreed[_DT_MESH] = fingerprint(mesh_name(mesh))
        agreed[_DT_PLACEMENTS] = fingerprint(tuple(placements))
        if src_data_rank is not None and not 0 <= src_data_rank < size:
            raise ValueError(f"src_data_rank={src_data_rank} is not a rank of a mesh of {size} ranks")
        if holds:
            if not hasattr(array, "shape") or not hasattr(array, "dtype"):
                raise TypeError(f"distribute_tensor needs an array, got {type(array).__name__}")
            array = to_native(array)
            if device_mesh.device_type == "cuda":  # a host array moves to the device (PyTorch's too)
                array = array_namespace("cuda").asarray(array)
            if array.ndim > MAX_NDIM:
                raise ShapeMismatchError(f"arrays of more than {MAX_NDIM} dims are not supported")
            normalize_placements(placements, mesh.ndim, array.ndim)
            held[:] = -1
            held[0], held[1] = array.ndim, dtype_code(array.dtype)
            held[2 : 2 + array.ndim] = checked_shape(array.shape)
    except Exception as exc:
        problem = exc
    mine = np.concatenate([[0 if problem is None else -1], agreed, -agreed, held,
                           held if not holds else -held]).astype(np.int64)
    low = np.empty_like(mine)
    wait_request(comm.Iallreduce(mine, low, op=MPI.MIN), "distribute_tensor's metadata check (Allreduce)")
    if low[0] != 0:
        agree(comm, problem)
    n = _DT_NDIM
    lo, hi = low[1 : 1 + n], -low[1 + n : 1 + 2 * n]
    differ = {name: value for col, (name, value) in {_DT_SOURCE: ("src_data_rank", src_data_rank),
                                                      _DT_MESH: ("mesh", mesh_name(mesh))}.items()
              if lo[col] != hi[col]}
    if differ:
        raise_divergence(comm, differ, "distribute_tensor")
    held_lo, held_hi = low[1 + 2 * n : 1 + 2 * n + held.size], -low[1 + 2 * n + held.size :]
    if (held_lo != held_hi).any():  # (only possible with src_data_rank=None: every rank holds one)
        raise_divergence(comm, {"array": f"{tuple(array.shape)} {array.dtype}"},
                         "distribute_tensor(src_data_rank=None) needs the same array shape and dtype on every rank",
                         ShapeMismatchError)
    ndim, code = int(held_lo[0]), int(held_lo[1])
    shape = tuple(int(v) for v in held_lo[2 : 2 + ndim])
    dt = dtype_from_code(code)
    if lo[_DT_PLACEMENTS] == hi[_DT_PLACEMENTS]:  # the same arguments everywhere
        plc = normalize_placements(placements, mesh.ndim, ndim)
    else:  # perhaps the same placements spelled differently (Shard(-1), Shard(1)): compare them
        plc, problem = (), None
        try:
            plc = normalize_placements(placements, mesh.ndim, ndim)
        except Exception as exc:
            problem = exc
        require_same(comm, {"placements": list(plc)}, what="distribute_tensor", problem=problem)
    spec = make_spec(mesh, plc, shape, dt)
    local_shape, offset = spec.local_shape_and_offset
    op = _partial_fill(mesh, plc)
    xp = array_namespace(mesh.device_type)
    if src_data_rank is None:
        index = (*(slice(o, o + n) for o, n in zip(offset, local_shape)), ...)  # 0-d stays 0-d
        local = (xp.array(array[index], dtype=dt, order="C", copy=True) if op is None
                 else xp.full(local_shape, identity_value(dt, op), dt))
        return DTensor(local, spec)
    local = xp.zeros(local_shape, dtype=dt) if op is None else xp.full(local_shape, identity_value(dt, op), dt)
    _send_pieces(array, local, mesh, plc, shape, src_data_rank, xp)
    return DTensor(local, spec)


def _outside_the_mesh(array: Any, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """A rank outside the mesh holds an empty piece, like the factories' and from_local's."""
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise MeshMismatchError(
            f"distribute_tensor on world rank {MPI.COMM_WORLD.Get_rank()}, which is not in {mesh!r}: "
            f"pass the array (or anything with its shape and dtype, e.g. numpy.empty(shape, dtype)) "
            f"so that this rank can make its empty piece; it moves no data"
        )
    shape, dt = checked_shape(array.shape), check_dtype(array.dtype)
    return _build(shape, dt, mesh, placements, lambda s, o, xp: xp.empty(s, dtype=dt))


def _send_pieces(array: Any, local: Any, mesh: DeviceMesh, plc: tuple[Placement, ...], shape: tuple[int, ...],
                 root: int, xp: Any) -> None:
    """The root's array reaches every rank through the mesh's backend, one mesh dim at a time,
    outermost first. Along mesh dim ``k`` the ranks whose region is known pass it on within
    their group: ``Shard(d)`` scatters it along ``d``, ``Replicate``/``Partial("avg")``
    broadcast it, another ``Partial`` hands it whole to coordinate 0 (the others hold the
    identity already). A rank takes part in step ``k`` when its coordinates after ``k`` are
    the root's; an identity region stops there: both facts its whole group shares."""
    backend = backend_for(mesh.device_type)
    coord = mesh.get_coordinate()
    assert coord is not None  # ranks outside the mesh never get here
    top = tuple(int(v) for v in np.unravel_index(root, mesh.shape))
    # the region this rank knows, in C order: MPI moves memory order, and the receivers read C order
    held = xp.ascontiguousarray(array) if coord == top else None
    for k, p in enumerate(plc):
        if coord[k + 1 :] != top[k + 1 :]:
            continue  # this rank's region arrives in a later step
        if _partial_fill(mesh, plc[:k]) is not None:
            return  # an identity region (local holds it): nothing to receive
        group, here, last = Group(mesh.get_group(k), k), coord[k] == top[k], k == len(plc) - 1
        before = local_shape_and_offset(shape, mesh.shape[:k], plc[:k], coord[:k])[0]
        if isinstance(p, Shard):
            sizes = split_sizes(before[p.dim], mesh.shape[k])  # shards split one mesh dim after another
            out = local if last else xp.empty(with_dim(before, p.dim, sizes[coord[k]]), dtype=local.dtype)
            held = backend.scatter(group, held if here else None, out, p.dim, sizes, top[k]).wait()
        elif isinstance(p, Partial) and p.reduce_op != "avg":
            if top[k] != 0:  # the value belongs at coordinate 0 (SPEC), the root is elsewhere
                n = math.prod(before)
                out = xp.empty(n if coord[k] == 0 else 0, dtype=local.dtype)
                send = xp.ascontiguousarray(held).reshape(-1) if here else None
                got = backend.scatter(group, send, out, 0, [n if c == 0 else 0 for c in range(mesh.shape[k])],
                                      top[k]).wait()
                held = got.reshape(before) if coord[k] == 0 else None
        else:  # Replicate, Partial("avg"): every coordinate holds the value
            buf = held if here else xp.empty(before, dtype=local.dtype)
            held = backend.broadcast(group, buf, top[k]).wait()
    if held is not None and held is not local:
        local[...] = held
