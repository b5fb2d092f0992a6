"""``replicate``: data parallel (PyTorch DDP / ``replicate``) with the gradient all-reduce
running during backward, on the autograd hooks.

Parameters stay ``Replicate`` on a 1-D mesh; a batch sharded over it gives every parameter a
``Partial("sum")`` gradient whose terms are already terms of the whole batch's loss (the loss
divides by the global batch size), so the all-reduce **sums** them: the result is the gradient
of the replicated single-model run on the whole batch, exactly what ``reduce_gradients`` gives
(the ``dp`` plan of examples/train_mlp.py). No extra division by the rank count.

Gradients travel in buckets of about ``bucket_bytes`` (25 MB as DDP's ``bucket_cap_mb``,
counted on global sizes so every rank cuts at the same places), each packed into one buffer and
one nonblocking all-reduce, in place (no copy of the buffer when it starts: MPICH's
``Iallreduce`` copies send into receive on the calling thread, 143-400 us per 2 MB). A bucket
of one gradient reduces the leaf's own gradient array (AccumulateGrad gives every leaf an
array of its own); a bucket of several packs them into a buffer the bucket keeps
(``pool.Kept``, outside the collective pool's cap, as DDP keeps its buckets): reused, with warm
pages, once the gradients viewing it from the last step are dropped, and never while one is
still held.

==============================  ===========================================================
point                           what happens
==============================  ===========================================================
a gradient is complete          (post-accumulate-grad hook) mark it; every bucket whose
                                gradients are all complete and whose predecessors have
                                started is packed and its all-reduce started
backward finishes               (queued callback) start the buckets still waiting (a
                                parameter unused in this backward: with
                                ``find_unused_parameters``, zeros in its place), wait for
                                all of them, set each ``.grad`` to its ``Replicate`` part of
                                the result (a parameter no rank used keeps None)
==============================  ===========================================================

Buckets start strictly in their order, so every rank starts the same collectives in the same
order whatever order its hooks fire in. The first backward uses the reverse order of the
parameters (metadata: the same on every rank); it records the order the gradients complete in
(the reverse order of use) and, at its end, every rank checks that this order is the same on
every rank (``require_same``: ``SPMDDivergenceError`` on every rank otherwise) and the buckets
are cut along it from then on. Inside ``with model.no_sync():`` the hooks do nothing: the
gradients accumulate as ``Partial`` and the first backward outside reduces the sum.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..arrays import to_host
from ..autograd.accumulate import convert_locally
from ..autograd.graph import BackwardJoin, register_hook, register_post_accumulate_grad_hook
from ..comm import Group, backend_for, pool, progress
from ..comm.divergence import call_context
from ..comm.issuer import deferred
from ..dtensor import DTensor
from ..errors import CollectiveTimeoutError, PlacementError, SPMDDivergenceError
from ..grad_mode import is_grad_enabled
from ..mesh import DeviceMesh
from ..placement import Partial, Replicate
from ..redistribute import array_namespace, compile_plan
from ..redistribute.planner import StepKind
from ..spmd import require_same
from .module import Module, Parameter
from .utils import BUCKET_BYTES
from .wrapping import agree_on_wrapping, check_module_and_dp_mesh, output_tensors


@dataclass
class _Bucket:
    """Parameters (indices into the module's list) reduced by one packed all-reduce, and the
    collectives started for them in the running backward."""

    params: list[int]
    waiting: int = 0  # gradients not yet complete in this backward
    started: bool = False
    flights: list[tuple[list[tuple[int, Any]], Any, Any]] = field(default_factory=list)  # (items, work, out)
    buffers: dict[tuple[Any, ...], pool.Kept] = field(default_factory=dict)  # per (op, dtype, mesh dim) packed


def _cut(order: list[int], params: list[Parameter], bucket_bytes: int) -> list[_Bucket]:
    """Buckets of consecutive parameters of ``order``, each at most ``bucket_bytes`` (global
    sizes) unless one parameter alone is larger (0: one per parameter)."""
    buckets: list[_Bucket] = []
    size = 0
    for i in order:
        n = math.prod(params[i].shape) * params[i].dtype.itemsize
        if not buckets or (buckets[-1].params and size + n > bucket_bytes):
            buckets.append(_Bucket([]))
            size = 0
        buckets[-1].params.append(i)
        size += n
    return buckets


class _Replicated:
    """The bucket layout and the running backward's reduction state of one module."""

    def __init__(self, module: Module, mesh: DeviceMesh, params: list[Parameter], bucket_bytes: int,
                 names: list[str], find_unused: bool, title: str) -> None:
        self.module, self.mesh, self.params, self.bucket_bytes = module, mesh, params, bucket_bytes
        self.names = names  # each parameter's name in the module (what the divergence check shows)
        self.rank = mesh.get_comm().Get_rank()
        self.title = title  # "replicate #n (Class)": which wrapper on the mesh (the divergence check)
        self.find_unused = find_unused  # a parameter without a gradient here adds zeros to its bucket
        self.absent: set[int] = set()  # parameters no rank had a gradient for in this backward (find_unused)
        self.holder: list[int] = []  # per parameter, the least rank holding a Replicate gradient (find_unused)
        self.agreed_order: list[int] = []  # rank 0's completion order, agreed with the terms (find_unused, first backward)
        self.raised: BaseException | None = None  # what the last backward's end raised
        self.fixed = False  # the layout follows an observed order checked across ranks
        self.buckets = _cut(list(range(len(params)))[::-1], params, bucket_bytes)
        self.bucket_of = self._index()
        self.seen: list[int] = []  # completion order in this backward
        self.ready: set[int] = set()
        self.next = 0  # first bucket not started
        self.backward = BackwardJoin()
        self.syncing = True

    def _index(self) -> dict[int, int]:
        return {i: b for b, bucket in enumerate(self.buckets) for i in bucket.params}

    def layout(self) -> list[list[int]]:
        return [b.params for b in self.buckets]

    # --- during backward ----------------------------------------------------------------
    def join_backward(self) -> None:
        if self.backward.join(self.discard, self.finish):
            for b in self.buckets:
                b.waiting, b.started, b.flights = len(b.params), False, []
            self.seen, self.ready, self.next, self.absent, self.holder = [], set(), 0, set(), []

    def output_reached(self, _grad: Any) -> None:
        """(``find_unused_parameters``) The backward reached the module's output: join it, so
        its end reduces this rank's zeros even where it reaches no parameter."""
        if self.syncing:
            self.join_backward()

    def grad_complete(self, i: int) -> None:
        if not self.syncing:
            return
        self.join_backward()
        if i in self.ready:
            return
        self.ready.add(i)
        self.seen.append(i)
        self.buckets[self.bucket_of[i]].waiting -= 1
        if self.find_unused:  # every bucket starts at the end (finish): see replicate()
            return
        while self.next < len(self.buckets) and self.buckets[self.next].waiting == 0:
            self.start(self.buckets[self.next], last=self.next == len(self.buckets) - 1)
            self.next += 1
        if progress.progress_mode() == "off":  # (else the progress thread advances them during compute)
            for bucket in self.buckets[:self.next]:  # a Test each: MPI progresses, completions are seen early
                for _, work, out in bucket.flights:
                    if out is not None:
                        work.done()

    def start(self, bucket: _Bucket, last: bool = False) -> None:
        """Pack the bucket's gradients that need an all-reduce (one buffer per reduce op and
        dtype) and start their all-reduces, nonblocking; on the computing thread where
        ``last`` (waited for next, with no compute left to hide behind: comm/issuer.py,
        ``deferred``), else through the issue thread."""
        bucket.started = True
        runs, missing = self._every_term(bucket) if self.find_unused else self._reduced_terms(bucket)
        xp, backend = array_namespace(self.mesh.device_type), backend_for(self.mesh.device_type)
        for key, items in runs.items():
            op, dtype, _dim = key
            if self.find_unused:  # every parameter's term, zeros where it has no gradient here
                pieces = [self._term(i) for i, _ in items]
            else:
                pieces = [self.params[i].grad.to_local() for i, _ in items]  # type: ignore[union-attr]
            if len(pieces) == 1 and pieces[0].flags.c_contiguous:
                flat = pieces[0].reshape(-1)  # the leaf's own gradient array (AccumulateGrad): reduced where it is
            else:
                flat = bucket.buffers.setdefault(key, pool.Kept()).empty(xp, sum(x.size for x in pieces), dtype)
                xp.concatenate([x.reshape(-1) for x in pieces], out=flat)
            # the check compares which gradients the bucket holds: ranks whose forwards used
            # different parameters of equal shapes (an expert each) get an error, not a sum of
            # each other's gradients
            with call_context(self._describe(items, missing), every_size=True), deferred(beside_work=not last):
                work = backend.all_reduce(self._group(items), flat, flat, op, async_op=True)
            bucket.flights.append((items, work, flat))
        if missing and not runs:  # no gradient of the bucket here: a checked call of nothing, so a
            empty = xp.empty(0, dtype=self.params[bucket.params[0]].dtype)  # rank with one raises
            with call_context(self._describe([], missing), every_size=True):  # (and the text names the flag)
                backend.all_reduce(self._group([]), empty, empty, "sum")

    def _reduced_terms(self, bucket: _Bucket) -> tuple[dict[tuple[Any, ...], list[tuple[int, Any]]], list[str]]:
        """The bucket's gradients that need an all-reduce, by (op, dtype, mesh dim), and the
        names of its parameters without a gradient here; a gradient that needs other steps is
        redistributed now (``bucket.flights``)."""
        runs: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}
        missing: list[str] = []
        for i in bucket.params:
            p = self.params[i]
            g = p.grad
            if g is None:  # unused in this backward (on this rank)
                missing.append(self.names[i])
                continue
            steps = compile_plan(g.spec, p.placements).steps
            if not steps:
                continue
            group = steps[0].group
            if len(steps) == 1 and steps[0].kind == StepKind.ALL_REDUCE and group is not None:
                runs.setdefault((steps[0].args[0], g.dtype, group.mesh_dim), []).append((i, steps[0]))
            else:  # anything else (not made by a sharded batch): as redistribute would, now
                bucket.flights.append(([(i, None)], g.redistribute(placements=p.placements), None))
        return runs, missing

    def _every_term(self, bucket: _Bucket) -> tuple[dict[tuple[Any, ...], list[tuple[int, Any]]], list[str]]:
        """``find_unused_parameters``: every parameter of the bucket, by dtype, summed whether
        or not it has a gradient here (the ranks' buckets then match whatever each used)."""
        runs: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}
        for i in bucket.params:
            runs.setdefault(("sum", self.params[i].dtype, 0), []).append((i, None))
        return runs, []

    def _agree_terms(self) -> None:
        """(``find_unused_parameters``, before the buckets start) One all-reduce (MIN) of two
        int64 per parameter (DDP's used bitmap, and more): which parameters no rank had a
        gradient for (their ``.grad`` stays None) and, per parameter, the least rank holding a
        ``Replicate`` gradient (the one whose term counts it: see ``_term``); in the first
        backward also rank 0's completion order, which every rank's buckets follow from then
        on (ranks may use different parameters). A checked call, named by the wrapper, like
        the buckets after it: ranks whose end callbacks ran two wrappers in different orders
        get an error, not each other's bitmaps."""
        n, top = len(self.params), np.iinfo(np.int64).max
        grads = [p.grad for p in self.params]
        values = ([0 if g is None else -1 for g in grads]  # (the least of -used: -max)
                  + [self.rank if g is not None and g.placements == (Replicate(),) else top for g in grads])
        if not self.fixed:
            values += self._completion_order() if self.rank == 0 else [top] * n
        xp, backend = array_namespace(self.mesh.device_type), backend_for(self.mesh.device_type)
        mine = xp.asarray(np.array(values, dtype=np.int64))
        low = xp.empty_like(mine)
        with call_context(lambda: f"{self.title}: which parameters have a gradient (find_unused_parameters)",
                          every_size=True):
            backend.all_reduce(self._group([]), mine, low, "min")
        agreed = to_host(low).tolist()
        self.absent = {i for i in range(n) if agreed[i] == 0}
        self.holder, self.agreed_order = agreed[n:2 * n], agreed[2 * n:]

    def _completion_order(self) -> list[int]:
        """The order this backward's gradients completed in, then the parameters it did not
        reach (in reverse registration order)."""
        return self.seen + [i for i in range(len(self.params))[::-1] if i not in self.ready]

    def _term(self, i: int) -> Any:
        """Parameter ``i``'s term of the sum (``find_unused_parameters``): its gradient as
        ``Partial("sum")``; a ``Replicate`` one (the whole gradient: a parameter used on
        replicated data) counts once, on the least rank holding one, zeros elsewhere; zeros
        where it has none. (Accumulation's rule, coordinate 0, would lose a gradient only ranks
        other than 0 hold.)"""
        p, g = self.params[i], self.params[i].grad
        if g is not None and g.placements != (Replicate(),):
            return convert_locally(g, (Partial("sum"),))
        if g is not None and self.holder[i] == self.rank:
            return g.to_local()
        return array_namespace(self.mesh.device_type).zeros(p.to_local().shape, dtype=p.dtype)

    def _group(self, items: list[tuple[int, Any]]) -> Group:
        """The group the bucket's all-reduce runs on: its plan's, else the mesh's (as it is now:
        a test may trace it)."""
        return next((step.group for _, step in items if step is not None), None) or Group(self.mesh.get_group(0), 0)

    def _describe(self, items: list[tuple[int, Any]], missing: list[str]) -> Callable[[], str]:
        """The text the divergence check compares for a packed bucket (evaluated only when a
        check runs): the gradients it holds, by name, in order, and the bucket's parameters
        without a gradient here (a rank-dependent forward: the hint names the flag), after the
        wrapper's number on the mesh (siblings replicated separately hold equal names)."""
        held = f"{self.title} bucket" + (" of " + ", ".join(self.names[i] for i, _ in items) if items else "")
        unused = (f"{';' if items else ' with'} no gradient here for {', '.join(missing)} (unused in this "
                  f"backward; replicate(..., find_unused_parameters=True) reduces zeros for it)") if missing else ""
        return lambda: held + unused

    # --- backward finished ----------------------------------------------------------------
    def finish(self) -> None:
        """Start what waits, in order; wait; set every reduced ``.grad``; fix the layout after
        the first backward (checked across ranks)."""
        try:
            if self.find_unused:
                self._agree_terms()
            for bucket in self.buckets[self.next:]:
                self.start(bucket, last=True)  # (the end of backward: waited for at once)
            self.next = len(self.buckets)
            for bucket in self.buckets:
                self._land(bucket)
        except BaseException as exc:
            self.raised = exc  # (the next backward's discard does not raise it again)
            raise
        self.backward.leave()
        if not self.fixed:
            if self.find_unused:  # (rank 0's, agreed with the terms)
                order = self.agreed_order
            else:
                order = self._completion_order()
                require_same(self.mesh.get_comm(), {"order": tuple(order)},
                             what="replicate: the order gradients complete in during backward (the reverse "
                                  "order of use of the parameters; every rank must run the same forward, or "
                                  "pass find_unused_parameters=True)")
            self.buckets = _cut(order, self.params, self.bucket_bytes)
            self.bucket_of = self._index()
            self.fixed = True

    def _land(self, bucket: _Bucket) -> None:
        flights, bucket.flights = bucket.flights, []
        for items, work, out in flights:
            if out is None:  # a redistributed gradient
                (i, _), = items
                self.params[i].grad = work
                continue
            work.wait()
            at = 0
            for i, _ in items:
                p = self.params[i]
                g = p.grad
                if self.find_unused:  # (every parameter's term: the sum lands unless no rank had one)
                    shape = p.to_local().shape
                    n = math.prod(shape)
                    if i not in self.absent:
                        p.grad = DTensor(out[at:at + n].reshape(shape), p.spec)
                    at += n
                    continue
                assert g is not None
                n = math.prod(g.to_local().shape)
                p.grad = DTensor(out[at:at + n].reshape(g.to_local().shape), compile_plan(g.spec, p.placements).out_spec)
                at += n

    def discard(self) -> None:
        """A backward that raised: its all-reduces complete, the gradients stay as they were.
        The error that backward's end raised (``raised``), which its refused calls raise
        again, is not raised twice: on the ranks those calls reach it would part them from
        the others at the next backward's first hook. Any other error a flight raises (one
        the program never saw: the backward raised elsewhere first) is raised once, after
        every flight is waited for."""
        fresh: BaseException | None = None
        for bucket in self.buckets:
            flights, bucket.flights = bucket.flights, []
            for _, work, out in flights:
                if out is not None:  # an all-reduce (any handle: a traced one too)
                    try:
                        work.wait()
                    except (SPMDDivergenceError, CollectiveTimeoutError) as exc:
                        if exc is not self.raised and fresh is None:
                            fresh = exc
        self.raised = None
        self.backward.leave()
        if fresh is not None:
            raise fresh

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate their gradients unreduced (``Partial``); the first
        backward after the block reduces the sum (gradient accumulation over micro-batches)."""
        before, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = before


def _on_grad_complete(state: _Replicated, i: int) -> Any:
    return lambda _leaf: state.grad_complete(i)


def _refusal(module: Module, mesh: DeviceMesh, bucket_bytes: Any, find_unused_parameters: Any) -> Exception | None:
    """Why ``replicate`` refuses these arguments on this rank (None: it does not); agreed with
    the other ranks (``agree_on_wrapping``), so a refusal on one rank raises on every rank."""
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 0:
        return ValueError(f"replicate: bucket_bytes must be a non-negative int (bytes per bucket; 0: one "
                          f"all-reduce per gradient), got {bucket_bytes!r}")
    if not isinstance(find_unused_parameters, bool):
        return TypeError(f"replicate: find_unused_parameters must be True or False, got {find_unused_parameters!r}")
    if "_replicate_state" in module.__dict__:
        return ValueError(f"replicate was already applied to this {type(module).__name__}")
    if "_fsdp_unit" in module.__dict__:
        return ValueError("replicate: this module is fully_shard-ed; use one data-parallel wrapper")
    for name, p in module.named_parameters():
        if p.device_mesh != mesh or p.placements != (Replicate(),):
            return PlacementError(
                f"replicate: parameter {name} is placed {list(p.placements)} on {p.device_mesh!r}; replicate "
                f"takes parameters Replicate on the mesh given ({mesh!r}): build the module on that mesh")
    return None


def replicate(module: Module, *, mesh: DeviceMesh, bucket_bytes: int = BUCKET_BYTES,
              find_unused_parameters: bool = False) -> Module:
    """Data parallel over the 1-D ``mesh``: every parameter must be ``Replicate`` there; during
    backward the gradients are all-reduced in buckets of ``bucket_bytes`` (summed: see the module
    docstring), and after ``backward()`` every ``.grad`` is ``Replicate``. Adds
    ``module.no_sync()`` (gradient accumulation). ``find_unused_parameters`` (DDP's): the
    forward may use different parameters on different ranks (rank-dependent routing); every
    bucket is reduced at the end of backward (after every other collective of the backward,
    on every rank alike), a rank without a parameter's gradient adding zeros (a ``Replicate``
    gradient counts once, from the least rank holding one), and a parameter no rank used keeps
    ``.grad`` None (one more small all-reduce per backward). Returns the
    module; see docs/training.md."""
    check_module_and_dp_mesh("replicate", module, mesh)
    serial = agree_on_wrapping("replicate", module, mesh, {"bucket_bytes": bucket_bytes,
                                                           "find_unused_parameters": find_unused_parameters},
                               _refusal(module, mesh, bucket_bytes, find_unused_parameters))
    params = [p for p in module.parameters() if p.requires_grad]
    names = {id(p): name for name, p in module.named_parameters()}
    state = _Replicated(module, mesh, params, bucket_bytes, [names[id(p)] for p in params], find_unused_parameters,
                        f"replicate #{serial} ({type(module).__name__})")
    for i, p in enumerate(params):
        register_post_accumulate_grad_hook(p, _on_grad_complete(state, i))
    if find_unused_parameters:  # a rank whose backward reaches none of the parameters joins it too
        inner_forward = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = inner_forward(*args, **kwargs)
            if is_grad_enabled():
                for t in output_tensors(out):
                    if t.requires_grad:
                        register_hook(t, state.output_reached)
            return out

        object.__setattr__(module, "forward", forward)
    object.__setattr__(module, "_replicate_state", state)
    object.__setattr__(module, "no_sync", state.no_sync)
    return module
