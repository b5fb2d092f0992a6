"""Loading complete values into sharded parameters ("shard on load").

Each value may be a NumPy or CuPy array, a lazily indexable array (an h5py dataset, a
memory-mapped ``.npy``: anything with ``shape``, ``dtype`` and slicing), or a DTensor. A rank
reads only its own hyperslab of an array value: ``Shard(d)`` keeps its slice, ``Replicate``
reads everything, ``Partial`` reads the real value at mesh coordinate 0 and fills the reduce
op's identity elsewhere (``avg`` keeps the value everywhere: it has no identity). A DTensor
value is redistributed explicitly to the parameter's placements (same mesh required).

Casts: a value is cast to the parameter's dtype when NumPy calls the cast ``same_kind``
(float64 -> float32 and int -> float load; float -> int or complex -> float are errors).

Three phases, each agreed across ranks: check every key, shape and dtype; read every piece
into new arrays; only then copy into the parameters. So a failed load changes no parameter,
and every rank raises the same error.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from typing import TYPE_CHECKING, Any

import numpy as np

from .._mpi import library_world
from ..arrays import array_namespace
from ..autograd.record import mark_changed
from ..dtensor import DTensor
from ..dtypes import identity_value
from ..placement import Partial
from ..spmd import agreed
from ..stateful import check_fill

if TYPE_CHECKING:
    from .module import Parameter


def load_into(params: Mapping[str, Parameter], values: Mapping[str, Any], strict: bool = True) -> None:
    world = library_world()
    with agreed(world):
        keys = check_fill(params, values, strict)
    pieces: dict[str, Any] = {}
    with agreed(world):
        for key in keys:
            pieces[key] = _read_piece(params[key], values[key])
    for key, piece in pieces.items():
        param = params[key]
        local = param.to_local()
        if local.shape == piece.shape and local.flags.writeable:
            local[...] = piece
        else:
            param._replace(piece, param.spec)
        mark_changed(param)  # as PyTorch's copy_ counts it


def _read_piece(param: Parameter, value: Any) -> Any:
    spec = param.spec
    mesh = spec.mesh
    xp = array_namespace(mesh.device_type)
    local_shape, offset = spec.local_shape_and_offset
    if isinstance(value, DTensor):
        moved = value.redistribute(placements=param.placements).to_local()
        return xp.array(moved, dtype=param.dtype, copy=True)
    coord = mesh.get_coordinate()
    if coord is None:
        return xp.empty(local_shape, dtype=param.dtype)
    for k, p in enumerate(param.placements):
        if isinstance(p, Partial) and p.reduce_op != "avg" and coord[k] != 0:
            return xp.full(local_shape, identity_value(param.dtype, p.reduce_op), dtype=param.dtype)
    if prod(local_shape) == 0:
        return xp.empty(local_shape, dtype=param.dtype)
    index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
    if mesh.device_type == "cpu" and np.dtype(value.dtype) == param.dtype and hasattr(value, "read_direct") and index:
        out = np.empty(local_shape, dtype=param.dtype)  # an h5py dataset: read straight into it
        value.read_direct(out, index)
        return out
    piece = value[index] if index else value[()]
    if hasattr(piece, "get") and mesh.device_type == "cpu":
        piece = piece.get()
    return xp.array(piece, dtype=param.dtype, copy=True).reshape(local_shape)
