"""Running a redistribute plan on the local piece: blocking, or as a chain of nonblocking steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..comm import Group, Work, backend_for, completed
from ..comm.layout import with_dim
from ..mesh import DeviceMesh
from ..placement import Partial, Placement, Shard
from ..split import chunk_at_mesh_dim, split_range, split_sizes
from .planner import Step


def array_namespace(device_type: str) -> Any:
    if device_type == "cuda":
        import cupy

        return cupy
    import numpy

    return numpy


def run_step(
    step: Step,
    x: Any,
    mesh: DeviceMesh,
    global_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    async_op: bool,
) -> Work:
    """Apply one step to local piece ``x`` (whose current placements are ``placements``)."""
    k = step.mesh_dim
    coord = mesh.get_coordinate()
    assert coord is not None
    m = mesh.shape[k]
    me = coord[k]
    xp = array_namespace(mesh.device_type)
    src, dst = step.src, step.dst
    kind = step.kind
    if kind == "slice":
        assert isinstance(dst, Shard)
        size, start = split_range(x.shape[dst.dim], m, me)
        return completed(x[(slice(None),) * dst.dim + (slice(start, start + size),)])
    if kind == "to_partial":
        assert isinstance(dst, Partial)
        if dst.reduce_op == "sum" and me != 0:
            return completed(xp.zeros_like(x))
        return completed(x)
    group = Group(mesh.get_group(k), k)
    backend = backend_for(mesh.device_type)
    if kind == "all_gather":
        assert isinstance(src, Shard)
        d = src.dim
        length, _ = chunk_at_mesh_dim(global_shape, mesh.shape, placements, coord, k, d)
        out = xp.empty(with_dim(x.shape, d, length), dtype=x.dtype)
        return backend.all_gather(group, x, out, d, split_sizes(length, m), async_op)
    if kind == "all_to_all":
        assert isinstance(src, Shard) and isinstance(dst, Shard)
        d, e = src.dim, dst.dim
        length, _ = chunk_at_mesh_dim(global_shape, mesh.shape, placements, coord, k, d)
        concat_sizes = split_sizes(length, m)
        send_sizes = split_sizes(x.shape[e], m)
        out = xp.empty(with_dim(with_dim(x.shape, d, length), e, send_sizes[me]), dtype=x.dtype)
        return backend.all_to_all(group, x, out, e, send_sizes, d, concat_sizes, async_op)
    assert isinstance(src, Partial)
    if kind == "all_reduce":
        out = xp.empty(x.shape, dtype=x.dtype)
        return backend.all_reduce(group, x, out, src.reduce_op, async_op)
    assert isinstance(dst, Shard)
    sizes = split_sizes(x.shape[dst.dim], m)
    out = xp.empty(with_dim(x.shape, dst.dim, sizes[me]), dtype=x.dtype)
    return backend.reduce_scatter(group, x, out, dst.dim, sizes, src.reduce_op, async_op)


def _with_placement(
    placements: tuple[Placement, ...], k: int, p: Placement
) -> tuple[Placement, ...]:
    return placements[:k] + (p,) + placements[k + 1 :]


def run_plan(
    x: Any,
    steps: tuple[Step, ...],
    mesh: DeviceMesh,
    global_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> Any:
    """Run every step with blocking collectives; return the new local piece."""
    if mesh.get_coordinate() is None:
        return x
    for step in steps:
        x = run_step(step, x, mesh, global_shape, placements, False).wait()
        placements = _with_placement(placements, step.mesh_dim, step.dst)
    return x


class PlanHandle:
    """A plan running on nonblocking collectives.

    Each communicating step is started as soon as the previous one has finished; ``done()``
    polls (and starts the next step), ``wait()`` finishes the whole plan and returns the new
    local piece. Local steps (slices) run immediately.
    """

    def __init__(
        self,
        x: Any,
        steps: tuple[Step, ...],
        mesh: DeviceMesh,
        global_shape: tuple[int, ...],
        placements: tuple[Placement, ...],
    ) -> None:
        self._mesh = mesh
        self._shape = global_shape
        self._x = x
        self._work: Work | None = None
        self._steps: Iterator[tuple[Step, tuple[Placement, ...]]] = iter(())
        if mesh.get_coordinate() is not None:
            staged = []
            for step in steps:
                staged.append((step, placements))
                placements = _with_placement(placements, step.mesh_dim, step.dst)
            self._steps = iter(staged)
        self._advance()

    def _advance(self) -> bool:
        while True:
            if self._work is not None:
                if not self._work.done():
                    return False
                self._x = self._work.wait()
                self._work = None
            nxt = next(self._steps, None)
            if nxt is None:
                return True
            step, placements = nxt
            self._work = run_step(step, self._x, self._mesh, self._shape, placements, True)

    def done(self) -> bool:
        return self._advance()

    def wait(self) -> Any:
        while not self._advance():
            assert self._work is not None
            self._work.wait()
        return self._x
