"""Running a redistribute plan on the local piece: compiled once per (source spec, target
placements), then run with blocking collectives or as a chain of nonblocking steps."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ..comm import Backend, Group, Handle, backend_for, completed, pool
from ..comm.work import before_collective
from ..mesh import release_on_free
from ..placement import Placement
from ..split import local_shape_and_offset, split_range, split_sizes
from .planner import StepKind, plan_redistribute

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

    kind: StepKind
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


Shape = tuple[int, ...]


@dataclass(frozen=True)
class _StepRule:
    """How a step kind is compiled and run: ``args(src, dst, shape, out_shape, m, me)`` from
    the split rule (``shape``/``out_shape``: the local piece before and after, ``m`` ranks
    along the mesh dim, ``me`` this rank's coordinate there), then
    ``run(step, x, xp, backend, async_op)`` on the local piece ``x`` (``xp``: its array module)."""

    args: Callable[[Any, Any, Shape, Shape, int, int], tuple[Any, ...]]
    run: Callable[[CompiledStep, Any, Any, Backend, bool], Handle]


def _bounds(size_start: tuple[int, int]) -> tuple[int, int]:
    size, start = size_start
    return start, start + size


def _collective(step: CompiledStep, x: Any, xp: Any, backend: Backend, async_op: bool) -> Handle:
    """The backend collective named by the step kind, into a buffer of the step's output shape
    (reused across calls once nobody holds the previous one: comm/pool.py)."""
    call = getattr(backend, step.kind.value)
    return call(step.group, x, pool.empty(xp, step.out_shape, x.dtype), *step.args, async_op=async_op)  # type: ignore[no-any-return]


_STEPS: dict[StepKind, _StepRule] = {
    StepKind.SLICE: _StepRule(
        lambda src, dst, shape, out, m, me: (
            (slice(None),) * dst.dim + (slice(*_bounds(split_range(shape[dst.dim], m, me))),),),
        lambda step, x, xp, backend, async_op: completed(x[step.args[0]])),
    StepKind.TO_PARTIAL: _StepRule(  # the value at coordinate 0, the op's zero elsewhere for sum
        lambda src, dst, shape, out, m, me: (dst.reduce_op == "sum" and me != 0,),
        lambda step, x, xp, backend, async_op: completed(xp.zeros_like(x) if step.args[0] else x)),
    StepKind.ALL_GATHER: _StepRule(
        lambda src, dst, shape, out, m, me: (src.dim, split_sizes(out[src.dim], m)),
        _collective),
    StepKind.ALL_TO_ALL: _StepRule(
        lambda src, dst, shape, out, m, me: (
            dst.dim, split_sizes(shape[dst.dim], m), src.dim, split_sizes(out[src.dim], m)),
        _collective),
    StepKind.ALL_REDUCE: _StepRule(
        lambda src, dst, shape, out, m, me: (src.reduce_op,),
        _collective),
    StepKind.REDUCE_SCATTER: _StepRule(
        lambda src, dst, shape, out, m, me: (dst.dim, split_sizes(shape[dst.dim], m), src.reduce_op),
        _collective),
}


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
        group = Group(mesh.get_group(k), k) if step.communicates else None
        args = _STEPS[step.kind].args(step.src, step.dst, shape, out_shape, m, me)
        compiled.append(CompiledStep(step.kind, group, args, out_shape))
        placements, shape = after, out_shape
    return CompiledPlan(out_spec, tuple(compiled))


release_on_free(compile_plan.cache_clear)
release_on_free(pool.clear)


def run_compiled_step(step: CompiledStep, x: Any, xp: Any, backend: Backend, async_op: bool) -> Handle:
    """Start one step on the local piece ``x`` (a local step is finished at once)."""
    return _STEPS[step.kind].run(step, x, xp, backend, async_op)


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
    """A compiled plan on nonblocking collectives; ``wait()`` returns the new local piece,
    ``done()`` polls.

    The first step starts at once. A later step needs the previous one's result, so it starts
    later, and MPI requires every rank to start collectives on a communicator in one order.
    So later steps go to one queue (:data:`_UNSTARTED`, handles in creation order) and start
    only in queue order: opportunistically in ``done()`` (while the head's current step has
    finished here), and all of them, waiting as needed, before any other collective starts
    (``before_collective``) and in ``wait()``. Every rank thus starts them after the same
    collectives and before the same next one, whenever its own ``done()`` calls happen."""

    def __init__(self, x: Any, plan: CompiledPlan) -> None:
        mesh = self._mesh = plan.out_spec.mesh
        self._xp, self._backend = array_namespace(mesh.device_type), backend_for(mesh.device_type)
        self._x = x
        self._steps = list(plan.steps)
        self._work: Handle | None = None
        if self._steps:
            self._start_next()
        if self._steps:
            _UNSTARTED.append(self)

    def _start_next(self) -> None:
        if self._work is not None:
            self._x = self._work.wait()
        self._mesh._check_alive()  # the mesh was freed while this handle was pending
        self._work = run_compiled_step(self._steps.pop(0), self._x, self._xp, self._backend, True)

    def done(self) -> bool:
        start_queued(block=False)
        return not self._steps and (self._work is None or self._work.done())

    def wait(self) -> Any:
        if self._steps:
            start_queued(block=True, upto=self)
        if self._work is not None:
            self._x = self._work.wait()
            self._work = None
        return self._x


_UNSTARTED: deque[CompiledHandle] = deque()
_starting = False


def start_queued(block: bool, upto: CompiledHandle | None = None) -> None:
    """Start queued later steps in queue order: ``block=False`` stops at the first whose
    previous step has not finished here; ``block=True`` waits for those, up to ``upto``'s last
    step (or the whole queue)."""
    global _starting
    if _starting:  # a step being started here reaches before_collective again
        return
    _starting = True
    try:
        while _UNSTARTED:
            head = _UNSTARTED[0]
            if not block and head._work is not None and not head._work.done():
                return
            try:
                head._start_next()
            except BaseException:
                _UNSTARTED.popleft()  # a failed handle (e.g. its mesh was freed) leaves the queue
                raise
            if not head._steps:
                _UNSTARTED.popleft()
                if head is upto:
                    return
    finally:
        _starting = False


before_collective(lambda: start_queued(block=True))
