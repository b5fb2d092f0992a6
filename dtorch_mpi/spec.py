"""DTensorSpec: the metadata of a DTensor (mesh, placements, global shape, dtype); hashable."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from .mesh import DeviceMesh
from .placement import Placement
from .split import local_shape_and_offset


@dataclass(frozen=True, eq=False)
class DTensorSpec:
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    @cached_property
    def local_shape_and_offset(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        coord = self.mesh.get_coordinate()
        if coord is None:
            zeros = tuple(0 for _ in self.shape)
            return zeros, zeros
        return local_shape_and_offset(self.shape, self.mesh.shape, self.placements, coord)

    @cached_property
    def plans(self) -> dict[Any, Any]:
        """Compiled redistribute plans from this spec, by target placements as the caller
        spelled them (``DTensor.redistribute``'s memo: a repeated redistribute is one dict
        lookup, with no normalising and no spec hashing)."""
        return {}

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.local_shape_and_offset[0]

    @cached_property
    def _hash(self) -> int:
        return hash((id(self.mesh), self.placements, self.shape, self.dtype))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        """Specs are equal on the same mesh *object*: cached plans hold their mesh's
        communicators, so a plan must never be reused for another (perhaps freed) mesh."""
        return (isinstance(other, DTensorSpec) and self.mesh is other.mesh
                and self.placements == other.placements and self.shape == other.shape
                and self.dtype == other.dtype)

    def with_placements(self, placements: tuple[Placement, ...]) -> "DTensorSpec":
        return DTensorSpec(self.mesh, placements, self.shape, self.dtype)
