"""The balanced split rule (SPEC "Uneven split rule"): pure functions, no communication."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from .placement import Placement, Shard

if TYPE_CHECKING:
    from .mesh import DeviceMesh


def split_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """``(size, start)`` of piece ``index`` when ``length`` is split over ``parts`` ranks."""
    base, extra = divmod(length, parts)
    return base + (1 if index < extra else 0), index * base + min(index, extra)


@lru_cache(maxsize=4096)
def split_sizes(length: int, parts: int) -> tuple[int, ...]:
    """Sizes of all ``parts`` pieces of ``length`` under the split rule."""
    base, extra = divmod(length, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def split_offsets(length: int, parts: int) -> tuple[int, ...]:
    """Start offsets of all ``parts`` pieces of ``length`` under the split rule."""
    base, extra = divmod(length, parts)
    return tuple(i * base + min(i, extra) for i in range(parts))


@lru_cache(maxsize=16384)
def local_shape_and_offset(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    coordinate: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset at ``coordinate``; nested shards split in mesh-dim order."""
    shape = list(global_shape)
    offset = [0] * len(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            size, start = split_range(shape[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
            shape[p.dim] = size
            offset[p.dim] += start
    return tuple(shape), tuple(offset)


def compute_local_shape_and_offset(
    global_shape: Sequence[int],
    device_mesh: "DeviceMesh",
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local_shape, global_offset)`` of the piece at ``coordinate`` (this rank's when None).

    A rank outside the mesh (coordinate None) holds an empty piece: zeros in every dim.
    """
    from .placement import normalize_placements

    global_shape = tuple(int(s) for s in global_shape)
    placements = normalize_placements(placements, device_mesh.ndim, len(global_shape))
    if coordinate is None:
        coordinate = device_mesh.get_coordinate()
        if coordinate is None:
            return tuple(0 for _ in global_shape), tuple(0 for _ in global_shape)
    coord = tuple(int(c) for c in coordinate)
    if len(coord) != device_mesh.ndim or any(
        not 0 <= c < n for c, n in zip(coord, device_mesh.shape)
    ):
        raise ValueError(f"coordinate {coord} is not a coordinate of mesh shape {device_mesh.shape}")
    return local_shape_and_offset(global_shape, device_mesh.shape, placements, coord)
