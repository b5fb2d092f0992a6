"""DimMaps: how each operator family relates its inputs' tensor dims to the output's."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod


class _DimMapDefaults:
    """What most ops answer: nothing broadcasts, no fixed dims, no Replicate input to slice."""

    def stretched(self, i: int, dim: int) -> bool:
        return False

    def in_dim(self, i: int, out_dim: int) -> int | None:
        return None

    def fixed(self, i: int, dim: int) -> int | None:
        return None

    def out_fixed(self, dim: int) -> int | None:
        return None


@dataclass(frozen=True)
class BroadcastMap(_DimMapDefaults):
    """Elementwise ops: dims aligned from the right (NumPy broadcasting)."""

    in_shapes: tuple[tuple[int, ...] | None, ...]
    out_shape: tuple[int, ...]

    def _offset(self, i: int) -> int:
        shape = self.in_shapes[i]
        return len(self.out_shape) - (len(shape) if shape is not None else 0)

    def to_out(self, i: int, dim: int) -> int | None:
        return dim + self._offset(i)

    def stretched(self, i: int, dim: int) -> bool:
        shape = self.in_shapes[i]
        assert shape is not None
        return shape[dim] == 1 and self.out_shape[dim + self._offset(i)] != 1

    def in_dim(self, i: int, out_dim: int) -> int | None:
        d = out_dim - self._offset(i)
        return d if d >= 0 else None


@dataclass(frozen=True)
class RemoveDimsMap(_DimMapDefaults):
    """Unary ops that remove (reductions) or must not split (softmax) some dims."""

    ndim: int
    removed: frozenset[int]
    keepdim: bool

    def to_out(self, i: int, dim: int) -> int | None:
        if dim in self.removed:
            return None
        return dim if self.keepdim else dim - sum(1 for r in self.removed if r < dim)



@dataclass(frozen=True)
class PermuteMap(_DimMapDefaults):
    """transpose / permute: output dim ``j`` is input dim ``perm[j]``."""

    perm: tuple[int, ...]

    def to_out(self, i: int, dim: int) -> int | None:
        return self.perm.index(dim)

    def in_dim(self, i: int, out_dim: int) -> int | None:
        return self.perm[out_dim]


@dataclass(frozen=True)
class MatmulMap:
    """``a @ b`` with NumPy's rules: 1-D operands are promoted, leading dims broadcast."""

    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    def _batch(self, i: int) -> int:
        shape = self.a_shape if i == 0 else self.b_shape
        return max(len(shape) - 2, 0)

    @property
    def _out_batch(self) -> int:
        return max(self._batch(0), self._batch(1))

    def to_out(self, i: int, dim: int) -> int | None:
        nb = self._batch(i)
        return dim + (self._out_batch - nb) if dim < nb else None

    def stretched(self, i: int, dim: int) -> bool:
        shape = self.a_shape if i == 0 else self.b_shape
        od = self.to_out(i, dim)
        return od is not None and shape[dim] == 1 and self.out_shape[od] != 1

    def in_dim(self, i: int, out_dim: int) -> int | None:
        if out_dim >= self._out_batch:
            return None
        d = out_dim - (self._out_batch - self._batch(i))
        return d if d >= 0 else None

    def fixed(self, i: int, dim: int) -> int | None:
        shape = self.a_shape if i == 0 else self.b_shape
        n = len(shape)
        if n >= 2:
            return n + dim
        # a 1-D a is [k] (its -1); a 1-D b is [k] (its -2)
        if i == 0:
            return 0 if dim == -1 else None
        return 0 if dim == -2 else None

    def out_fixed(self, dim: int) -> int | None:
        n = len(self.out_shape)
        a2, b2 = len(self.a_shape) >= 2, len(self.b_shape) >= 2
        if dim == -2:
            return (n - 2 if b2 else n - 1) if a2 else None
        return n - 1 if b2 else None


@dataclass(frozen=True)
class ReshapeMap(_DimMapDefaults):
    """reshape / view / flatten / squeeze / unsqueeze: a sharded dim survives when it keeps its
    length and the product of the dims before it (so the flat order of its chunks is kept)."""

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    def to_out(self, i: int, dim: int) -> int | None:
        before = prod(self.in_shape[:dim])
        for od, n in enumerate(self.out_shape):
            if n == self.in_shape[dim] and prod(self.out_shape[:od]) == before:
                return od
        return None



@dataclass(frozen=True)
class IndexMap(_DimMapDefaults):
    """Basic indexing: ``kept[d]`` is the output dim of input dim ``d`` when ``d`` is taken
    whole (a full slice), else None."""

    kept: tuple[int | None, ...]

    def to_out(self, i: int, dim: int) -> int | None:
        return self.kept[dim]



@dataclass(frozen=True)
class JoinMap(_DimMapDefaults):
    """cat (``new_dim=False``) and stack (``new_dim=True``) along ``axis``; the joined dim of
    ``cat`` cannot stay sharded."""

    axis: int
    new_dim: bool

    def to_out(self, i: int, dim: int) -> int | None:
        if self.new_dim:
            return dim if dim < self.axis else dim + 1
        return None if dim == self.axis else dim

