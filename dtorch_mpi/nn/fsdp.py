"""``fully_shard``: sharded data parallel (ZeRO-3 / PyTorch FSDP2) on the autograd hooks.

A *unit* is one ``fully_shard(module)`` call: the parameters of ``module``'s subtree that no
inner call claimed (apply it bottom-up: blocks first, the root last). Between uses every
parameter is stored ``Shard(0)`` over the mesh (the registered ``Parameter``, which the
optimizer, ``state_dict`` and checkpoints see); a unit gathers its parameters into one buffer
of *gathered* parameters (``Replicate``, leaves of their own) that its module computes on:

============================  =============================================================
point                         what the unit does
============================  =============================================================
its forward starts            finish its all-gather (prefetched or now), start the next
                              unit's (forward order of the previous pass), swap the gathered
                              parameters into the module's attributes
its forward returns           swap the sharded ones back; free the buffer
                              (``reshard_after_forward``); a pre-backward hook on each output
a hook on its outputs fires   (pre-backward) finish its all-gather, start the all-gather of
                              the unit that runs backward next (reverse forward order; with
                              ``backward_prefetch=False`` instead finish the reduce-scatter
                              in flight), swap the gathered parameters in until the unit is
                              reduced (a checkpointed function inside it recomputes on them)
its forward runs in backward  (a checkpoint's recompute) gather, swap in and keep them; the
                              forward order and its prefetch are left alone
a gathered grad is complete   (post-accumulate-grad hook) once all of the unit's are: start
                              their reduce-scatters to ``Shard(0)`` (nonblocking, the
                              previous unit's finished first; not while gradient sync is off:
                              they accumulate), free the buffer
backward finishes             (queued callback) finish every reduce-scatter into the sharded
                              parameters' ``.grad``; reduce units whose gradients were only
                              partly complete (or accumulated unsynced), and those of other
                              groups this backward missed whose sync is on again; free every
                              buffer
``module.unshard(async_op)``  start (or finish) its all-gather before the forward that needs it
an optimizer step ends        (the first unit of the forward order, if the step updated it and
                              ``prefetch_after_step``) start its all-gather for the next forward
============================  =============================================================

2-D (FSDP x TP): a parameter on the tensor-parallel sub-mesh (or on the 2-D mesh with its dp
dim Replicate) is stored on the same ranks with the mesh dims ordered (tp, dp), placed
``[tp placement, Shard(0)]``: nested sharding splits left to right, so the dp split nests
inside each tp piece and the dp all-gather gives back exactly the piece the module computes
on (``_Layout``).

The buffer is an anonymous memory map on CPU (on transparent huge pages where allowed: a
re-gather then faults once per 2 MiB, not per 4 KiB page): freeing it returns its pages to
the system (``madvise(MADV_DONTNEED)``) while the arrays that backward kernels saved keep pointing at it,
so a re-gather restores them in place. Every decision is a function of the program's calls
and metadata, so every rank starts the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..autograd.accumulate import accumulate
from ..autograd.graph import BackwardJoin, current_backward, register_hook, register_post_accumulate_grad_hook
from ..autograd.record import on_optimizer_step, version_of
from ..comm import backend_for, pool
from ..comm.divergence import call_context
from ..comm.issuer import deferred
from ..dtensor import DTensor
from ..errors import CollectiveTimeoutError, MeshMismatchError, PlacementError, SPMDDivergenceError
from ..grad_mode import is_grad_enabled, no_grad
from ..mesh import DeviceMesh
from ..placement import Partial, Placement, Replicate, Shard
from ..redistribute import array_namespace, compile_plan
from ..redistribute.executor import run_compiled_step
from ..redistribute.planner import StepKind
from ..spec import DTensorSpec
from .deferred import is_deferred, materialize_as
from .module import Module, Parameter
from .wrapping import agree_on_wrapping, check_module_and_dp_mesh, output_tensors

_ALIGN = 64  # bytes: each gathered parameter starts on a cache line of the unit's buffer
_HUGE = 2 << 20  # bytes: a transparent huge page (x86-64, arm64 with 4 KiB pages)
_SERIALS = itertools.count()
_GROUPS: "weakref.WeakSet[_Group]" = weakref.WeakSet()  # every root's group (the prefetch after a step);
# an inner group leaves it when a root claims its units

_UNSYNCED: "weakref.WeakSet[_Unit]" = weakref.WeakSet()  # units holding gradients accumulated with sync off


@dataclass(frozen=True)
class _Layout:
    """Where a parameter computes and where it is stored.

    ``compute``: its mesh and placements before ``fully_shard`` (the gathered parameter's).
    ``store``: the same ranks with the data-parallel dim last, where the stored placements
    are the compute ones with that dim ``Shard(0)``: nested sharding splits left to right, so
    the dp split nests inside every other dim's piece (a tensor-parallel row block is split
    further over dp, and gathering over dp gives back exactly the tp piece). ``perm``: the
    compute mesh dims in store order; ``extra``: the placement the store dims have that the
    compute mesh lacks (a parameter on the tp sub-mesh: its dp dim, whose gradient terms
    are averaged over dp, as PyTorch's FSDP does)."""

    compute_mesh: DeviceMesh
    compute_placements: tuple[Placement, ...]
    store_mesh: DeviceMesh
    perm: tuple[int, ...]
    extra: Placement | None = None

    def to_store(self, placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """Compute-mesh placements (of a gathered parameter or its gradient) in store order."""
        moved = tuple(placements[i] for i in self.perm)
        return moved if self.extra is None else moved + (self.extra,)

    def stored(self) -> tuple[Placement, ...]:
        return self.to_store(self.compute_placements)[:-1] + (Shard(0),)


@dataclass
class _Slot:
    """One parameter of a unit: the sharded leaf, its gathered twin and where it is used."""

    sharded: Parameter
    gathered: Parameter
    owners: list[tuple[Module, str]]
    layout: _Layout
    name: str = ""  # its name in the module fully_shard was applied to
    ready: bool = False  # its gathered gradient is complete in this backward


class _Buffer:
    """One unit's gathered parameters, in one allocation that can give its memory back.

    Host memory: a private anonymous mapping whose pages ``release`` hands back in place
    (``MADV_DONTNEED``; the views stay valid and read zeros until written again). Device
    memory cannot be given back in place: ``release`` drops the allocation (it is freed once
    nothing else, such as a tensor saved for backward, still refers to it) and the next
    ``ensure`` makes a fresh one, whose views the unit points its gathered parameters at."""

    def __init__(self, specs: list[tuple[tuple[int, ...], np.dtype]], device_type: str) -> None:
        self._specs = specs
        self._offsets, at = [], 0
        for shape, dtype in specs:
            self._offsets.append(at)
            at += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // _ALIGN) * _ALIGN
        self.nbytes = at
        self._device_type = device_type
        self._map: mmap.mmap | None = None
        self.views: list[Any] = []
        self.ensure()

    def ensure(self) -> bool:
        """Make sure the buffer is allocated; True when this made a new allocation (new views).
        A unit without parameters (a root whose blocks hold them all) has nothing to map."""
        if self.views or not self._specs:
            return False
        if self._device_type == "cpu":
            raw: Any = self._host_map()
        else:
            raw = array_namespace(self._device_type).empty(max(self.nbytes, 1), dtype=np.uint8)
        self.views = [raw[o:o + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(shape)
                      for (shape, dtype), o in zip(self._specs, self._offsets)]
        return True

    def _host_map(self) -> np.ndarray:
        """The host bytes: a private anonymous map (``MADV_DONTNEED`` frees its pages), on
        transparent huge pages where the system allows them (``MADV_HUGEPAGE``; the start
        aligned to 2 MiB). After a release, every first write of a 4 KiB page faults and is
        zeroed by the kernel: a 2 MB unit's all-gather took 1.08 ms instead of 0.15 (2 ranks),
        with huge pages 0.14; where they are off, the map is an ordinary one."""
        huge = self.nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE")
        self._map = mmap.mmap(-1, max(self.nbytes, 1) + (_HUGE if huge else 0), flags=mmap.MAP_PRIVATE)
        raw = np.frombuffer(self._map, dtype=np.uint8)
        if not huge:
            return raw
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KiB pages
            self._map.madvise(mmap.MADV_HUGEPAGE)
        start = -raw.ctypes.data % _HUGE
        return raw[start:start + self.nbytes]

    def release(self) -> None:
        """Give the memory back: the pages in place (host), or the allocation (device)."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)
        else:
            self.views = []


@dataclass(eq=False)  # a group is itself, not its fields' values (kept in a WeakSet)
class _Group:
    """The units of one root (merged bottom-up): the forward order and the backward state."""

    units: list["_Unit"] = field(default_factory=list)
    number: int = 0  # the root's number among the wrappers on the mesh (agree_on_wrapping)
    order: list["_Unit"] = field(default_factory=list)  # the last complete forward pass
    current: list["_Unit"] = field(default_factory=list)
    active: int = 0  # units of the group inside their forward now
    backward: BackwardJoin = field(default_factory=BackwardJoin)  # the backward it queued its end in
    reducing: list[tuple[_Slot, Callable[[], Any], DTensorSpec]] = field(default_factory=list)  # (wait, spec) per slot
    prefetch_after_step: bool = True  # the root's fully_shard(prefetch_after_step=...)

    def neighbour(self, unit: "_Unit", step: int) -> "_Unit | None":
        """The unit after (``step=1``) or before (``-1``) ``unit`` in the last forward order."""
        if unit not in self.order:
            return None
        i = self.order.index(unit) + step
        return self.order[i] if 0 <= i < len(self.order) else None

    def prefetch_first(self, stepped: set[int]) -> None:
        """After an optimizer step that changed some of the parameters of the first unit with
        parameters in the last forward order (``stepped``: their ids), start that unit's
        all-gather beside what the program does before its next forward (loading a batch), as
        ``unshard(async_op=True)`` would: the forward then finds it done. A change to those
        shards before that forward makes it gather again (``drop_if_stale``). Every rank steps
        the same parameters in the same order (SPMD), so every rank starts the same gather."""
        first = next((unit for unit in self.order if unit.slots), None)
        if (first is None or not self.prefetch_after_step or self.active or current_backward() is not None
                or self.backward.frame is not None  # a backward that raised: the forward settles it
                or not any(id(s.sharded) in stepped for s in first.slots)):
            return
        first.drop_if_stale()  # an unshard() before the step gathered the old values
        if first.state == "free":
            with deferred():  # checked and started beside the caller's work (comm/issuer.py)
                first.start_gather()

    def join_backward(self) -> None:
        self.backward.join(self.discard_backward, self.finish_backward)

    def discard_backward(self) -> None:
        """Forget a failed backward's state: its reductions complete but add to no .grad."""
        self.discard_step(drop_gathered_grads=True)

    def settle(self) -> None:
        """Before a forward or an ``unshard``: a backward that raised before its end (its end
        callback never ran) is discarded now, not at the next backward's first hook, so the
        forward starts from a clean group."""
        if self.backward.frame is not None and current_backward() is None:
            self.discard_backward()
            self.backward.leave()

    def discard_step(self, drop_gathered_grads: bool, cause: BaseException | None = None) -> None:
        """Forget what a forward or backward that raised (``cause``, where known) left: every
        collective it started completes, its result dropped, and a divergence it raises too
        (the step's own, or a call refused after it: raised again, it would reach some ranks
        only and part them); every unit is freed (a failed backward's gathered gradients
        dropped; a forward's leaves those accumulated with sync off before it); and the
        forward order is forgotten, so the next forward prefetches nothing and records it
        anew. Ranks whose forwards differed (an expert each) recorded different orders, and
        prefetching along them made every later step diverge again.

        After a ``CollectiveTimeoutError`` (the cause, or met here: raised) the communicator is
        unusable: nothing more is waited for (each wait would take a whole deadline), and the
        units stay as they are, their buffers too (an abandoned collective may still write
        into them); their next use waits again and times out again, never computes on
        values that never came."""
        timeout = cause if isinstance(cause, CollectiveTimeoutError) else None
        if timeout is None:
            waits = [wait for _, wait, _ in self.reducing] + [f for unit in self.units for f in unit.pending]
            for wait in waits:
                try:
                    wait()
                except SPMDDivergenceError:
                    pass
                except CollectiveTimeoutError as exc:
                    timeout = exc
                    break
        self.order, self.current = [], []
        if timeout is not None:
            if timeout is not cause:
                raise timeout
            return
        self.reducing = []
        for unit in self.units:
            unit.pending = []
        self.reset_units(drop_gathered_grads)

    def reset_units(self, drop_gathered_grads: bool) -> None:
        """Every unit as between backwards: freed, not reduced, no gradient ready (a failed
        backward's gathered gradients are dropped too: they add to no .grad)."""
        for unit in self.units:
            unit.free()
            unit.reduced = False
            for s in unit.slots:
                s.ready = False
                if drop_gathered_grads:
                    s.gathered.grad = None
            if not unit.holds_gradients():
                _UNSYNCED.discard(unit)

    def finish_reductions(self) -> None:
        """Wait for the reduce-scatters in flight; add each result to its parameter's .grad."""
        reducing, self.reducing = self.reducing, []
        for slot, wait, spec in reducing:
            local = wait()
            base = getattr(local, "base", None)
            if base is not None and base.nbytes > local.nbytes + pool.PAGE:
                local = local.copy()  # a slice of a larger gradient: own only its bytes
            # else the collective's pooled output (a page larger, for its alignment) is the
            # shard's .grad, not copied (~0.13 ms per MB on the computing thread) and still the
            # pool's: once zero_grad drops it, the next backward's reduce-scatter writes into
            # it again rather than into fresh memory (0.35 ms a step of mapping, faulting and
            # unmapping 4 x 1 MB at 2 ranks, issue 26), as a caching allocator keeps a freed
            # block; held, it is never handed out (comm/pool.py)
            shard = DTensor(local, spec)
            old = slot.sharded.grad
            slot.sharded.grad = shard if old is None else accumulate(old, shard)

    def finish_backward(self) -> None:
        for unit in self.units:
            if not unit.holds_gradients():
                continue
            if not unit.sync_gradients:
                _UNSYNCED.add(unit)  # accumulated unsynced: the next synced backward reduces them
            elif not unit.reduced:
                unit.reduce(final=True)  # some gradients never came (or accumulated unsynced): reduce those there are
        self.finish_reductions()
        self.reset_units(drop_gathered_grads=False)
        self.backward.leave()
        self.reduce_unsynced_elsewhere()

    def reduce_unsynced_elsewhere(self) -> None:
        """Reduce what units of other groups accumulated unsynced, once their sync is back on,
        though this backward did not reach them (two models, or blocks sharded without a
        root): a synced backward leaves no accumulation behind to mix into a later step. A
        group inside a backward (this one, or one that raised) is left to its own end."""
        others = sorted((u for u in _UNSYNCED if u.sync_gradients and u.group.backward.frame is None
                         and u.group is not self), key=lambda u: u.serial)  # the same order on every rank
        for unit in others:
            if unit.holds_gradients():
                unit.reduce(final=True)
                unit.group.finish_reductions()
            unit.reduced = False
            _UNSYNCED.discard(unit)


class _Unit:
    """One ``fully_shard`` call's parameters and their gather / free / reduce state."""

    def __init__(self, module: Module, mesh: DeviceMesh, slots: list[_Slot], buffer: _Buffer,
                 reshard_after_forward: bool, backward_prefetch: bool = True) -> None:
        self.module, self.mesh, self.slots, self.buffer = module, mesh, slots, buffer
        self.reshard_after_forward = reshard_after_forward
        self.backward_prefetch = backward_prefetch
        self.group = _Group(units=[self])
        self.state = "free"  # free | pending | gathered
        self.pending: list[Callable[[], Any]] = []
        self.gathered_versions: tuple[int, ...] = ()  # the shards' versions the gather read
        self.reduced = False
        self.sync_gradients = True  # False: backward keeps the gathered gradients, unreduced
        self.serial = next(_SERIALS)  # creation order, the same on every rank
        self.path = ""  # the module's name under the root that claimed it ("" for a root)

    def holds_gradients(self) -> bool:
        """Whether some gathered parameter still has a gradient (not yet reduce-scattered)."""
        return any(s.gathered.grad is not None for s in self.slots)

    # --- gather and free ----------------------------------------------------------------
    def start_gather(self) -> None:
        """Start every parameter's all-gather (nonblocking) straight into its place in the
        buffer; a no-op unless free."""
        if self.state != "free":
            return
        if self.buffer.ensure():  # a device buffer made anew: the gathered parameters point at it
            for s, view in zip(self.slots, self.buffer.views):
                s.gathered._replace(view, s.gathered.spec)
        self.pending = []
        for i, (s, view) in enumerate(zip(self.slots, self.buffer.views)):
            with call_context(self.describe(s, "all-gather"), every_size=i == 0):  # (see describe)
                self.pending.append(_start_gather(s.sharded, view))
        self.gathered_versions = self.shard_versions()
        self.state = "pending"

    def describe(self, slot: _Slot, what: str) -> Callable[[], str]:
        """The text the divergence check compares for a collective of ``slot`` (evaluated only
        when a check runs): ranks whose forwards reached different units of equal shapes (an
        expert each) get an error, not each other's shards. A unit is named by its module's
        path under its root and by the root's number among the wrappers on the mesh, which
        ``fully_shard`` (collective on its mesh) agrees across the ranks: blocks sharded
        without a root are roots of their own, told apart by that number alone.

        The first call of each batch (a unit's gathers, the reduce-scatters one ``reduce``
        starts) is checked whatever its size (``call_context(every_size=True)``); the others
        from 64 KiB, as any call. Ranks in different units differ at the first call already,
        and a unit's later calls follow from its module, the same on every rank. A small call's
        check costs ~25 us (a wait for the other ranks where a nonblocking start returns at
        once): checking every call cost +12-25 % of a step of eight 64 x 64 layers at 2 ranks,
        the first of each batch +7 % (median of five interleaved runs)."""
        name = f"{self.path}.{slot.name}" if self.path else slot.name
        return lambda: f"{what} of {name} (fully_shard unit {type(self.module).__name__}, root #{self.group.number})"

    def shard_versions(self) -> tuple[int, ...]:
        """How many times each sharded parameter was changed in place (optimizer steps,
        ``load_state_dict``, in-place ops): a gather started before a change holds old values."""
        return tuple(version_of(s.sharded) for s in self.slots)

    def drop_if_stale(self) -> None:
        """Forget a gather started before the shards last changed: ``unshard()`` before
        ``optimizer.step()`` or ``load_state_dict``, or a prefetch a failed forward left
        behind. Its values are the old ones, so the forward gathers again. The shards change
        on every rank alike (SPMD), so every rank gathers again."""
        if self.state != "free" and self.shard_versions() != self.gathered_versions:
            self.finish_pending()
            self.state = "free"  # the buffer stays: the next gather writes into it

    def gather(self) -> None:
        """Make the gathered parameters hold the values gathered last, or started (waiting as
        needed), or the current values when there are none."""
        self.start_gather()
        if self.state == "pending":
            for finish in self.pending:
                finish()
            self.pending = []
            self.state = "gathered"

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """Gather the unit's parameters now, so its next forward (or backward) does not wait
        for them (FSDP2's ``unshard``): with ``async_op`` the all-gather is started and the
        handle's ``wait()`` finishes it; without, it is finished here. Collective: every rank
        of the mesh calls it. Call it after ``optimizer.step()``: it gathers the values the
        shards hold now, and should they change before the forward, the forward gathers
        again (``drop_if_stale``). For example, overlap the first unit's all-gather with
        loading the next batch. The module's attributes stay the shards until its forward."""
        self.group.settle()
        self.drop_if_stale()  # a gather made before the shards last changed: made again
        if not async_op:
            self.gather()
            return None
        with deferred():  # checked and started beside the caller's work (comm/issuer.py)
            self.start_gather()
        return UnshardHandle(self)

    def finish_pending(self) -> None:
        """Complete a started gather whose values nobody will use: its collective still runs."""
        if self.state == "pending":
            for finish in self.pending:
                finish()
            self.pending = []

    def free(self) -> None:
        self.expose(False)  # the module computes on the sharded parameters again (see _pre_backward)
        self.finish_pending()  # a prefetch nobody used
        self.buffer.release()
        if not self.buffer.views:  # a device buffer was dropped: so must the references to it
            for s in self.slots:
                s.gathered._replace(None, s.gathered.spec)
        self.state = "free"

    def expose(self, gathered: bool) -> None:
        """Point every owner's attribute at the gathered (or back at the sharded) parameter."""
        for s in self.slots:
            for owner, name in s.owners:
                object.__setattr__(owner, name, s.gathered if gathered else s.sharded)

    # --- forward ------------------------------------------------------------------------
    def forward(self, inner: Any, *args: Any, **kwargs: Any) -> Any:
        if current_backward() is not None:
            return self.recompute(inner, *args, **kwargs)
        group = self.group
        if group.active == 0:
            group.settle()
            group.current = []
        group.active += 1
        if self not in group.current:
            group.current.append(self)
        failure: BaseException | None = None
        try:
            self.drop_if_stale()
            self.gather()
            after = group.neighbour(self, 1)
            if after is not None:
                # the forward prefetch, checked and started beside this unit's compute
                # (comm/issuer.py); a unit without parameters (a root over its blocks) computes
                # little before the next unit waits for it: started here, it wakes no thread
                # into that wait's way
                with deferred(beside_work=bool(self.slots)):
                    after.start_gather()
            self.expose(True)
            try:
                out = inner(*args, **kwargs)
            finally:
                self.expose(False)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            group.active -= 1
            if group.active == 0:
                if failure is not None:  # (it propagates: what the forward started is dropped)
                    group.discard_step(drop_gathered_grads=False, cause=failure)
                else:
                    group.order = group.current
        training = is_grad_enabled() and any(s.gathered.requires_grad for s in self.slots)
        if training:
            for t in output_tensors(out):
                if t.requires_grad:
                    register_hook(t, self._pre_backward)
        if self.reshard_after_forward or not training:
            self.free()
        return out

    def recompute(self, inner: Any, *args: Any, **kwargs: Any) -> Any:
        """The forward run again during backward (activation checkpointing): on the gathered
        parameters, which stay gathered and exposed for the backward that follows at once;
        the forward order and its prefetch stay the forward pass's."""
        self.group.join_backward()
        self.gather()
        self.expose(True)
        out = inner(*args, **kwargs)
        for t in output_tensors(out):
            if t.requires_grad:
                register_hook(t, self._pre_backward)
        return out

    # --- backward -----------------------------------------------------------------------
    def _pre_backward(self, grad: DTensor) -> None:
        """Gather for the unit's backward and expose the gathered parameters until its
        gradients are reduced: a checkpointed function inside the unit recomputes on them."""
        self.group.join_backward()
        self.gather()
        self.expose(True)
        if not self.backward_prefetch:  # the least memory: the reduce-scatter in flight ends here,
            self.group.finish_reductions()  # before this unit's gradients exist
            return None
        before = self.group.neighbour(self, -1)
        if before is not None:
            with deferred():
                before.start_gather()  # backward prefetch: the unit whose backward runs next
        return None

    def grad_complete(self, slot: _Slot) -> None:
        """A gathered parameter's gradient is complete; reduce the unit once all are."""
        self.group.join_backward()
        if self.state != "gathered":
            raise RuntimeError(
                f"fully_shard: the backward of {type(self.module).__name__} ran while its parameters were "
                f"freed (its gradient reached the module other than through the tensors its forward "
                f"returned); return every tensor that later computation uses, or pass "
                f"reshard_after_forward=False")
        slot.ready = True
        if all(s.ready or not s.gathered.requires_grad for s in self.slots):
            if self.sync_gradients:
                self.reduce()
            self.free()

    def reduce(self, final: bool = False) -> None:
        """Start the reduce-scatter of every complete gathered gradient to ``Shard(0)`` (with
        ``final``, at the end of backward: every gathered gradient there is)."""
        group = self.group
        group.finish_reductions()  # at most one unit's gradients in flight
        beside_work = not (final or self.reduces_last())
        first = True
        for s in self.slots:
            g = s.gathered.grad
            if g is None or not (s.ready or final):
                continue
            s.gathered.grad = None
            with deferred(beside_work=beside_work), call_context(self.describe(s, "reduce-scatter"), every_size=first):
                group.reducing.append((s, *_start_reduce(s.layout, g, s.sharded.placements)))
            first = False
        self.reduced = True

    def trains(self) -> bool:
        """Whether some parameter of the unit takes a gradient."""
        return any(s.gathered.requires_grad for s in self.slots)

    def reduces_last(self) -> bool:
        """Whether this unit's is its backward's last reduction: every other unit of its group
        that takes a gradient has reduced already (whatever order the backward ran them in:
        a root's own head completes first). The end of backward waits for it next, with no
        compute in between to hide it behind, so it starts on the computing thread
        (comm/issuer.py, ``deferred``). A unit alone in its group (blocks sharded without a
        root: their groups know nothing of each other) never counts as last."""
        units = self.group.units
        return len(units) > 1 and all(u is self or u.reduced or not u.trains() for u in units)


class UnshardHandle:
    """What ``module.unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather (a
    no-op once the unit's forward, or ``reshard()``, has)."""

    __slots__ = ("_unit",)

    def __init__(self, unit: _Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit.state == "pending":
            self._unit.gather()


def _start_gather(p: Parameter, view: Any) -> Callable[[], Any]:
    """Start gathering the stored ``p`` over its dp dim (the last) into ``view``; returns what
    finishes it. The plan is one all-gather (or nothing at one rank): it writes into the
    buffer itself, with no intermediate copy."""
    plan = compile_plan(p.spec, p.placements[:-1] + (Replicate(),))
    steps = plan.steps
    if not steps:
        view[...] = p.to_local()
        return lambda: None
    step = steps[0] if len(steps) == 1 else None
    if step is not None and step.kind == StepKind.ALL_GATHER and step.group is not None:
        axis, sizes = step.args
        work = backend_for(p.device_mesh.device_type).all_gather(step.group, p.to_local(), view, axis, sizes,
                                                                 async_op=True)

        def finish() -> None:
            got = work.wait()  # the result: ``view`` itself, or (the padded path's uneven gather) its own buffer
            if got is not view:
                view[...] = got
        return finish
    with no_grad():  # any other plan: through redistribute, then copied in
        full = p.redistribute(placements=plan.out_spec.placements, async_op=True)
    return lambda: view.__setitem__(Ellipsis, full.to_local())


def _start_reduce(layout: _Layout, g: DTensor, target: tuple[Placement, ...]) -> tuple[Callable[[], Any], DTensorSpec]:
    """Start reduce-scattering the gathered gradient ``g`` (its dp dim, the stored mesh's last,
    a sum of the ranks' terms) to the sharded parameter's ``target`` placements; returns what
    waits for the local result, and the result's spec. The usual plan is one reduce-scatter,
    started here on the backend straight from the gradient (a redistribute's own bookkeeping
    cost ~0.08 ms per unit on the computing thread); any other plan runs as a redistribute."""
    spec = DTensorSpec(layout.store_mesh, layout.to_store(g.placements), g.shape, g.dtype)
    plan = compile_plan(spec, target)
    steps = plan.steps
    if len(steps) == 1 and steps[0].kind is StepKind.REDUCE_SCATTER:
        spec.mesh._check_alive()  # (as a redistribute checks before it starts a collective)
        work = run_compiled_step(steps[0], g.to_local(), plan.xp, backend_for(spec.mesh.device_type), True)
        return work.wait, plan.out_spec
    with no_grad():
        pending = DTensor(g.to_local(), spec).redistribute(placements=target, async_op=True)
    return pending.to_local, pending.spec


def _prefetch_after_step(params: Sequence[DTensor]) -> None:
    """An optimizer step changed ``params``: each root whose first unit holds some of them
    starts that unit's all-gather (``_Group.prefetch_first``), roots in creation order."""
    stepped = {id(p) for p in params}
    for group in sorted(_GROUPS, key=lambda g: min(u.serial for u in g.units)):
        group.prefetch_first(stepped)


on_optimizer_step(_prefetch_after_step)


def _unit_of(module: Module) -> _Unit | None:
    return module.__dict__.get("_fsdp_unit")


def _claim(module: Module, mesh: DeviceMesh) -> tuple[list[_Slot], list[_Unit]]:
    """The parameters of ``module``'s subtree that no inner unit holds, with every attribute
    that refers to each, and the inner units found."""
    inner: list[_Unit] = []
    claimed: set[int] = set()
    for m in module.modules():
        unit = _unit_of(m)
        if unit is not None and m is not module:
            inner.append(unit)
            claimed.update(id(s.sharded) for s in unit.slots)
    slots: dict[int, _Slot] = {}
    for mod_name, m in module.named_modules():
        for name, p in m._parameters.items():
            if id(p) in claimed:
                continue
            if id(p) not in slots:
                path = f"{mod_name}.{name}" if mod_name else name
                slots[id(p)] = _Slot(p, p, [], _layout(path, p, mesh), path)
            slots[id(p)].owners.append((m, name))
    return list(slots.values()), inner


_STORE_MESHES: dict[tuple[Any, ...], DeviceMesh] = {}
"""The store mesh made for each (mesh identity, dim order): made once (it is collective)."""


def _store_mesh(mesh: DeviceMesh, perm: tuple[int, ...]) -> DeviceMesh:
    if perm == tuple(range(mesh.ndim)):
        return mesh
    key = (mesh.identity, perm)
    made = _STORE_MESHES.get(key)
    if made is None or made.freed:
        names = None if mesh.mesh_dim_names is None else tuple(mesh.mesh_dim_names[i] for i in perm)
        made = _STORE_MESHES[key] = DeviceMesh(mesh.device_type, np.transpose(mesh.mesh, perm), mesh_dim_names=names)
    return made


def _layout(name: str, p: Parameter, mesh: DeviceMesh) -> _Layout:
    """Where ``p`` computes and is stored; every rank sees the same metadata, so every rank
    raises the same error here."""
    pm = p.device_mesh
    parent: DeviceMesh | None = getattr(mesh, "_parent", None)
    if p.ndim == 0:
        raise PlacementError(
            f"fully_shard: parameter {name} is 0-d and cannot be Shard(0); store it with shape (1,)")
    if any(pl.is_partial() for pl in p.placements):
        raise PlacementError(f"fully_shard: parameter {name} is placed {list(p.placements)}; a Partial "
                             f"parameter cannot be sharded: redistribute it to Replicate first")
    if pm == mesh:  # plain data parallel
        if p.placements != (Replicate(),):
            raise PlacementError(
                f"fully_shard: parameter {name} is placed {list(p.placements)} on the data-parallel mesh; "
                f"fully_shard takes replicated parameters there (a tensor-parallel plan goes on the other "
                f"dim of a 2-D mesh: parallelize_module(model, mesh2['tp'], ...), then "
                f"fully_shard(..., mesh=mesh2['dp']))")
        return _Layout(pm, p.placements, pm, (0,))
    if parent is not None and parent.ndim == 2:
        dp = mesh.identity[-1]
        if pm is parent or pm == parent:  # on the 2-D mesh itself: its dp dim must be Replicate
            if p.placements[dp] != Replicate():
                raise PlacementError(
                    f"fully_shard: parameter {name} is placed {list(p.placements)}; its data-parallel mesh "
                    f"dim {dp} must be Replicate before fully_shard shards it")
            perm = tuple(i for i in range(2) if i != dp) + (dp,)
            return _Layout(pm, p.placements, _store_mesh(parent, perm), perm)
        if getattr(pm, "_parent", None) is parent and pm.identity[-1] != dp:  # on the tp sub-mesh
            tp = pm.identity[-1]
            assert parent is not None
            return _Layout(pm, p.placements, _store_mesh(parent, (tp, dp)), (0,), Partial("avg"))
    raise MeshMismatchError(
        f"fully_shard: parameter {name} lives on {pm!r}, which is neither the mesh given ({mesh!r}) nor "
        f"the 2-D mesh it is a dim of (nor that mesh's other dim); build the module on that mesh")


def _on_grad_complete(unit: _Unit, slot: _Slot) -> Callable[[DTensor], None]:
    return lambda _leaf: unit.grad_complete(slot)


def fully_shard(module: Module, *, mesh: DeviceMesh, reshard_after_forward: bool = True,
                backward_prefetch: bool = True, prefetch_after_step: bool = True) -> Module:
    """Shard ``module``'s unclaimed (replicated) parameters ``Shard(0)`` over ``mesh`` as one unit (ZeRO-3);
    returns the module. Apply bottom-up (blocks, then the root); see docs/training.md.

    ``backward_prefetch=False`` (PyTorch FSDP1's ``backward_prefetch=None``): in backward this
    unit gathers when its backward starts, without starting the next unit's gather, and first
    finishes the reduce-scatter still in flight, so at most two units' worth of gathered
    parameters and whole gradients exist at a time (with gradient sync on); the price is the
    overlap in backward.

    ``prefetch_after_step`` (the root's call decides for all its units): at the end of each
    optimizer step that updates the first unit of the forward (the first with parameters),
    start that unit's all-gather, so it runs beside what comes before the next forward (a
    batch's load) rather than before the forward's first compute; the unit's gathered
    parameters then exist from the step on (memory: one unit, less than the step's peak).
    ``False``: the forward gathers it, as FSDP2 does unless ``unshard(async_op=True)`` is called.

    Adds FSDP2's methods to ``module``: ``unshard(async_op=False)`` (gather now, or start the
    all-gather and return a handle to ``wait()`` on), ``reshard()`` (free the gathered
    parameters) and ``set_requires_gradient_sync(flag, *, recurse=True)`` (gradient
    accumulation without reduce-scatters)."""
    check_module_and_dp_mesh("fully_shard", module, mesh)
    again = None if _unit_of(module) is None else ValueError(
        f"fully_shard was already applied to this {type(module).__name__}")
    number = agree_on_wrapping("fully_shard", module, mesh, {"reshard_after_forward": reshard_after_forward,
                                                             "backward_prefetch": backward_prefetch,
                                                             "prefetch_after_step": prefetch_after_step}, again)
    slots, inner = _claim(module, mesh)
    xp = array_namespace(mesh.device_type)
    for s in slots:
        p, lay = s.sharded, s.layout
        if is_deferred(p):  # made as its shard, never complete (nn/deferred.py)
            materialize_as(p, DTensorSpec(lay.store_mesh, lay.stored(), p.shape, p.dtype))
            continue
        whole = DTensor(p.to_local(), DTensorSpec(lay.store_mesh, lay.to_store(p.placements)[:-1] + (Replicate(),),
                                                  p.shape, p.dtype))  # the same piece, in store order
        with no_grad():
            moved = whole.redistribute(placements=lay.stored())
        p._replace(xp.array(moved.to_local(), copy=True), moved.spec)  # own only its rows
        del whole, moved  # the complete piece goes before the next parameter's is made
    specs = [DTensorSpec(s.layout.compute_mesh, s.layout.compute_placements, s.sharded.shape, s.sharded.dtype)
             for s in slots]
    buffer = _Buffer([(spec.local_shape, spec.dtype) for spec in specs], mesh.device_type)
    for s, view, spec in zip(slots, buffer.views, specs):
        s.gathered = Parameter(DTensor(view, spec), requires_grad=s.sharded.requires_grad)
    unit = _Unit(module, mesh, slots, buffer, reshard_after_forward, backward_prefetch)
    unit.free()  # the buffer's memory goes back until the first gather
    for s in slots:
        if s.gathered.requires_grad:
            register_post_accumulate_grad_hook(s.gathered, _on_grad_complete(unit, s))
    group = unit.group
    group.number = number
    group.prefetch_after_step = prefetch_after_step
    _GROUPS.add(group)
    for child in inner:  # the new unit becomes the root of every inner unit's group
        _GROUPS.discard(child.group)
        group.units.extend(u for u in child.group.units if u not in group.units)
    paths = {id(m): name for name, m in module.named_modules()}
    for u in group.units:
        u.group = group
        u.path = paths.get(id(u.module), u.path)  # named under this root now (divergence check)
    object.__setattr__(module, "_fsdp_unit", unit)
    inner_forward = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return unit.forward(inner_forward, *args, **kwargs)

    object.__setattr__(module, "forward", forward)
    object.__setattr__(module, "unshard", unit.unshard)
    object.__setattr__(module, "reshard", unit.free)

    def set_requires_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        _set_gradient_sync(module, requires_gradient_sync, recurse)

    object.__setattr__(module, "set_requires_gradient_sync", set_requires_gradient_sync)
    return module


def _set_gradient_sync(module: Module, sync: bool, recurse: bool) -> None:
    """FSDP2's ``set_requires_gradient_sync``: with ``False`` the backwards of the unit (and,
    with ``recurse``, of every unit inside ``module``) keep their gathered gradients and add
    the next ones to them, with no reduce-scatter (gradient accumulation over micro-batches at
    one unsharded gradient per unit of memory); the first backward with ``True`` again
    reduce-scatters the sum into the shards' ``.grad``. Every rank sets the same."""
    if not isinstance(sync, bool):
        raise TypeError(f"set_requires_gradient_sync takes a bool, got {sync!r}")
    for m in module.modules() if recurse else (module,):
        unit = _unit_of(m)
        if unit is not None:
            unit.sync_gradients = sync
