"""Shared test helpers (pure functions and constants; fixtures and the collective verdict live
in conftest.py, but for backend_meshes.py's two). Test modules import these from here, never
from another test module (importing ``test_x`` ties one test file's refactors to another's and re-executes its module body)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from conftest import SIZE, on_mesh

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.ops.signature import Pat

# every 1-d placement kind; the 2-d layouts use Partial("min") so both extrema are reduced
P1 = [dt.Shard(0), dt.Shard(1), dt.Replicate(), dt.Partial("sum"), dt.Partial("max")]
P2 = [dt.Shard(0), dt.Shard(1), dt.Replicate(), dt.Partial("sum"), dt.Partial("min")]


def integer_full(shape: tuple[int, ...], dtype: object = np.float64, seed: int = 0) -> np.ndarray:
    """Integer values in [-50, 50) as ``dtype``: sums and extrema are exact in floats."""
    return np.random.default_rng(seed).integers(-50, 50, size=shape).astype(dtype)


def _step_within(piece: np.ndarray, step: int, *, down: bool) -> np.ndarray | int:
    """``step``, cut where an integer piece would leave its dtype's range (uint8 values of 10-60
    minus 16 at 16 ranks wrapped to ~250 and became the max)."""
    if piece.dtype.kind not in "ui":
        return step
    info = np.iinfo(piece.dtype)
    room = piece.astype(np.int64) - info.min if down else info.max - piece.astype(np.int64)
    return np.minimum(room, step).astype(piece.dtype)


def make_pieces(full: np.ndarray, mesh: dt.DeviceMesh, placements: list[dt.Placement]) -> np.ndarray:
    """This rank's piece, with Partial terms that differ per coordinate and reduce to ``full``."""
    shape, off = dt.compute_local_shape_and_offset(full.shape, mesh, placements)
    piece = full[tuple(slice(o, o + n) for o, n in zip(off, shape))].copy()
    coord = mesh.get_coordinate()
    for k, p in enumerate(placements):
        if not isinstance(p, dt.Partial):
            continue
        c, m = coord[k], mesh.shape[k]
        if p.reduce_op == "sum":
            piece = piece - sum(range(1, m)) if c == 0 else np.full_like(piece, c)
        elif p.reduce_op == "max":
            piece = piece if c == 0 else piece - _step_within(piece, c + 1, down=True)
        elif p.reduce_op == "min":
            piece = piece if c == 0 else piece + _step_within(piece, c + 1, down=False)
    return on_mesh(mesh, np.ascontiguousarray(piece.astype(full.dtype)))


def local_of(full: np.ndarray, mesh: dt.DeviceMesh, placements: list[dt.Placement]) -> np.ndarray:
    """The block of ``full`` this rank holds under ``placements`` (Partial: the whole block)."""
    shape, off = dt.compute_local_shape_and_offset(full.shape, mesh, placements)
    return full[tuple(slice(o, o + n) for o, n in zip(off, shape))]


def numeric_grad(f: Callable[..., np.ndarray], arrays: Sequence[np.ndarray], i: int,
                 cot: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d sum(f(arrays) * cot) / d arrays[i] by central differences in float64."""
    base = [a.astype(np.float64).copy() for a in arrays]
    grad = np.zeros_like(base[i])
    flat = grad.reshape(-1)
    for j in range(base[i].size):
        plus = [a.copy() for a in base]
        minus = [a.copy() for a in base]
        plus[i].reshape(-1)[j] += eps
        minus[i].reshape(-1)[j] -= eps
        flat[j] = (np.sum(f(*plus) * cot) - np.sum(f(*minus) * cot)) / (2 * eps)
    return grad


def full_value(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Small integer values as float64 (a checkpoint's round trip must return them exactly)."""
    return np.random.default_rng(seed).integers(-9, 9, size=shape).astype(np.float64)


def patch_bytes(path: str, name: str, edit: Callable[[bytearray], Any]) -> None:
    """Edit HDF5 dataset ``name``'s stored bytes in place (found with ``get_offset``)."""
    import h5py  # only the checkpoint tests need it

    with h5py.File(path, "r") as f:
        offset, size = f[name].id.get_offset(), f[name].id.get_storage_size()
    with open(path, "r+b") as fh:
        fh.seek(offset)
        data = bytearray(fh.read(size))
        edit(data)
        fh.seek(offset)
        fh.write(bytes(data))


# --- the operator and operator-backward suites (test_ops.py, test_autograd.py) -------------------
def dist(full: np.ndarray, mesh: dt.DeviceMesh, placements: list[dt.Placement]) -> dt.DTensor:
    pieces = make_pieces(full, mesh, placements)
    if any(isinstance(p, dt.Partial) and p.reduce_op == "avg" for p in placements):
        pieces = dt.distribute_tensor(full, mesh, placements).to_local()
    return dt.DTensor.from_local(pieces, mesh, placements, shape=full.shape)


def placement_for(pat: Pat, ndim: int, d: int) -> list[dt.Placement] | None:
    """The concrete placement(s) a pattern stands for, given the chosen dim ``d``."""
    if pat.kind == "R":
        return [dt.Replicate()]
    if pat.kind == "P":
        return [dt.Partial(str(pat.arg))]
    if isinstance(pat.arg, int):
        return [dt.Shard(ndim + pat.arg)] if ndim + pat.arg >= 0 else None
    return [dt.Shard(d)] if 0 <= d < ndim else None


def assert_all_rules_ran(hits: set, ops: list[str]) -> None:
    missing = [(op, i, r) for op in ops for i, r in enumerate(dt.signature(op).rules)
               if (op, i) not in hits]
    assert not missing, "rules never exercised: " + "; ".join(f"{op}[{i}] {r!r}" for op, i, r in missing)


MATMUL_SHAPES = [((SIZE + 2, 4), (4, 3)), ((4, SIZE + 1), (SIZE + 1, 2)), ((2, SIZE + 1, 4), (4, 3)),
                 ((2, 3, 4), (2, 4, SIZE)), ((SIZE + 2, 4), (4,)), ((4,), (4, SIZE + 1)), ((0, 3), (3, 2))]



def a_writing_rank() -> int:
    """A rank that calls the checkpoint writer's ``_write_slab`` in a save: the last with MPI
    in h5py (every rank writes collectively), else rank 0 (each node's lowest rank writes its
    node's pieces: checkpoint/funnel.py)."""
    return SIZE - 1 if dt.has_parallel_hdf5() else 0


class Branches(nn.Module):
    """Two ``Linear(4, 3)`` branches summed; ``order`` is the caller's choice of which run and
    in what order: ``"ab"``, ``"ba"`` or ``"a"`` (``b`` left out of the forward)."""

    def __init__(self, mesh: dt.DeviceMesh) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3, device_mesh=mesh, dtype=np.float64)
        self.b = nn.Linear(4, 3, device_mesh=mesh, dtype=np.float64)
        self.order = "ab"

    def forward(self, x: dt.DTensor) -> dt.DTensor:
        first, *rest = (getattr(self, name)(x) for name in self.order)
        return first + rest[0] if rest else first
