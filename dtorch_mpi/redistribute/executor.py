"""Running a redistribute plan on the local piece: compiled once per (source spec, target
placements), then run with blocking collectives or as a chain of nonblocking steps."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from math import prod
from typing import TYPE_CHECKING, Any

from ..arrays import array_namespace
from ..comm import Backend, Group, Handle, backend_for, completed, pool
from ..comm.mpi_backend import free_cached_types
from ..comm.work import before_collective
from ..mesh import cached_per_mesh, release_on_free
from ..placement import Placement
from ..split import local_shape_and_offset, split_range, split_sizes
from .planner import StepKind, exchanges_directly, plan_redistribute
from .traffic import exchange_layout

if TYPE_CHECKING:
    from ..spec import DTensorSpec


def _with_placement(
    placements: tuple[Placement, ...], k: int, p: Placement
) -> tuple[Placement, ...]:
    return placements[:k] + (p,) + placements[k + 1 :]


@dataclass(frozen=True)
class CompiledStep:
    """One step with everything precomputed from the split rule (no per-call arithmetic);
    ``run`` is its kind's runner (:class:`_StepRule`), looked up once at compile time."""

    kind: StepKind
    group: Group | None
    args: tuple[Any, ...]
    out_shape: tuple[int, ...]
    run: "Callable[[CompiledStep, Any, Any, Backend, bool], Handle]" = field(repr=False, compare=False)
    empty: Callable[[], Any] = field(repr=False, compare=False)  # a new output buffer (comm/pool.py)
    digest: list[int | None] = field(default_factory=lambda: [None], repr=False, compare=False)
    """The divergence check's digest of this step's call, kept at its first check (the call is
    the same every time the step runs: comm/prologue.py)."""


@dataclass(frozen=True)
class CompiledPlan:
    out_spec: "DTensorSpec"
    steps: tuple[CompiledStep, ...]
    xp: Any = field(repr=False, compare=False)  # the mesh's array module

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


def _collective(kind: StepKind) -> Callable[[CompiledStep, Any, Any, Backend, bool], Handle]:
    """The runner calling the backend collective named ``kind``, into a buffer of the step's
    output shape (reused across calls once nobody holds the previous one: comm/pool.py)."""
    name = kind.value

    def run(step: CompiledStep, x: Any, xp: Any, backend: Backend, async_op: bool) -> Handle:
        call = getattr(backend, name)
        return call(step.group, x, step.empty(), *step.args, async_op=async_op,  # type: ignore[no-any-return]
                    digest=step.digest)

    return run


def _cut(step: CompiledStep, x: Any, xp: Any) -> Any:
    """The piece a Replicate -> Shard step keeps, in a buffer of its own when it is smaller than
    ``x``: a view would keep the whole of ``x`` alive (a sharded parameter would hold the
    complete one). The whole of ``x`` is ``x`` itself (nothing to copy)."""
    index, smaller = step.args
    if not smaller:
        return x
    out = step.empty()
    out[...] = x[index]
    return out


_STEPS: dict[StepKind, _StepRule] = {
    StepKind.SLICE: _StepRule(
        lambda src, dst, shape, out, m, me: (
            (slice(None),) * dst.dim + (slice(*_bounds(split_range(shape[dst.dim], m, me))),), out != shape),
        lambda step, x, xp, backend, async_op: completed(_cut(step, x, xp))),
    StepKind.TO_PARTIAL: _StepRule(  # the value at coordinate 0, the op's zero elsewhere for sum
        lambda src, dst, shape, out, m, me: (dst.reduce_op == "sum" and me != 0,),
        lambda step, x, xp, backend, async_op: completed(xp.zeros_like(x) if step.args[0] else x)),
    StepKind.ALL_GATHER: _StepRule(
        lambda src, dst, shape, out, m, me: (src.dim, split_sizes(out[src.dim], m)),
        _collective(StepKind.ALL_GATHER)),
    StepKind.ALL_TO_ALL: _StepRule(
        lambda src, dst, shape, out, m, me: (
            dst.dim, split_sizes(shape[dst.dim], m), src.dim, split_sizes(out[src.dim], m)),
        _collective(StepKind.ALL_TO_ALL)),
    StepKind.ALL_REDUCE: _StepRule(
        lambda src, dst, shape, out, m, me: (src.reduce_op,),
        _collective(StepKind.ALL_REDUCE)),
    StepKind.REDUCE_SCATTER: _StepRule(
        lambda src, dst, shape, out, m, me: (dst.dim, split_sizes(shape[dst.dim], m), src.reduce_op),
        _collective(StepKind.REDUCE_SCATTER)),
}


def _exchanges(spec: "DTensorSpec", target: tuple[Placement, ...]) -> bool:
    """Whether the plan is one whole-mesh exchange (planner.exchanges_directly): for a
    non-empty tensor on a backend that has the exchange (a fact of the mesh, so every rank
    agrees); otherwise the per-dim plan."""
    backend = backend_for(spec.mesh.device_type)
    return (spec.mesh.ndim > 1 and prod(spec.shape) > 0 and exchanges_directly(spec.placements, target)
            and hasattr(getattr(backend, "inner", backend), "exchange"))


def compile_plan(spec: "DTensorSpec", target: tuple[Placement, ...]) -> CompiledPlan:
    """The redistribute from ``spec`` to ``target`` placements, compiled for this rank and
    cached on (source spec, target placements) in the spec's mesh (``mesh._plans``): metadata
    only. Specs compare their meshes by object, and ``DeviceMesh.free()`` empties that mesh's
    cache, so a plan (and the communicators it holds) serves only the live mesh it was
    compiled for, while other meshes keep theirs."""
    return spec.mesh._plans(spec, target)  # type: ignore[no-any-return]


@cached_per_mesh("_plans", maxsize=4096)
def _compile_plan(spec: "DTensorSpec", target: tuple[Placement, ...]) -> CompiledPlan:
    mesh = spec.mesh
    coord = mesh.get_coordinate()  # raises for a freed mesh
    out_spec = spec.with_placements(target)
    xp = array_namespace(mesh.device_type)
    if coord is None:
        return CompiledPlan(out_spec, (), xp)
    placements = spec.placements
    shape = spec.local_shape
    if _exchanges(spec, target):
        layout = exchange_layout(spec.shape, mesh.shape, placements, target, coord)
        out_shape = out_spec.local_shape
        shared = (spec.shape, placements, target)  # the same on every rank: the divergence check's facts
        only = CompiledStep(StepKind.EXCHANGE, Group(mesh.get_comm(), None), (layout, shared), out_shape,
                            _collective(StepKind.EXCHANGE), pool.allocator(xp, out_shape, spec.dtype))
        return CompiledPlan(out_spec, (only,), xp)
    compiled = []
    for step in plan_redistribute(placements, target):
        k, m, me = step.mesh_dim, mesh.shape[step.mesh_dim], coord[step.mesh_dim]
        after = _with_placement(placements, k, step.dst)
        out_shape = local_shape_and_offset(spec.shape, mesh.shape, after, coord)[0]
        group = Group(mesh.get_group(k), k) if step.communicates else None
        rule = _STEPS[step.kind]
        args = rule.args(step.src, step.dst, shape, out_shape, m, me)
        compiled.append(CompiledStep(step.kind, group, args, out_shape, rule.run,
                                     pool.allocator(xp, out_shape, spec.dtype)))
        placements, shape = after, out_shape
    return CompiledPlan(out_spec, tuple(compiled), xp)


release_on_free(pool.clear)  # pooled buffers may hold a freed mesh's pieces' memory
release_on_free(free_cached_types)  # and the datatypes cached for its layouts go with them


def run_compiled_step(step: CompiledStep, x: Any, xp: Any, backend: Backend, async_op: bool) -> Handle:
    """Start one step on the local piece ``x`` (a local step is finished at once)."""
    return step.run(step, x, xp, backend, async_op)


def run_compiled(x: Any, plan: CompiledPlan, *, operand: bool = False) -> Any:
    """Run a compiled plan with blocking collectives; return the new local piece.

    ``operand=True``: the piece is an operator's transient input (a Replicate operand cut to
    the other operand's Shard), dropped once the kernel ran, while its source stays alive with
    its DTensor: a local cut is then a view (no copy; the owned-bytes rule is for pieces that
    outlive the call, a redistribute's result)."""
    steps = plan.steps
    if not steps:
        return x
    mesh = plan.out_spec.mesh
    mesh._check_alive()  # a plan compiled before the mesh was freed
    xp, backend = plan.xp, backend_for(mesh.device_type)
    for step in steps:
        if operand and step.kind is StepKind.SLICE:
            x = x[step.args[0]]
        else:
            x = step.run(step, x, xp, backend, False).wait()
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
        self._xp, self._backend = plan.xp, backend_for(mesh.device_type)
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
    if _starting or not _UNSTARTED:  # nothing queued (every plain collective); or a step being
        return  # started here reaches before_collective again
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


before_collective(partial(start_queued, True))  # (block=True; a partial adds no Python frame)
