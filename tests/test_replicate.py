"""replicate (data parallel, gradients all-reduced in buckets during backward): results bitwise
equal to the blocking ``reduce_gradients`` form (SGD and AdamW, uneven and empty shapes, one
bucket per gradient, tiny buckets, the default), gradient accumulation with ``no_sync``, the
bucketed nonblocking all-reduces (CommCounter) started before backward ends, the order check
across ranks, and the refusals. The training curves against the NumPy reference are in
test_training.py (plan replicate). Every test but the MPI-call trace runs per array backend
(NumPy pieces, and CuPy ones on a "cuda" mesh: the emulated CuPy under ``--device emulated``)."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import numpy as np
import pytest
from backend_meshes import mesh1d_per_backend, mesh2d_per_backend  # noqa: F401 (fixtures: this module's meshes, per array backend)
from conftest import RANK, SIZE, Checker, lengths_for, to_numpy
from helpers import Branches

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.nn import functional as F

# replicate reduces gradients with Iallreduce only, the same MPI call on every path (comm/
# mpi_backend.py); the one other collective, distribute_tensor's scatter of the data, is traced on
# every path by test_mpi_trace
pytestmark = pytest.mark.path_independent

R, S0 = dt.Replicate(), dt.Shard(0)
BUCKETS = [0, 200, nn.utils.BUCKET_BYTES]  # one per gradient, a few, one


class Tower(nn.Module):
    """Three layers around hidden widths ``width`` (0, below, equal to, above the rank count)."""

    def __init__(self, width: int, mesh: dt.DeviceMesh) -> None:
        super().__init__()
        self.a = nn.Linear(4, width, device_mesh=mesh, dtype=np.float64)
        self.b = nn.Linear(width, 5, device_mesh=mesh, dtype=np.float64)
        self.c = nn.Linear(5, 3, device_mesh=mesh, dtype=np.float64)

    def forward(self, x: dt.DTensor) -> dt.DTensor:
        return self.c(F.gelu(self.b(F.gelu(self.a(x), "tanh")), "tanh"))


def _data(mesh: dt.DeviceMesh, batch: int = 7, seed: int = 3) -> tuple[dt.DTensor, dt.DTensor]:
    x = np.random.default_rng(seed).standard_normal((batch, 4))
    y = np.random.default_rng(seed + 1).standard_normal((batch, 3))
    return dt.distribute_tensor(x, mesh, [S0]), dt.distribute_tensor(y, mesh, [S0])


def _train(mesh: dt.DeviceMesh, width: int, optimizer: str, bucket: int | None, steps: int = 3,
           micro: int = 1) -> tuple[dict[str, np.ndarray], nn.Module]:
    """``steps`` optimizer steps of ``micro`` accumulated backwards each; ``bucket`` None: the
    blocking form (``reduce_gradients`` after backward), else ``replicate`` with that bucket."""
    dt.manual_seed(0)
    model = Tower(width, mesh)
    if bucket is not None:
        dt.replicate(model, mesh=mesh, bucket_bytes=bucket)
    params = list(model.parameters())
    opt = dt.optim.AdamW(params, lr=0.02) if optimizer == "adamw" else dt.optim.SGD(params, lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for k in range(micro):
            x, y = _data(mesh, seed=10 * step + k)
            last = k == micro - 1
            ctx: Any = model.no_sync() if bucket is not None and not last else contextlib.nullcontext()
            with ctx:
                F.mse_loss(model(x), y).backward()
        if bucket is None:
            nn.utils.reduce_gradients(params)
        opt.step()
    return {k: to_numpy(p.to_torch()) for k, p in model.named_parameters()}, model


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("width", lengths_for(SIZE))
def test_training_equals_the_blocking_form_bitwise(mesh1d: dt.DeviceMesh, width: int, optimizer: str,
                                                   bucket: int, check: Checker) -> None:
    want, _ = _train(mesh1d, width, optimizer, None)
    got, model = _train(mesh1d, width, optimizer, bucket)
    for name, p in model.named_parameters():
        check.equal(got[name], want[name], f"{name} after 3 steps")
        check.true(p.placements == (R,) and p.grad is not None and p.grad.placements == (R,),
                   f"{name}: placed {p.placements}, grad {None if p.grad is None else p.grad.placements}")
    check.done()


@pytest.mark.parametrize("bucket", [0, nn.utils.BUCKET_BYTES])
def test_no_sync_accumulates_and_reduces_once(mesh1d: dt.DeviceMesh, bucket: int, check: Checker) -> None:
    want, _ = _train(mesh1d, SIZE + 1, "adamw", None, steps=2, micro=3)
    got, _ = _train(mesh1d, SIZE + 1, "adamw", bucket, steps=2, micro=3)
    for name in want:
        check.equal(got[name], want[name], f"{name} after 2 steps of 3 micro-batches")
    dt.manual_seed(0)
    model = dt.replicate(Tower(3, mesh1d), mesh=mesh1d)
    x, y = _data(mesh1d)
    with dt.CommCounter() as inside, model.no_sync():
        loss = F.mse_loss(model(x), y)
        loss.backward()
    reduces = [r for r in inside.records if r.kind == "all_reduce" and r.nonblocking]
    check.true(not reduces, f"no_sync backward all-reduced gradients: {reduces}")
    check.true(all(p.grad is not None and p.grad.placements[0].is_partial() for p in model.parameters()),
               "inside no_sync the gradients stay Partial")
    F.mse_loss(model(x), y).backward()
    check.true(all(p.grad is not None and p.grad.placements == (R,) for p in model.parameters()),
               "the backward after no_sync reduces")
    check.done()


@pytest.mark.parametrize("bucket", BUCKETS)
def test_buckets_are_nonblocking_and_start_during_backward(mesh1d: dt.DeviceMesh, bucket: int,
                                                           check: Checker) -> None:
    dt.manual_seed(0)
    model = dt.replicate(Tower(SIZE + 1, mesh1d), mesh=mesh1d, bucket_bytes=bucket)
    state = model.__dict__["_replicate_state"]
    params = list(model.parameters())
    sizes = {id(p): p.size * p.dtype.itemsize for p in params}
    for step in range(2):  # the first backward fixes the layout, the second follows it
        x, y = _data(mesh1d, seed=step)
        loss = F.mse_loss(model(x), y)
        started_before_end: list[int] = []
        finish = state.finish

        def spy() -> None:
            started_before_end.append(state.next)
            finish()

        state.finish = spy
        with dt.CommCounter() as moved:
            loss.backward()
        del state.finish
        reduces = [r for r in moved.records if r.kind == "all_reduce"]
        layout = state.layout()
        want = [sum(sizes[id(params[i])] for i in b) for b in layout]
        check.true(all(r.nonblocking for r in reduces), f"step {step}: blocking all-reduces")
        if SIZE > 1:
            check.true([r.bytes_sent for r in reduces] == want,
                       f"step {step}: all-reduce bytes {[r.bytes_sent for r in reduces]}, buckets {want}")
        check.true(started_before_end == [len(layout)],
                   f"step {step}: {started_before_end} of {len(layout)} buckets started before backward ended")
        check.true(bucket != 0 or len(layout) == len(params), "bucket 0: one all-reduce per gradient")
        check.true(bucket != nn.utils.BUCKET_BYTES or len(layout) == 1, "the default: one bucket here")
        for p in params:
            p.grad = None
    order = [i for b in state.layout() for i in b]
    check.true(order == list(range(len(params)))[::-1], f"the reverse order of use: {order}")
    check.done()


@pytest.mark.skipif(SIZE == 1, reason="needs two ranks to diverge")
def test_ranks_using_parameters_in_different_orders_raise_on_every_rank(mesh1d: dt.DeviceMesh,
                                                                        check: Checker) -> None:
    dt.manual_seed(0)
    model = dt.replicate(Branches(mesh1d), mesh=mesh1d, bucket_bytes=0)
    model.order = "ab" if RANK % 2 == 0 else "ba"
    x, y = _data(mesh1d)
    with pytest.raises(dt.SPMDDivergenceError, match="order gradients complete"):
        F.mse_loss(model(x), y).backward()
    want = {}
    dt.manual_seed(0)
    plain = Branches(mesh1d)
    F.mse_loss(plain(x), y).backward()
    nn.utils.reduce_gradients(list(plain.parameters()))
    want = {k: to_numpy(p.grad.to_torch()) for k, p in plain.named_parameters()}
    for k, p in model.named_parameters():  # the reduction itself ran in an order every rank shares
        check.equal(to_numpy(p.grad.to_torch()), want[k], f"{k} grad after the refused order")
    check.done()


def test_refusals(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh) -> None:
    dt.manual_seed(0)
    model = Tower(3, mesh1d)
    with pytest.raises(ValueError, match="1-D mesh"):
        dt.replicate(model, mesh=mesh2d)
    with pytest.raises(ValueError, match="bucket_bytes"):
        dt.replicate(model, mesh=mesh1d, bucket_bytes=-1)
    with pytest.raises(TypeError, match="DeviceMesh"):
        dt.replicate(model, mesh="dp")  # type: ignore[arg-type]
    model.a.weight = nn.Parameter(model.a.weight.redistribute(placements=[S0]))
    with pytest.raises(dt.PlacementError, match=r"a\.weight"):
        dt.replicate(model, mesh=mesh1d)
    assert "_replicate_state" not in model.__dict__
    model.a.weight = nn.Parameter(model.a.weight.redistribute(placements=[R]))
    dt.replicate(model, mesh=mesh1d)
    with pytest.raises(ValueError, match="already applied"):
        dt.replicate(model, mesh=mesh1d)


@pytest.mark.skipif(SIZE == 1, reason="needs two ranks to differ")
def test_ranks_building_different_models_are_refused_on_every_rank(mesh1d: dt.DeviceMesh) -> None:
    """replicate is collective on its mesh, as DDP's constructor (which checks its parameters'
    shapes across the ranks): ranks whose models differ, or whose options do, raise
    SPMDDivergenceError in replicate on every rank, naming what differs; a refusal on one rank
    raises on every rank, and the wrappers after it keep one number on every rank."""
    dt.manual_seed(0)
    with pytest.raises(dt.SPMDDivergenceError, match=r"Tower's parameters \(names, shapes, dtypes, placements, meshes, requires_grad\) differ"):
        dt.replicate(Tower(3 if RANK == 0 else 4, mesh1d), mesh=mesh1d)
    with pytest.raises(dt.SPMDDivergenceError, match="bucket_bytes differs between ranks"):
        dt.replicate(Tower(3, mesh1d), mesh=mesh1d, bucket_bytes=0 if RANK == 0 else 200)
    # the replicated parameters' values too (a checksum each): ranks seeded differently, or
    # each wrapping another sibling of the same shapes (their buckets would pair silently)
    dt.manual_seed(RANK)
    with pytest.raises(dt.SPMDDivergenceError,  # (DTORCH_SPMD_DEBUG=1 refuses the seeds at the first random call)
                       match=r"replicated parameters hold different values|random state"):
        dt.replicate(Tower(3, mesh1d), mesh=mesh1d)
    dt.manual_seed(0)
    pair = Branches(mesh1d)
    with pytest.raises(dt.SPMDDivergenceError, match="replicated parameters hold different values"):
        dt.replicate(pair.a if RANK == 0 else pair.b, mesh=mesh1d)
    # (values made from the recipe, on a rank whose parameters are still deferred, agree with
    # the piece a rank already made: here rank 0 read a weight before wrapping)
    touched = Tower(3, mesh1d)
    if RANK == 0:
        touched.a.weight.to_local()
    dt.replicate(touched, mesh=mesh1d)
    # a refusal on one rank (here: rank 0 wraps its model again) raises on every rank, and
    # every rank counts the call, so the next wrapper has one number everywhere
    first, other = dt.replicate(Tower(3, mesh1d), mesh=mesh1d), Tower(3, mesh1d)
    with pytest.raises(ValueError, match=r"already applied to this Tower \[on rank 0\]"):
        dt.replicate(first if RANK == 0 else other, mesh=mesh1d)
    last = dt.replicate(Tower(3, mesh1d), mesh=mesh1d)
    titles = mesh1d.get_comm().allgather(last._replicate_state.title)
    assert len(set(titles)) == 1, titles


@pytest.mark.skipif(SIZE == 1, reason="needs two ranks to route apart")
@pytest.mark.parametrize("bucket", [0, nn.utils.BUCKET_BYTES])
def test_siblings_replicated_separately_are_told_apart(mesh1d: dt.DeviceMesh, bucket: int) -> None:
    """Two sibling layers of one shape, each replicated on its own: their buckets hold
    parameters of the same names (``weight``, ``bias``), so ranks that ran different siblings
    paired them and summed one sibling's gradient into the other's, silently. Each wrapper's
    number on the mesh (the order every rank wrapped in) is in the bucket's text: every rank
    raises SPMDDivergenceError naming both."""
    dt.manual_seed(0)
    model = Branches(mesh1d)
    for name in ("a", "b"):
        dt.replicate(model.get_submodule(name), mesh=mesh1d, bucket_bytes=bucket)
    x, y = _data(mesh1d)
    F.mse_loss(model(x), y).backward()
    for p in model.parameters():
        p.grad = None
    model.order = "a" if RANK % 2 == 0 else "b"
    with pytest.raises(dt.SPMDDivergenceError, match="different collective calls") as err:
        F.mse_loss(model(x), y).backward()
    numbers = re.findall(r"replicate #(\d+) \(Linear\) bucket of", str(err.value))
    assert len(set(numbers)) == 2, str(err.value)  # (a's wrapper and b's)


@pytest.mark.parametrize("bucket", [0, nn.utils.BUCKET_BYTES])
def test_a_second_backward_adds_to_reduced_gradients(mesh1d: dt.DeviceMesh, bucket: int, check: Checker) -> None:
    """Without zero_grad, a backward adds to the Replicate gradients of the previous one, as
    the blocking form (reduce_gradients after each backward) does."""
    grads = []
    for use in (None, bucket):
        dt.manual_seed(0)
        model = Tower(SIZE + 1, mesh1d)
        if use is not None:
            dt.replicate(model, mesh=mesh1d, bucket_bytes=use)
        for k in range(2):
            x, y = _data(mesh1d, seed=k)
            F.mse_loss(model(x), y).backward()
            if use is None:
                nn.utils.reduce_gradients(list(model.parameters()))
        grads.append({n: to_numpy(p.grad.to_torch()) for n, p in model.named_parameters()})
    for n in grads[0]:
        check.equal(grads[1][n], grads[0][n], f"{n} grad after two backwards")
    check.done()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_bucket_buffer_is_reused_and_never_under_a_kept_gradient(mesh1d: dt.DeviceMesh, set_to_none: bool,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     check: Checker) -> None:
    """A bucket of several gradients packs into a buffer the bucket keeps (``pool.Kept``, here
    from any size, whatever the shared pool's cap: a model whose buckets outgrew the cap
    mapped them afresh every step): gradients dropped by ``zero_grad()`` leave it to the next step, and with
    gradients zeroed in place (``set_to_none=False``) each step packs into one of the two steps
    before's, so no step maps a fresh one; gradients the program keeps from a step are never written by the later ones.
    Every step's gradients equal the blocking form's bitwise. (Step 0 fixes the bucket layout:
    its buckets are replaced.)"""
    import weakref

    from dtorch_mpi.comm import pool

    if mesh1d.device_type != "cpu":
        pytest.skip("CuPy buffers come from CuPy's own caching allocator")
    monkeypatch.setattr(pool, "POOLED_FROM", 1)
    monkeypatch.setattr(pool, "pool_cap", lambda: 0)  # the shared pool keeps nothing: the bucket's own does
    models = []
    for bucket in (None, nn.utils.BUCKET_BYTES):  # the blocking form; one bucket of all six
        dt.manual_seed(0)
        model = Tower(SIZE + 1, mesh1d)
        if bucket is not None:
            dt.replicate(model, mesh=mesh1d, bucket_bytes=bucket)
        models.append(model)
    names = [n for n, _ in models[0].named_parameters()]
    saved: list[tuple[list[Any], list[np.ndarray]]] = []  # gradients the program keeps, and their values
    buffers: list[Any] = []  # per step, a weak reference to the buffer the bucket's gradients view
    for step in range(5):
        x, y = _data(mesh1d, seed=step)
        grads = []
        for model in models:
            dt.optim.SGD(list(model.parameters()), lr=0.1).zero_grad(set_to_none=set_to_none)
            F.mse_loss(model(x), y).backward()
            if model is models[0]:
                nn.utils.reduce_gradients(list(model.parameters()))
            grads.append([p.grad.to_local() for p in model.parameters()])
        for name, blocking, bucketed in zip(names, *grads):
            check.equal(to_numpy(bucketed), to_numpy(blocking), f"step {step}: {name}.grad")
        del blocking, bucketed  # (a loop variable would hold the buffer)
        owners = {id(g.base) for g in grads[1]}
        check.true(len(owners) == 1 and grads[1][0].base is not None,
                   f"step {step}: the gradients view {len(owners)} buffers, not the bucket's one")
        base = grads[1][0].base
        buffers.append(weakref.ref(base))
        if step > 1:
            same = [earlier() is base for earlier in buffers[1:-1]]  # (steps 1 ..)
            if set_to_none:  # step 2's gradients are kept: step 3 packs into another, step 4 into it again
                expected = {2: [True], 3: [False, False], 4: [False, False, True]}[step]
                check.true(same == expected, f"step {step}: the same buffer as steps 1.. {same}, not {expected}")
            elif step > 2:  # one of the two steps before's, never a fresh one
                check.true(same[-1] or same[-2], f"step {step}: the same buffer as steps 1.. {same}")
        if step == 2 and set_to_none:
            saved.append((grads[1], [to_numpy(g).copy() for g in grads[1]]))
        del grads, base
    for arrays, values in saved:
        for name, g, v in zip(names, arrays, values):
            check.equal(to_numpy(g), v, f"{name}.grad kept from step 2, after two more steps")
    check.done()


def test_every_rank_makes_the_same_mpi_calls(check: Checker) -> None:
    """The MPI-call trace (tests/test_mpi_trace.py's tracing communicators): two replicate
    steps with several buckets make the same calls, in the same order, with matching counts on
    every rank. NumPy only: on a device the all-reduces are NCCL's (or staged) calls, not the
    mesh communicators' (the emulated NCCL compares every collective's call across ranks itself)."""
    from test_mpi_trace import _compare_groups, traced_count, tracing

    mesh = dt.init_device_mesh("cpu", (SIZE,))
    try:
        with tracing(mesh):
            dt.manual_seed(0)
            model = dt.replicate(Tower(SIZE + 1, mesh), mesh=mesh, bucket_bytes=200)
            calls = 0
            for step in range(2):
                x, y = _data(mesh, seed=step)
                F.mse_loss(model(x), y).backward()
                calls += traced_count(mesh)
                _compare_groups(mesh, f"replicate step {step}", check)
            check.true(SIZE == 1 or calls >= 2 * len(model.__dict__["_replicate_state"].layout()),
                       f"the tracing layer saw {calls} calls")
    finally:
        mesh.free()
    check.done()


def test_a_backward_that_raises_leaves_the_next_one_clean(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """A hook raises (on every rank) after some buckets started: their all-reduces complete at
    the next backward, which reduces its own gradients exactly as the blocking form does."""
    dt.manual_seed(0)
    plain = Tower(SIZE + 1, mesh1d)
    x, y = _data(mesh1d)
    F.mse_loss(plain(x), y).backward()
    nn.utils.reduce_gradients(list(plain.parameters()))
    want = {n: to_numpy(p.grad.to_torch()) for n, p in plain.named_parameters()}
    dt.manual_seed(0)
    model = dt.replicate(Tower(SIZE + 1, mesh1d), mesh=mesh1d, bucket_bytes=0)
    state = model.__dict__["_replicate_state"]
    F.mse_loss(model(x), y).backward()  # fixes the layout

    def fail(grad: dt.DTensor) -> None:
        raise ValueError("hook failed")

    for p in model.parameters():
        p.grad = None
    h = model.a(x)
    handle = h.register_hook(fail)  # a's backward runs last: b's and c's buckets have started
    with pytest.raises(ValueError, match="hook failed"):
        F.mse_loss(model.c(F.gelu(model.b(F.gelu(h, "tanh")), "tanh")), y).backward()
    handle.remove()
    check.true(state.next > 0, f"{state.next} buckets had started before the failure")
    for p in model.parameters():
        p.grad = None
    F.mse_loss(model(x), y).backward()
    for n, p in model.named_parameters():
        check.true(p.grad is not None and p.grad.placements == (R,), f"{n}: grad placed")
        check.equal(to_numpy(p.grad.to_torch()), want[n], f"{n} grad after a failed backward")
    check.done()


class _Experts(nn.Module):
    """Three experts of one shape; ``route`` names those that run (``e`` never does; none: the
    input passes through)."""

    def __init__(self, mesh: dt.DeviceMesh) -> None:
        super().__init__()
        self.c = nn.Linear(4, 4, device_mesh=mesh, dtype=np.float64)
        self.d = nn.Linear(4, 4, device_mesh=mesh, dtype=np.float64)
        self.e = nn.Linear(4, 4, device_mesh=mesh, dtype=np.float64)
        self.route = "cd"

    def forward(self, h: dt.DTensor) -> dt.DTensor:
        for name in self.route:
            h = h + getattr(self, name)(h)
        return h


class _Routed(nn.Module):
    """A shared layer, then the experts; ``gather`` adds a term whose backward is a collective on
    the data-parallel mesh (a sharded activation gathered in forward)."""

    def __init__(self, mesh: dt.DeviceMesh, gather: bool) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4, device_mesh=mesh, dtype=np.float64)
        self.experts = _Experts(mesh)
        self.head = nn.Linear(4, 3, device_mesh=mesh, dtype=np.float64)
        self.gather = gather

    def forward(self, x: dt.DTensor) -> dt.DTensor:
        h = F.gelu(self.shared(x), "tanh")
        if self.gather:
            h = h + h.redistribute(placements=[R]).sum(0) * 0.1
        return self.head(self.experts(h))


def _own_route() -> str:
    """Even ranks run expert c, odd ones d; with ``none``, rank 1 runs none."""
    return "c" if RANK % 2 == 0 else "d"


def _summed_by_hand(mesh: dt.DeviceMesh, model: nn.Module) -> dict[str, np.ndarray | None]:
    """The reference: each rank's own gradient terms (zeros where it has none; a ``Replicate``
    gradient, the whole one, only from the least rank holding one), summed across the ranks by
    a raw MPI all-reduce; None where no rank has a gradient."""
    from mpi4py import MPI

    comm = mesh.get_comm()
    out: dict[str, np.ndarray | None] = {}
    for name, p in model.named_parameters():
        whole = p.grad is not None and p.grad.placements == (R,)  # (used on replicated data)
        first = comm.allreduce(comm.Get_rank() if whole else comm.Get_size(), op=MPI.MIN)
        counted = p.grad is not None and (not whole or comm.Get_rank() == first)
        mine = np.ascontiguousarray(to_numpy(p.grad.to_local())) if counted else np.zeros(p.shape)
        total = np.empty_like(mine)
        comm.Allreduce(mine, total, op=MPI.SUM)
        anyone = comm.allreduce(p.grad is not None, op=MPI.LOR)
        out[name] = total if anyone else None
    return out


@pytest.mark.parametrize("case", ["plain", "gather", "zeros", "none", "replicated"])
@pytest.mark.parametrize("first", ["routed", "uniform"], ids=["routed-from-the-start", "after-a-uniform-step"])
@pytest.mark.parametrize("bucket", [0, nn.utils.BUCKET_BYTES])
def test_find_unused_parameters_reduces_what_each_rank_used(mesh1d: dt.DeviceMesh, bucket: int, first: str,
                                                            case: str, check: Checker) -> None:
    """Ranks route to different experts (DDP's ``find_unused_parameters``): a rank without an
    expert's gradient adds zeros for it, so every rank gets the sum of the terms the ranks
    that ran it computed (a raw MPI all-reduce of each rank's terms, zeros where it had none,
    is the reference), and the expert no rank ran keeps ``.grad`` None. Either the first
    backward routes already (the bucket order is rank 0's) or a uniform one fixed it; three
    SGD steps then leave every rank with the same parameters. Cases: ``gather``, a collective
    on the mesh inside backward (the buckets reduce after it on every rank, where a bucket a
    rank started in its hook had met it in another order); ``zeros``, ``zero_grad
    (set_to_none=False)`` (a zero ``Replicate`` gradient is a term like any); ``none``, only
    the experts replicated and rank 1 runs none of them (its backward reaches no parameter of
    the replicated module, and still adds its zeros); ``replicated``, the batch replicated, so
    every gradient is ``Replicate`` (the whole gradient: it counts once, from the least rank
    holding one; expert d, run by odd ranks only, came back as zeros when coordinate 0 counted
    it as accumulation does)."""
    x, y = _data(mesh1d)
    if case == "replicated":
        x, y = x.redistribute(placements=[R]), y.redistribute(placements=[R])
    models = []
    for _ in range(2):
        dt.manual_seed(0)
        models.append(_Routed(mesh1d, gather=case == "gather"))
    model, plain = models
    dt.replicate(model.experts if case == "none" else model, mesh=mesh1d, bucket_bytes=bucket,
                 find_unused_parameters=True)
    checked = model.experts if case == "none" else model
    opt = dt.optim.SGD(model.parameters(), lr=0.1)
    to_none = case != "zeros"
    if first == "uniform":
        F.mse_loss(model(x), y).backward()
        opt.zero_grad(set_to_none=to_none)
    route = "" if case == "none" and RANK == 1 else _own_route()
    model.experts.route = plain.experts.route = route
    for step in range(3):
        F.mse_loss(plain(x), y).backward()
        want = _summed_by_hand(mesh1d, plain.experts if case == "none" else plain)
        F.mse_loss(model(x), y).backward()
        for name, p in checked.named_parameters():
            w = want[name]
            if w is None:
                check.true(p.grad is None or (not to_none and not np.any(to_numpy(p.grad.to_local()))),
                           f"step {step}: {name} was used by no rank, yet has a gradient")
                continue
            assert p.grad is not None, (step, name)
            check.true(p.grad.placements == (R,), f"{name}: {p.grad.placements}")
            check.equal(p.grad.to_local(), w, f"step {step}: {name} grad", exact=False, rtol=1e-13, atol=1e-15)
        if case == "none":  # (the rest is not replicated: the reference's gradients, reduced by hand)
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                if not name.startswith("experts.") and q.grad is not None:
                    p.grad = q.grad.redistribute(placements=[R])
        opt.step()
        opt.zero_grad(set_to_none=to_none)
        for q in plain.parameters():  # (the reference follows the same parameters)
            q.grad = None
        for q, p in zip(plain.parameters(), model.parameters()):
            q.to_local()[...] = p.to_local()
    every = mesh1d.get_comm().allgather([to_numpy(p.to_local()) for p in model.parameters()])
    for r, theirs in enumerate(every):
        for a, b in zip(theirs, every[0]):
            check.equal(a, b, f"rank {r}'s parameters after three steps")
    check.done()


@pytest.mark.skipif(SIZE == 1, reason="needs two ranks to route apart")
@pytest.mark.parametrize("bucket", [0, nn.utils.BUCKET_BYTES])
def test_routing_apart_without_find_unused_parameters_names_the_flag(mesh1d: dt.DeviceMesh, bucket: int) -> None:
    """Without the flag the buckets differ between ranks that ran different experts: every
    rank raises SPMDDivergenceError, and a rank without a gradient names the flag, also where
    a whole bucket has none here (it makes a checked call of nothing)."""
    x, y = _data(mesh1d)
    dt.manual_seed(0)
    model = dt.replicate(_Routed(mesh1d, gather=False), mesh=mesh1d, bucket_bytes=bucket)
    F.mse_loss(model(x), y).backward()
    for p in model.parameters():
        p.grad = None
    model.experts.route = _own_route()
    with pytest.raises(dt.SPMDDivergenceError, match=r"find_unused_parameters=True") as err:
        F.mse_loss(model(x), y).backward()
    assert "no gradient here for experts.c" in str(err.value) or "no gradient here for experts.d" in str(err.value)
