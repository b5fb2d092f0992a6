"""DimMaps: how each operator family relates its inputs' tensor dims to the output's."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from math import prod
from typing import Any

from ..placement import Replicate, Shard
from ..split import local_shape_and_offset


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
    """reshape / view / flatten / squeeze / unsqueeze. A sharded dim survives as the output dim
    that starts the same block of the flat order: the dim itself when it keeps its length and
    the product of the dims before it, else the outermost output dim of its group (the
    shortest runs of input and output dims with equal products) when it is the outermost
    input dim of that group (a split ``[B, T, 12] -> [B, T, 4, 3]`` or a merge
    ``[B, T, 4, 3] -> [B, T, 12]``) and every rank's piece, under the split rule and the
    sharding of ``placements`` on a mesh of ``mesh_shape``, is the piece the output's Shard
    gives it (whole heads per rank). Metadata only: every rank decides the same."""

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...] = ()
    placements: tuple[Any, ...] = ()

    def group(self, dim: int) -> tuple[int, int, int, int] | None:
        """``(a, b, c, e)``: input dims ``a..b-1`` hold the same elements as output dims
        ``c..e-1``, the shortest such runs containing input ``dim`` (None for a 0-size shape)."""
        if 0 in self.in_shape or 0 in self.out_shape:
            return None
        pre_in = [prod(self.in_shape[:i]) for i in range(len(self.in_shape) + 1)]
        pre_out = [prod(self.out_shape[:j]) for j in range(len(self.out_shape) + 1)]
        common = sorted(set(pre_in) & set(pre_out))
        start = max(v for v in common if v <= pre_in[dim])
        end = min(v for v in common if v >= pre_in[dim + 1] and v > start)
        a = max(i for i in range(dim + 1) if pre_in[i] == start)
        b = min(i for i in range(dim + 1, len(pre_in)) if pre_in[i] == end)
        c = min(j for j in range(len(pre_out)) if pre_out[j] == start
                and (j == len(self.out_shape) or self.out_shape[j] != 1))
        e = min(j for j in range(c + 1, len(pre_out)) if pre_out[j] == end)
        return a, b, c, e

    def to_out(self, i: int, dim: int) -> int | None:
        before = prod(self.in_shape[:dim])
        for od, n in enumerate(self.out_shape):
            if n == self.in_shape[dim] and prod(self.out_shape[:od]) == before:
                return od
        g = self.group(dim)
        if g is None or g[0] != dim or not self.pieces_map(dim, g[2], g):
            return None
        return g[2]

    def pieces_map(self, dim: int, od: int, g: tuple[int, int, int, int]) -> bool:
        """Every rank's piece of input ``dim`` covers the same flat block of the group as its
        piece of output ``od`` would (the other dims of the group unsharded)."""
        a, b = g[:2]
        if any(isinstance(p, Shard) and p.dim in range(a + 1, b) for p in self.placements):
            return False
        mine, theirs = self.block_pieces(dim, od, g)
        return mine == theirs

    def block_pieces(self, dim: int, od: int, g: tuple[int, int, int, int]) -> tuple[list[tuple[int, int]], ...]:
        """Per mesh coordinate, the (length, start) in elements of the group's flat block of
        the piece input ``dim`` gives, and of the piece ``Shard(od)`` of the output would give."""
        b, e = g[1], g[3]
        out_placements = tuple(Shard(od) if p == Shard(dim) else Replicate() for p in self.placements)
        inner_in, inner_out = prod(self.in_shape[dim + 1 : b]), prod(self.out_shape[od + 1 : e])
        mine, theirs = [], []
        for coord in product(*(range(m) for m in self.mesh_shape)):
            n_in, o_in = _piece(self.in_shape, self.mesh_shape, self.placements, coord, dim)
            n_out, o_out = _piece(self.out_shape, self.mesh_shape, out_placements, coord, od)
            mine.append((n_in * inner_in, o_in * inner_in))
            theirs.append((n_out * inner_out, o_out * inner_out))
        return mine, theirs

    def why_not(self, dim: int) -> str | None:
        """Why a Shard of input ``dim`` has no output dim (None when it has one or the shape is
        empty): the words of the PlacementError."""
        g = self.group(dim)
        if g is None or self.to_out(0, dim) is not None:
            return None
        a, b, c, e = g
        block = f"input dims {a}..{b - 1} {self.in_shape[a:b]} become output dims {c}..{e - 1} {self.out_shape[c:e]}"
        if a != dim or any(isinstance(p, Shard) and p.dim in range(a + 1, b) for p in self.placements):
            return (f"{block}; a Shard of dim {dim}, not the outermost of them, cuts the block into "
                    f"pieces that are not contiguous in the new layout")
        mine, theirs = self.block_pieces(dim, c, g)
        return (f"{block}; each rank's piece of dim {dim} holds {'/'.join(str(n) for n, _ in mine)} "
                f"of the block's {prod(self.in_shape[a:b])} elements, but Shard({c}) of the new shape gives "
                f"{'/'.join(str(n) for n, _ in theirs)} (whole entries of dim {c}, "
                f"{prod(self.out_shape[c + 1 : e])} elements each), so the pieces would have to move")


def _piece(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Any, ...],
           coord: tuple[int, ...], dim: int) -> tuple[int, int]:
    local, offset = local_shape_and_offset(shape, mesh_shape, placements, coord)
    return local[dim], offset[dim]


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

