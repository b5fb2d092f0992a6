"""Running a redistribute plan on the local piece: compiled once per (source spec, target
placements), then run with blocking collectives or as a chain of nonblocking steps."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ..comm import Group, Work, backend_for, completed
from ..mesh import release_on_free
from ..placement import Partial, Placement, Shard
from ..split import local_shape_and_offset, split_range, split_sizes
from .planner import plan_redistribute

if TYPE_CHECKING:
    from ..spec import DTensorSpec


def array_namespace(device_type: str) -> Any:
    if device_type == "cuda":
        import cupy

        return cupy
    import numpy

    return numpy


def _with_placement(
    placements: tuple[Placement, ...], k: int, p: Placement
) -> tuple[Placement, ...]:
    return placements[:k] + (p,) + placements[k + 1 :]


@dataclass(frozen=True)
class CompiledStep:
    """One step with everything precomputed from the split rule (no per-call arithmetic)."""

    kind: str
    group: Group | None
    args: tuple[Any, ...]
    out_shape: tuple[int, ...]


@dataclass(frozen=True)
class CompiledPlan:
    out_spec: "DTensorSpec"
    steps: tuple[CompiledStep, ...]

    @property
    def communicates(self) -> bool:
        return any(s.group is not None for s in self.steps)


@lru_cache(maxsize=4096)
def compile_plan(spec: "DTensorSpec", target: tuple[Placement, ...]) -> CompiledPlan:
    """The redistribute from ``spec`` to ``target`` placements, compiled for this rank and
    cached on (source spec, target placements): metadata only. Specs compare their meshes
    by object, and ``DeviceMesh.free()`` empties this cache, so a plan (and the communicators
    it holds) serves only the live mesh it was compiled for."""
    mesh = spec.mesh
    mesh._check_alive()
    out_spec = spec.with_placements(target)
    coord = mesh.get_coordinate()
    if coord is None:
        return CompiledPlan(out_spec, ())
    placements = spec.placements
    shape = spec.local_shape
    compiled = []
    for step in plan_redistribute(placements, target):
        k, m, me = step.mesh_dim, mesh.shape[step.mesh_dim], coord[step.mesh_dim]
        after = _with_placement(placements, k, step.dst)
        out_shape = local_shape_and_offset(spec.shape, mesh.shape, after, coord)[0]
        kind = step.kind
        group = None if kind in ("slice", "to_partial") else Group(mesh.get_group(k), k)
        src, dst = step.src, step.dst
        if kind == "slice":
            assert isinstance(dst, Shard)
            size, start = split_range(shape[dst.dim], m, me)
            args: tuple[Any, ...] = ((slice(None),) * dst.dim + (slice(start, start + size),),)
        elif kind == "to_partial":
            assert isinstance(dst, Partial)
            args = (dst.reduce_op == "sum" and me != 0,)
        elif kind == "all_gather":
            assert isinstance(src, Shard)
            args = (src.dim, split_sizes(out_shape[src.dim], m))
        elif kind == "all_to_all":
            assert isinstance(src, Shard) and isinstance(dst, Shard)
            args = (dst.dim, split_sizes(shape[dst.dim], m), src.dim, split_sizes(out_shape[src.dim], m))
        elif kind == "all_reduce":
            assert isinstance(src, Partial)
            args = (src.reduce_op,)
        else:
            assert isinstance(src, Partial) and isinstance(dst, Shard)
            args = (dst.dim, split_sizes(shape[dst.dim], m), src.reduce_op)
        compiled.append(CompiledStep(kind, group, args, out_shape))
        placements, shape = after, out_shape
    return CompiledPlan(out_spec, tuple(compiled))


release_on_free(compile_plan.cache_clear)


def run_compiled_step(step: CompiledStep, x: Any, xp: Any, backend: Any, async_op: bool) -> Work:
    kind, args = step.kind, step.args
    if kind == "slice":
        return completed(x[args[0]])
    if kind == "to_partial":
        return completed(xp.zeros_like(x) if args[0] else x)
    out = xp.empty(step.out_shape, dtype=x.dtype)
    group = step.group
    assert group is not None
    if kind == "all_gather":
        return backend.all_gather(group, x, out, args[0], args[1], async_op)
    if kind == "all_to_all":
        return backend.all_to_all(group, x, out, *args, async_op)
    if kind == "all_reduce":
        return backend.all_reduce(group, x, out, args[0], async_op)
    return backend.reduce_scatter(group, x, out, *args, async_op)


def run_compiled(x: Any, plan: CompiledPlan) -> Any:
    """Run a compiled plan with blocking collectives; return the new local piece."""
    if not plan.steps:
        return x
    mesh = plan.out_spec.mesh
    mesh._check_alive()  # a plan compiled before the mesh was freed
    xp, backend = array_namespace(mesh.device_type), backend_for(mesh.device_type)
    for step in plan.steps:
        x = run_compiled_step(step, x, xp, backend, False).wait()
    return x


class CompiledHandle:
    """A compiled plan on nonblocking collectives: ``done()`` polls and starts the next step,
    ``wait()`` finishes and returns the new local piece."""

    def __init__(self, x: Any, plan: CompiledPlan) -> None:
        mesh = self._mesh = plan.out_spec.mesh
        self._xp, self._backend = array_namespace(mesh.device_type), backend_for(mesh.device_type)
        self._x = x
        self._steps = iter(plan.steps)
        self._work: Work | None = None
        self._advance()

    def _advance(self) -> bool:
        while True:
            if self._work is not None:
                if not self._work.done():
                    return False
                self._x = self._work.wait()
                self._work = None
            step = next(self._steps, None)
            if step is None:
                return True
            self._mesh._check_alive()  # the mesh was freed while this handle was pending
            self._work = run_compiled_step(step, self._x, self._xp, self._backend, True)

    def done(self) -> bool:
        return self._advance()

    def wait(self) -> Any:
        while not self._advance():
            assert self._work is not None
            self._work.wait()
        return self._x
