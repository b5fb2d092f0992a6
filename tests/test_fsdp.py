"""fully_shard (ZeRO-3): parameters stored Shard(0) owning their bytes, gradients equal to the
replicated model's (uneven and empty pieces, reshard_after_forward on and off), the
communication ZeRO-3 prescribes exactly (CommCounter, one step, per rank), prefetch in
forward and backward, state_dict / save / load across plans, and the refusals.
The training curves against the NumPy reference are in test_training.py (plans fsdp and
fsdp_keep). Every test runs per array backend (NumPy pieces, and CuPy ones on a
"cuda" mesh: the emulated CuPy under ``--device emulated``)."""

from __future__ import annotations

import gc
import os
import re
import sys
import tracemalloc
from typing import Any

import numpy as np
import pytest
from backend_meshes import mesh1d_per_backend, mesh2d_per_backend  # noqa: F401 (fixtures: this module's meshes, per array backend)
from conftest import RANK, SIZE, Checker, lengths_for, to_numpy
from helpers import Branches

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.arrays import array_namespace
from dtorch_mpi.comm import pool
from dtorch_mpi.mesh import live_caches
from dtorch_mpi.nn import functional as F
from dtorch_mpi.nn.fsdp import _Unit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import train_mlp

R, S0 = dt.Replicate(), dt.Shard(0)
RESHARD = [True, False]


class Tower(nn.Module):
    """Two layers around a hidden width ``width`` (0, below, equal to, above the rank count)."""

    def __init__(self, width: int, mesh: dt.DeviceMesh) -> None:
        super().__init__()
        self.a = nn.Linear(4, width, device_mesh=mesh, dtype=np.float64)
        self.b = nn.Linear(width, 3, device_mesh=mesh, dtype=np.float64)

    def forward(self, x: dt.DTensor) -> dt.DTensor:
        return self.b(F.gelu(self.a(x), "tanh"))


def _shard_all(model: nn.Module, mesh: dt.DeviceMesh, reshard: bool, layers: tuple[str, ...],
               prefetch: bool = True, after_step: bool = True) -> None:
    for name in layers:
        dt.fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=reshard, backward_prefetch=prefetch)
    dt.fully_shard(model, mesh=mesh, reshard_after_forward=reshard, backward_prefetch=prefetch,
                   prefetch_after_step=after_step)


def _grads(model: nn.Module, x: np.ndarray, y: np.ndarray, mesh: dt.DeviceMesh, steps: int = 1) -> dict[str, Any]:
    """Complete gradients after ``steps`` backwards (accumulated, no zero_grad)."""
    xd = dt.distribute_tensor(x, mesh, [S0])
    for _ in range(steps):
        out = model(xd)
        F.mse_loss(out, dt.distribute_tensor(y, mesh, out.placements)).backward()
    nn.utils.reduce_gradients(list(model.parameters()))
    return {k: to_numpy(p.grad.to_torch()) for k, p in model.named_parameters()}


@pytest.mark.parametrize("reshard", RESHARD)
@pytest.mark.parametrize("width", lengths_for(SIZE))
def test_gradients_equal_the_replicated_model(mesh1d: dt.DeviceMesh, width: int, reshard: bool,
                                              check: Checker) -> None:
    x = np.random.default_rng(3).standard_normal((5, 4))
    y = np.random.default_rng(4).standard_normal((5, 3))
    dt.manual_seed(0)
    plain = Tower(width, mesh1d)
    want = _grads(plain, x, y, mesh1d, steps=2)
    dt.manual_seed(0)
    model = Tower(width, mesh1d)
    params = dict(model.named_parameters())
    _shard_all(model, mesh1d, reshard, ("a", "b"))
    got = _grads(model, x, y, mesh1d, steps=2)  # two backwards accumulate into the shards
    for name, p in model.named_parameters():
        check.true(p is params[name], f"{name}: fully_shard keeps the Parameter object")
        check.true(p.placements == (S0,) and p.grad is not None and p.grad.placements == (S0,),
                   f"{name}: placed {p.placements}, grad {None if p.grad is None else p.grad.placements}")
        local = p.to_local()
        check.true(isinstance(local, array_namespace(mesh1d.device_type).ndarray), f"{name}: a {type(local)} shard")
        check.true(local.base is None and local.flags.owndata, f"{name}: the shard is a view of a larger array")
        check.equal(got[name], want[name], f"{name} grad", exact=False, rtol=0, atol=1e-12)
    for unit in (model.a._fsdp_unit, model.b._fsdp_unit):
        check.true(unit.state == "free", f"a unit is {unit.state} after backward")
        if mesh1d.device_type == "cpu":
            check.true(all(not v.any() for v in unit.buffer.views), "a freed buffer still holds its pages")
        else:  # device memory is handed back by dropping the allocation and every reference to it
            check.true(not unit.buffer.views and all(s.gathered.to_local() is None for s in unit.slots),
                       "a freed device buffer is still referenced")
    check.done()


def test_gradient_shards_stay_pooled_and_are_reused_once_dropped(mesh1d: dt.DeviceMesh,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   check: Checker) -> None:
    """Every collective output pooled (as from 256 KiB on): a shard's ``.grad`` is the
    reduce-scatter's output itself, a view of a pool owner (not copied); while the gradient
    is held the pool never hands that memory out, and once ``zero_grad`` drops it the owner is
    idle, so the next step's collective of that size writes into it (no fresh memory to fault
    in, issue 26); the values stay right."""
    if mesh1d.device_type != "cpu":
        pytest.skip("the host buffer pool (device buffers go to CuPy's caching allocator)")
    monkeypatch.setattr(pool, "POOLED_FROM", 1)
    for plans in live_caches("_plans"):  # a compiled plan chose its allocator: recompile
        plans.cache_clear()
    x = np.random.default_rng(3).standard_normal((7, 4))
    y = np.random.default_rng(4).standard_normal((7, 3))
    dt.manual_seed(0)
    want = _grads(Tower(SIZE + 2, mesh1d), x, y, mesh1d)
    dt.manual_seed(0)
    model = Tower(SIZE + 2, mesh1d)
    _shard_all(model, mesh1d, True, ("a", "b"))
    got = _grads(model, x, y, mesh1d)  # one backward: each .grad is the reduce-scatter's output
    owners = {id(o) for bucket in pool._owners.values() for o, _ in bucket}
    pooled = []
    for name, p in model.named_parameters():
        local = p.grad.to_local()
        check.equal(got[name], want[name], f"{name} grad", exact=False, rtol=0, atol=1e-12)
        if local.size:
            check.true(id(local.base) in owners, f"{name}: its .grad is not the collective's pooled output")
            other = pool.empty(np, local.shape, local.dtype)  # held: never handed out again
            check.true(not np.shares_memory(other, local), f"{name}: the pool handed out a .grad still held")
            pooled.append((name, p, id(local.base)))
        del local
    for name, p, owner_id in pooled:  # dropped (zero_grad): its owner is idle, to be handed out again
        p.grad = None
        entry = next(e for bucket in pool._owners.values() for e in bucket if id(e[0]) == owner_id)
        check.true(pool._find_idle([entry]) == 0, f"{name}: the owner of a dropped .grad is not idle")
    for plans in live_caches("_plans"):
        plans.cache_clear()
    check.done()


def _expected_bytes(model: nn.Module) -> int:
    """sum over parameters of (gathered piece - own shard) bytes: what an all-gather receives
    and a reduce-scatter sends on this rank (the gathered piece: the complete parameter, or
    its tensor-parallel piece on the 2-D plan)."""
    slots = [s for m in model.modules() if "_fsdp_unit" in m.__dict__ for s in m.__dict__["_fsdp_unit"].slots]
    assert len(slots) == len(list(model.parameters()))
    return sum(int(np.prod(s.gathered.spec.local_shape)) * s.gathered.dtype.itemsize - s.sharded.to_local().nbytes
               for s in slots)


PLANS = [p for p in ("fsdp", "fsdp_keep", "fsdp_tp") if train_mlp.mesh_shape(p, SIZE) is not None]


@pytest.mark.parametrize("plan", PLANS)
def test_communication_is_zero3(plan: str, xp_device: str, check: Checker) -> None:
    reshard = train_mlp.PLANS[plan]["fully_shard"]["reshard_after_forward"]
    shape = train_mlp.mesh_shape(plan, SIZE)
    assert shape is not None
    mesh = dt.init_device_mesh(xp_device, shape, mesh_dim_names=("dp", "tp")[:len(shape)])
    try:
        dt.manual_seed(0)
        model = train_mlp.MLP(3, mesh)
        train_mlp.apply_plan(model, plan)
        opt = dt.optim.AdamW(list(model.parameters()), lr=0.01)
        x_full, y_full = train_mlp.dataset("regression")
        x = dt.distribute_tensor(x_full, mesh, train_mlp.PLANS[plan]["batch"])
        y = dt.distribute_tensor(y_full, mesh, train_mlp.PLANS[plan]["batch"])
        smallest = min(p.size * p.dtype.itemsize for p in model.parameters())
        for step in range(3):  # from the second step on: the forward's prefetch, and the first
            opt.zero_grad()    # unit's gather started by the step before (prefetch_after_step)
            with dt.CommCounter() as moved:
                F.mse_loss(model(x), y).backward()
                opt.step()
            if step == 0:
                continue
            s = moved.summary()
            expect = _expected_bytes(model)
            gathered = sum(r.bytes_recv for r in moved.records if r.kind == "all_gather")
            scattered = sum(r.bytes_sent for r in moved.records if r.kind == "reduce_scatter")
            check.true(gathered == (2 if reshard else 1) * expect,
                       f"step {step}: all-gathers received {gathered}, ZeRO-3 says {(2 if reshard else 1)} x {expect}")
            check.true(scattered == expect, f"step {step}: reduce-scatters sent {scattered}, ZeRO-3 says {expect}")
            big = [r for r in moved.records if r.kind == "all_reduce" and r.bytes_sent >= smallest]
            check.true(plan == "fsdp_tp" or not big, f"step {step}: parameter-sized all-reduces {big}")
            check.true(set(k for k, _ in s) <= {"all_gather", "reduce_scatter", "all_reduce"}, f"kinds {s}")
            check.true(all(r.nonblocking for r in moved.records if r.kind in ("all_gather", "reduce_scatter")),
                       "FSDP collectives run nonblocking")
        for p, state in opt.state.items():
            check.true(p.placements[-1] == S0 and state["exp_avg"].spec == p.spec and state["exp_avg_sq"].spec == p.spec,
                       "optimizer state follows the sharded parameter")
    finally:
        mesh.free()
    check.done()


def test_next_units_gather_is_prefetched(mesh1d: dt.DeviceMesh, monkeypatch: pytest.MonkeyPatch,
                                         check: Checker) -> None:
    """On the second step every unit but the first of forward finds its all-gather already
    started (by the unit before it), and in backward every unit but the first of backward."""
    seen: list[tuple[str, str]] = []
    gather = _Unit.gather

    def logged(self: _Unit) -> None:
        seen.append((type(self.module).__name__ + getattr(self, "_name", ""), self.state))
        gather(self)

    dt.manual_seed(0)
    model = train_mlp.MLP(3, mesh1d)
    train_mlp.apply_plan(model, "fsdp")
    for name in ("fc1", "fc2", "head"):
        object.__setattr__(model.get_submodule(name)._fsdp_unit, "_name", "." + name)
    x_full, y_full = train_mlp.dataset("regression")
    x = dt.distribute_tensor(x_full, mesh1d, [S0])
    y = dt.distribute_tensor(y_full, mesh1d, [S0])
    F.mse_loss(model(x), y).backward()
    monkeypatch.setattr(_Unit, "gather", logged)
    out = model(x)
    forward = list(seen)
    seen.clear()
    F.mse_loss(out, y).backward()
    backward = [(n, st) for n, st in seen if n != "MLP"]
    check.true(forward[0] == ("MLP", "free") and all(st == "pending" for _, st in forward[1:]),
               f"forward: {forward}")
    check.true([n for n, _ in forward] == ["MLP", "Linear.fc1", "RowLinear.fc2", "Linear.head"], f"{forward}")
    check.true(backward[0] == ("Linear.head", "free") and [st for _, st in backward[1:]] == ["pending", "pending"],
               f"backward: {backward}")
    check.done()


@pytest.mark.parametrize("reshard", RESHARD)
def test_without_backward_prefetch_one_unit_is_whole_at_a_time(mesh1d: dt.DeviceMesh, reshard: bool,
                                                                monkeypatch: pytest.MonkeyPatch, check: Checker) -> None:
    """``backward_prefetch=False``: when a unit's backward starts, no other unit's gather and no
    reduce-scatter is in flight (with resharding its gathered parameters and gradients are the
    only whole ones; without, units stay gathered from forward by design), and the gradients
    are the replicated model's."""
    x = np.random.default_rng(3).standard_normal((5, 4))
    y = np.random.default_rng(4).standard_normal((5, 3))
    width = SIZE + 1
    dt.manual_seed(0)
    want = _grads(Tower(width, mesh1d), x, y, mesh1d, steps=2)
    dt.manual_seed(0)
    model = Tower(width, mesh1d)
    _shard_all(model, mesh1d, reshard, ("a", "b"), prefetch=False)
    seen: list[tuple[str, list[str], int]] = []
    pre_backward = _Unit._pre_backward

    def logged(self: _Unit, grad: dt.DTensor) -> None:
        pre_backward(self, grad)
        seen.append((type(self.module).__name__, [u.state for u in self.group.units if u is not self],
                     len(self.group.reducing)))

    monkeypatch.setattr(_Unit, "_pre_backward", logged)
    got = _grads(model, x, y, mesh1d, steps=2)
    check.true(len(seen) >= 4, f"pre-backward points: {seen}")
    for name, others, reducing in seen:
        check.true(all(st in (("free",) if reshard else ("free", "gathered")) for st in others) and reducing == 0,
                   f"{name}'s backward began with other units {others} and {reducing} reductions in flight")
    for name, grad in got.items():
        check.equal(grad, want[name], f"{name} grad", exact=False, rtol=0, atol=1e-12)
    check.done()


def test_state_dict_and_checkpoint_across_plans(shared_dir: str, xp_device: str, check: Checker) -> None:
    """A fully sharded model's state_dict holds Shard(0) DTensors of the complete values; saved
    with its optimizer and loaded into the replicated plan (and back) gives the same values."""
    mesh = dt.init_device_mesh(xp_device, (SIZE,), mesh_dim_names=("dp",))
    path = os.path.join(shared_dir, "fsdp.h5")
    try:
        dt.manual_seed(0)
        model = train_mlp.MLP(3, mesh)
        train_mlp.apply_plan(model, "fsdp")
        opt = dt.optim.SGD(list(model.named_parameters()), lr=0.1, momentum=0.9)
        x = dt.distribute_tensor(train_mlp.dataset("regression")[0], mesh, [S0])
        model(x).sum().backward()
        opt.step()
        sd = model.state_dict()
        check.true(all(v.placements == (S0,) for v in sd.values()), "state_dict keeps Shard(0)")
        values = {k: to_numpy(v.to_torch()) for k, v in sd.items()}
        moments = {id(p): to_numpy(s["momentum_buffer"].to_torch()) for p, s in opt.state.items()}
        dt.save({"model": model, "optim": opt}, path)
        dt.manual_seed(5)
        other = train_mlp.MLP(3, mesh)
        other_opt = dt.optim.SGD(list(other.named_parameters()), lr=0.1, momentum=0.9)
        dt.load(path, {"model": other, "optim": other_opt})  # into the replicated plan
        for k, p in other.named_parameters():
            check.true(p.placements == (R,), f"{k} stays Replicate")
            check.equal(p.to_torch(), values[k], f"{k} loaded replicated")
        for (k, p), (_, q) in zip(other.named_parameters(), model.named_parameters()):
            check.equal(other_opt.state[p]["momentum_buffer"].to_torch(), moments[id(q)], f"{k} momentum")
        dt.save({"model": other, "optim": other_opt}, path)
        dt.manual_seed(6)
        back = train_mlp.MLP(3, mesh)
        train_mlp.apply_plan(back, "fsdp")
        back_opt = dt.optim.SGD(list(back.named_parameters()), lr=0.1, momentum=0.9)
        dt.load(path, {"model": back, "optim": back_opt})  # and into the fully sharded plan
        for k, p in back.named_parameters():
            check.true(p.placements == (S0,), f"{k} stays Shard(0)")
            check.equal(p.to_torch(), values[k], f"{k} loaded sharded")
        out_back, out_model = back(x), model(x)
        check.equal(out_back.to_torch(), out_model.to_torch(), "forward after load")
    finally:
        mesh.free()
    check.done()


def test_no_grad_forward_equals_and_frees(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    x = dt.distribute_tensor(np.random.default_rng(1).standard_normal((5, 4)), mesh1d, [S0])
    dt.manual_seed(0)
    plain = Tower(5, mesh1d)
    dt.manual_seed(0)
    model = Tower(5, mesh1d)
    _shard_all(model, mesh1d, False, ("a", "b"))
    with dt.no_grad():
        got = model(x)
    check.equal(got.to_torch(), plain(x).to_torch(), "eval forward", exact=False, rtol=0, atol=1e-14)
    check.true(model.a._fsdp_unit.state == "free" and model.b._fsdp_unit.state == "free",
               "nothing stays gathered after a forward without backward")
    check.true(model.a.weight.placements == (S0,), "the module shows its sharded parameters outside forward")
    check.done()


def test_refusals(mesh1d: dt.DeviceMesh, mesh2d: dt.DeviceMesh) -> None:
    dt.manual_seed(0)
    with pytest.raises(ValueError, match="1-D mesh"):
        dt.fully_shard(Tower(3, mesh2d), mesh=mesh2d)
    with pytest.raises(dt.MeshMismatchError, match=r"a\.weight lives on"):
        dt.fully_shard(Tower(3, mesh2d), mesh=mesh1d)
    tp = Tower(3, mesh1d)
    dt.parallelize_module(tp, mesh1d, {"a": dt.ColwiseParallel()})
    dt.fully_shard(tp.b, mesh=mesh1d)
    with pytest.raises(dt.PlacementError, match=r"a.weight is placed \[Shard\(dim=0\)\] on the data-parallel mesh; fully_shard takes replicated"):
        dt.fully_shard(tp, mesh=mesh1d)
    twice = Tower(3, mesh1d)
    dt.fully_shard(twice, mesh=mesh1d)
    with pytest.raises(ValueError, match="already applied"):
        dt.fully_shard(twice, mesh=mesh1d)
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh"):
        dt.fully_shard(Tower(3, mesh1d), mesh="dp")  # type: ignore[arg-type]


class Pair(nn.Module):
    def __init__(self, mesh: dt.DeviceMesh) -> None:
        super().__init__()
        self.a = nn.Linear(4, 7, device_mesh=mesh, dtype=np.float64)
        self.b = nn.Linear(7, 3, device_mesh=mesh, dtype=np.float64)

    def forward(self, x: Any) -> Any:
        return self.b(F.gelu(self.a(x), "tanh"))


@pytest.mark.skipif(SIZE % 2 != 0, reason="a (2, N/2) mesh")
@pytest.mark.parametrize("ckpt", [False, True], ids=["", "checkpointed"])
@pytest.mark.parametrize("reshard", RESHARD)
def test_fsdp_over_tensor_parallel_styles(reshard: bool, ckpt: bool, xp_device: str, check: Checker) -> None:
    """torchtitan's 2-D recipe: parallelize_module on mesh['tp'], then fully_shard on mesh['dp'].
    The parameters become DTensors on the (tp, dp) order of the 2-D mesh, each tp piece split
    over dp (Colwise rows nest: the dp split inside the tp one); each dp group feeds its half of
    the batch, and the gradients (averaged over dp, as FSDP does) equal the replicated model's
    on the whole batch."""
    mesh = dt.init_device_mesh(xp_device, (2, SIZE // 2), mesh_dim_names=("dp", "tp"))
    try:
        x = np.random.default_rng(3).standard_normal((6, 4))
        y = np.random.default_rng(4).standard_normal((6, 3))
        dt.manual_seed(0)
        plain = Pair(mesh["tp"])
        F.mse_loss(plain(dt.distribute_tensor(x, mesh["tp"], [R])), dt.distribute_tensor(y, mesh["tp"], [R])).backward()
        want = {k: to_numpy(p.grad.to_torch()) for k, p in plain.named_parameters()}
        values = {k: to_numpy(p.to_torch()) for k, p in plain.named_parameters()}
        dt.manual_seed(0)
        model = Pair(mesh["tp"])
        dt.parallelize_module(model, mesh["tp"], {"a": dt.ColwiseParallel(use_local_output=False),
                                                  "b": dt.RowwiseParallel(use_local_output=False)})
        for layer in (model.a, model.b, model):
            dt.fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard)
        if ckpt:  # activation checkpointing on each 2-D unit
            for layer in (model.a, model.b):
                nn.utils.checkpoint_module(layer)
        placed = {k: p.placements for k, p in model.named_parameters()}
        check.true(placed == {"a.weight": (S0, S0), "a.bias": (S0, S0), "b.weight": (dt.Shard(1), S0),
                              "b.bias": (R, S0)}, f"placements {placed}")
        store = model.a.weight.device_mesh
        check.true(store.mesh_dim_names == ("tp", "dp") and np.array_equal(store.mesh, mesh.mesh.T), "store mesh")
        rows = np.array_split(np.arange(7), SIZE // 2)[mesh.get_coordinate()[1]]  # this rank's tp rows
        mine = np.array_split(rows, 2)[mesh.get_coordinate()[0]]  # split again over dp
        check.equal(model.a.weight.to_local(), values["a.weight"][mine], "the dp split nests inside the tp piece")
        for k, p in model.named_parameters():
            check.equal(p.to_torch(), values[k], f"{k} complete value")
        dp = mesh.get_coordinate()[0]
        half = slice(3 * dp, 3 * dp + 3)
        out = model(dt.distribute_tensor(x[half], mesh["tp"], [R]))
        F.mse_loss(out, dt.distribute_tensor(y[half], mesh["tp"], [R])).backward()
        for k, p in model.named_parameters():
            check.true(p.grad is not None and p.grad.spec == p.spec, f"{k}: grad placed like its parameter")
            check.equal(p.grad.to_torch(), want[k], f"{k} grad", exact=False, rtol=0, atol=1e-12)
        check.true("Shard" in dt.sharding_table(model.a.weight) if hasattr(dt, "sharding_table") else True,
                   "the layout shows in sharding_table")
    finally:
        mesh.free()
    check.done()


class Leaky(nn.Module):
    """Keeps a result of its parameter on itself and returns its input: the later use of
    ``leaky.h`` sends a gradient into the unit other than through its outputs."""

    def __init__(self, mesh: dt.DeviceMesh) -> None:
        super().__init__()
        self.w = nn.Parameter(dt.distribute_tensor(np.arange(12.0).reshape(3, 4), mesh, [R]))
        self.h: Any = None

    def forward(self, x: Any) -> Any:
        self.h = x @ self.w.T
        return x


def test_backward_on_freed_parameters_raises_on_every_rank(mesh1d: dt.DeviceMesh) -> None:
    x = dt.distribute_tensor(np.ones((5, 4)), mesh1d, [S0])
    leaky = dt.fully_shard(Leaky(mesh1d), mesh=mesh1d)
    leaky(x)
    with pytest.raises(RuntimeError, match="ran while its parameters were freed"):
        (leaky.h * leaky.h).sum().backward()
    assert leaky.w.grad is None
    kept = dt.fully_shard(Leaky(mesh1d), mesh=mesh1d, reshard_after_forward=False)
    kept(x)  # with the parameters kept after forward, the same program trains
    (kept.h * kept.h).sum().backward()
    w = np.arange(12.0).reshape(3, 4)
    want = 2 * (np.ones((5, 4)) @ w.T).T @ np.ones((5, 4))
    np.testing.assert_allclose(to_numpy(kept.w.grad.to_torch()), want, rtol=0, atol=1e-12)
    assert kept.w.grad.placements == (S0,)


def test_a_backward_that_raises_leaves_the_next_one_clean(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """A hook raising after some units' reduce-scatters started: the next backward's gradients
    are its own (the failed one's reductions complete but add to nothing)."""
    x_full, y_full = train_mlp.dataset("regression")
    x = dt.distribute_tensor(x_full, mesh1d, [S0])
    y = dt.distribute_tensor(y_full, mesh1d, [S0])
    dt.manual_seed(0)
    clean = train_mlp.MLP(3, mesh1d)
    train_mlp.apply_plan(clean, "fsdp")
    F.mse_loss(clean(x), y).backward()
    want = {k: to_numpy(p.grad.to_torch()) for k, p in clean.named_parameters()}
    dt.manual_seed(0)
    model = train_mlp.MLP(3, mesh1d)
    train_mlp.apply_plan(model, "fsdp")
    first = model.fc1._fsdp_unit.slots[0].gathered

    def fail(_leaf: dt.DTensor) -> None:
        raise ValueError("a hook failed")

    handle = first.register_post_accumulate_grad_hook(fail)
    with pytest.raises(ValueError, match="a hook failed"):
        F.mse_loss(model(x), y).backward()
    handle.remove()
    for p in model.parameters():
        p.grad = None
    F.mse_loss(model(x), y).backward()
    for k, p in model.named_parameters():
        check.equal(p.grad.to_torch(), want[k], f"{k} grad after a failed backward", exact=False, rtol=0, atol=1e-14)
    check.true(all(u.state == "free" for u in model._fsdp_unit.group.units), "every unit freed")
    check.done()


@pytest.mark.skipif(SIZE == 1, reason="needs two ranks to differ")
def test_ranks_building_different_models_are_refused_on_every_rank(mesh1d: dt.DeviceMesh) -> None:
    """fully_shard is collective on its mesh: ranks whose modules' parameters differ, or whose
    options do, raise SPMDDivergenceError in fully_shard on every rank, naming what differs
    (before, each sharded its own shape and the first gather paired what it could); a refusal
    on one rank raises on every rank, and the wrappers after it keep one number everywhere."""
    dt.manual_seed(0)
    with pytest.raises(dt.SPMDDivergenceError, match=r"Linear's parameters \(names, shapes, dtypes, placements, meshes, requires_grad\) differ"):
        dt.fully_shard(nn.Linear(4, 3 if RANK == 0 else 5, device_mesh=mesh1d, dtype=np.float64), mesh=mesh1d)
    with pytest.raises(dt.SPMDDivergenceError, match="reshard_after_forward differs between ranks"):
        dt.fully_shard(nn.Linear(4, 3, device_mesh=mesh1d, dtype=np.float64), mesh=mesh1d,
                       reshard_after_forward=RANK == 0)
    # placements are part of what every rank must share (what fully_shard refuses after the
    # check, it reads from them): a weight sharded on one rank only raises on every rank
    lone = nn.Linear(4, 3, device_mesh=mesh1d, dtype=np.float64)
    if RANK == 1:
        lone.weight = nn.Parameter(lone.weight.redistribute(placements=[S0]))  # (no communication)
    with pytest.raises(dt.SPMDDivergenceError, match=r"parameters \(names, shapes, dtypes, placements, meshes, requires_grad\) differ"):
        dt.fully_shard(lone, mesh=mesh1d)
    # the replicated parameters' values too (a checksum each): here each rank shards another
    # sibling of the same shapes (their gathers would pair silently)
    pair = Branches(mesh1d)
    with pytest.raises(dt.SPMDDivergenceError, match="replicated parameters hold different values"):
        dt.fully_shard(pair.a if RANK == 0 else pair.b, mesh=mesh1d)
    # a refusal on one rank (rank 0 shards its layer again) raises on every rank, and every
    # rank counts the call, so the next unit's root has one number everywhere
    first, other = dt.fully_shard(nn.Linear(4, 3, device_mesh=mesh1d, dtype=np.float64), mesh=mesh1d), \
        nn.Linear(4, 3, device_mesh=mesh1d, dtype=np.float64)
    with pytest.raises(ValueError, match=r"already applied to this Linear \[on rank 0\]"):
        dt.fully_shard(first if RANK == 0 else other, mesh=mesh1d)
    last = dt.fully_shard(nn.Linear(4, 3, device_mesh=mesh1d, dtype=np.float64), mesh=mesh1d)
    numbers = mesh1d.get_comm().allgather(last._fsdp_unit.group.number)
    assert len(set(numbers)) == 1, numbers


@pytest.mark.skipif(SIZE == 1, reason="needs two ranks to route apart")
def test_blocks_sharded_without_a_root_are_told_apart(mesh1d: dt.DeviceMesh) -> None:
    """Two sibling blocks of one shape, each sharded with no root over them: their gathers are
    named by parameter (``weight``, ``bias``) and class alike, so ranks that ran different
    blocks paired them and computed with each other's weights, silently. Each root's number
    among the wrappers on the mesh is in the text: every rank raises SPMDDivergenceError
    naming both."""
    dt.manual_seed(0)
    c = dt.fully_shard(nn.Linear(4, 3, device_mesh=mesh1d, dtype=np.float64), mesh=mesh1d)
    d = dt.fully_shard(nn.Linear(4, 3, device_mesh=mesh1d, dtype=np.float64), mesh=mesh1d)
    x = dt.distribute_tensor(np.random.default_rng(0).standard_normal((2 * SIZE, 4)), mesh1d, [S0])
    mine = c if RANK % 2 == 0 else d
    with pytest.raises(dt.SPMDDivergenceError, match="different collective calls") as err:
        (mine(x) ** 2).sum().backward()
    numbers = re.findall(r"\(fully_shard unit Linear, root #(\d+)\)", str(err.value))
    assert len(set(numbers)) == 2, str(err.value)  # (c's root and d's)


# --- fully_shard x activation checkpointing ---------------------------------------------------
class CkptBlock(nn.Module):
    """``x + fc2(dropout(gelu(fc1(norm(x)))))``, widths uneven over the ranks."""

    def __init__(self, d: int, mesh: dt.DeviceMesh) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, device_mesh=mesh, dtype=np.float64)
        self.fc1 = nn.Linear(d, 2 * d + 1, device_mesh=mesh, dtype=np.float64)
        self.fc2 = nn.Linear(2 * d + 1, d, device_mesh=mesh, dtype=np.float64)
        self.act, self.drop = nn.GELU(), nn.Dropout(0.3)

    def forward(self, x: Any) -> Any:
        return x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


def _ckpt_run(mesh: dt.DeviceMesh, how: str, reshard: bool, blocks: int = 3, d: int = 5) -> dict[str, np.ndarray]:
    """Loss, d/dx and every parameter's gradient (complete) after one backward; ``how``: plain
    (replicated, no checkpoint), shard-then-checkpoint, checkpoint-then-shard (each block is
    a unit and checkpointed), sequential (checkpoint_sequential segments spanning units)."""
    from dtorch_mpi.nn.checkpoint import apply_activation_checkpointing, checkpoint_sequential

    dt.manual_seed(11)
    model = nn.Sequential(*(CkptBlock(d, mesh) for _ in range(blocks)))
    is_block = lambda m: isinstance(m, CkptBlock)
    if how == "checkpoint-then-shard":
        apply_activation_checkpointing(model, is_block)
    if how != "plain":
        for b in model._modules.values():
            dt.fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
        dt.fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if how == "shard-then-checkpoint":
        apply_activation_checkpointing(model, is_block)
    x = dt.distribute_tensor(np.random.default_rng(5).standard_normal((2 * SIZE + 1, d)), mesh, [S0],
                             requires_grad=True)
    h = checkpoint_sequential(model, 2, x) if how == "sequential" else model(x)
    loss = (h * h * h).sum()
    loss.backward()
    out = {"loss": to_numpy(loss.to_torch()), "x": to_numpy(x.grad.to_torch())}  # type: ignore[union-attr]
    for k, p in model.named_parameters():
        if how != "plain":
            assert p.placements == (S0,) and p.grad is not None and p.grad.placements == (S0,), (k, p.placements)
        out[k] = to_numpy(p.grad.to_torch())  # type: ignore[union-attr]
    if how != "plain":
        assert all(u.state == "free" for u in model._fsdp_unit.group.units)
        assert all(b.fc1.weight.placements == (S0,) for b in model._modules.values()), \
            "the module's attributes point at the sharded parameters after backward"
    return out


@pytest.mark.parametrize("reshard", RESHARD)
@pytest.mark.parametrize("how", ["shard-then-checkpoint", "checkpoint-then-shard", "sequential"])
def test_fully_shard_composes_with_activation_checkpointing(mesh1d: dt.DeviceMesh, how: str, reshard: bool,
                                                            check: Checker) -> None:
    want = _ckpt_run(mesh1d, "plain", reshard)
    got = _ckpt_run(mesh1d, how, reshard)
    check.true(sorted(got) == sorted(want), f"the same parameters: {sorted(got)}")
    for k, w in want.items():
        check.equal(got[k], w, f"{how}: {k}", exact=False, rtol=0, atol=1e-12)
    check.done()


def test_checkpointed_units_gather_once_per_backward(mesh1d: dt.DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recompute computes on the gathered parameters its pre-backward hook gathered: one
    all-gather per unit in forward and one in backward (reshard_after_forward), as without
    checkpointing; the pre-backward hooks fire inside checkpointed regions."""
    from dtorch_mpi.nn.checkpoint import apply_activation_checkpointing
    counts: dict[str, int] = {}
    for label in ("plain", "checkpointed"):
        dt.manual_seed(1)
        model = nn.Sequential(*(CkptBlock(4, mesh1d) for _ in range(3)))
        for b in model._modules.values():
            dt.fully_shard(b, mesh=mesh1d)
        dt.fully_shard(model, mesh=mesh1d)
        if label == "checkpointed":
            apply_activation_checkpointing(model, lambda m: isinstance(m, CkptBlock))
        calls = {"n": 0, "pre": 0}
        real = _Unit.start_gather
        pre = _Unit._pre_backward

        def counting(self: _Unit) -> None:
            calls["n"] += self.state == "free" and bool(self.slots)
            real(self)

        def counting_pre(self: _Unit, grad: dt.DTensor) -> None:
            calls["pre"] += 1
            pre(self, grad)

        monkeypatch.setattr(_Unit, "start_gather", counting)
        monkeypatch.setattr(_Unit, "_pre_backward", counting_pre)
        x = dt.distribute_tensor(np.ones((3, 4)), mesh1d, [S0])
        (model(x) ** 2).sum().backward()
        monkeypatch.undo()
        counts[label] = calls["n"]
        assert calls["pre"] >= 3, f"{label}: the pre-backward hooks fired {calls['pre']} times"
    assert counts["plain"] == counts["checkpointed"] == 6, counts


# --- construction memory ----------------------------------------------------------------------
def _layers(width: int, layers: int, mesh: dt.DeviceMesh) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width, device_mesh=mesh, dtype=np.float64) for _ in range(layers)))


def test_building_and_fully_sharding_holds_at_most_one_complete_parameter(mesh1d: dt.DeviceMesh) -> None:
    """Deferred layer parameters are made directly as their Shard(0) pieces (tracemalloc peak of
    build + fully_shard <= model/N + one parameter), and each piece owns its bytes. On the
    emulated device the pieces are NumPy memory, which tracemalloc traces, so the same bound
    holds host and device allocations together; on a real GPU tracemalloc sees host memory
    only (CuPy's allocations are outside it), so there the bound could not fail: it skips."""
    if mesh1d.device_type != "cpu" and not getattr(sys.modules.get("cupy"), "EMULATED", False):
        pytest.skip("tracemalloc counts host memory only: CuPy's device allocations are not traced")
    layers, width = 8, 128
    dt.rand(width, width, dtype=np.float64, device_mesh=mesh1d)  # the generator's kept scratch, made once

    def build() -> nn.Module:
        model = _layers(width, layers, mesh1d)
        for layer in model._modules.values():
            dt.fully_shard(layer, mesh=mesh1d)
        dt.fully_shard(model, mesh=mesh1d)
        for p in model.parameters():
            p.to_local()
        return model

    tracemalloc.start()
    try:
        model = build()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    full = layers * (width * width + width) * 8
    one = width * width * 8
    goal, slack = full / SIZE + one, 96 << 10  # slack: modules, specs, closures, units
    if mesh1d.device_type != "cpu":  # the draw's three uint64 work buffers of a piece: kept on the
        # host from the warm-up draw above, fresh from the memory pool on every draw on a device
        goal += 3 * 8 * max(p.to_local().size for p in model.parameters())
    held = sum(p.to_local().nbytes for p in model.parameters())
    assert all(p.placements == (S0,) and p.to_local().base is None for p in model.parameters())
    print(f"{mesh1d.device_type}: peak {peak} bytes, bound {goal + slack:.0f}, model {full}, held {held}")
    assert peak <= goal + slack, f"peak {peak} bytes > model/N + one parameter {goal:.0f} (+{slack}); held {held}"


def _device_bytes_alive() -> int:
    """Bytes of NumPy array data alive now (NumPy's tracemalloc domain): on the emulated device
    its CuPy arrays too, whose memory is NumPy's."""
    gc.collect()
    snap = tracemalloc.take_snapshot().filter_traces(
        (tracemalloc.DomainFilter(inclusive=True, domain=np.lib.tracemalloc_domain),))
    return sum(t.size for t in snap.traces)


@pytest.mark.parametrize("reshard", RESHARD)
def test_units_between_steps_hold_only_their_shards_on_a_device(mesh1d: dt.DeviceMesh, reshard: bool,
                                                                 check: Checker) -> None:
    """Device memory cannot be handed back in place, so a freed unit drops its gathered buffer:
    after building and after each step (forward, backward, gradients dropped) the device arrays
    alive are the shards, not shards + the whole model (as they were before the buffer was
    dropped). Measured on the emulated device, whose arrays are NumPy memory that tracemalloc
    traces; host buffers are memory maps whose pages go back in place (untraced; the gradient
    test checks they read zeros); a real GPU's memory is not traced."""
    if mesh1d.device_type == "cpu":
        pytest.skip("host buffers are memory maps (pages handed back in place, not traced by tracemalloc)")
    if not getattr(sys.modules.get("cupy"), "EMULATED", False):
        pytest.skip("tracemalloc does not see a real GPU's memory")
    layers, width = 6, 64
    x = dt.distribute_tensor(np.ones((2 * SIZE + 1, width)), mesh1d, [S0])
    tracemalloc.start()
    try:
        base = _device_bytes_alive()
        dt.manual_seed(0)
        model = _layers(width, layers, mesh1d)
        for layer in model._modules.values():
            dt.fully_shard(layer, mesh=mesh1d, reshard_after_forward=reshard)
        dt.fully_shard(model, mesh=mesh1d, reshard_after_forward=reshard)
        shards = sum(p.to_local().nbytes for p in model.parameters())
        alive = {"built": _device_bytes_alive() - base}
        for step in range(2):
            out = model(x)
            (out * out).sum().backward()
            del out
            for p in model.parameters():
                p.grad = None
            alive[f"after step {step}"] = _device_bytes_alive() - base
    finally:
        tracemalloc.stop()
    layer = (width * width + width) * 8  # one layer's parameters: room for small kept arrays
    print(f"shards {shards}, model {layers * layer}, alive {alive}")
    for when, held in alive.items():
        check.true(held <= shards + layer, f"{when}: {held} bytes alive, shards {shards} (+{layer} allowed); "
                                           f"the model is {layers * layer}")
    check.done()


@pytest.mark.parametrize("made", [False, True], ids=["deferred", "already-made"])
def test_fully_shard_keeps_the_replicated_values(mesh1d: dt.DeviceMesh, made: bool, check: Checker) -> None:
    """A parameter fully_shard makes from its recipe and one whose values were made before both
    hold the replicated model's values (the sharding-invariant RNG)."""
    dt.manual_seed(2)
    want = {k: to_numpy(p.to_torch()) for k, p in _layers(SIZE + 1, 2, mesh1d).named_parameters()}
    dt.manual_seed(2)
    model = _layers(SIZE + 1, 2, mesh1d)
    if made:
        for p in model.parameters():
            p.to_local()
    for layer in model._modules.values():
        dt.fully_shard(layer, mesh=mesh1d)
    for k, p in model.named_parameters():
        check.true(p.placements == (S0,) and p.to_local().base is None, f"{k}: {p.placements}, owns its piece")
        check.equal(p.to_torch(), want[k], f"{k} value")
    check.done()


@pytest.mark.rank_independent
@pytest.mark.path_independent
def test_a_large_host_buffer_starts_on_a_huge_page_and_gives_its_memory_back() -> None:
    """A unit's host buffer of 2 MiB or more starts on a 2 MiB boundary (transparent huge
    pages, where the system allows them: a re-gather then faults once per 2 MiB, not per
    4 KiB page); release returns the memory and the views read zeros until written again."""
    from dtorch_mpi.nn.fsdp import _Buffer

    specs = [((512, 512), np.dtype(np.float64)), ((3,), np.dtype(np.float32))]
    buf = _Buffer(specs, "cpu")
    weight, bias = buf.views
    assert weight.ctypes.data % (2 << 20) == 0 and weight.shape == (512, 512) and bias.shape == (3,)
    assert bias.ctypes.data == weight.ctypes.data + weight.nbytes  # cache-line aligned, packed
    weight[...] = 1.0
    bias[...] = 2.0
    buf.release()
    assert not buf.ensure() and buf.views[0] is weight  # host memory: the same views, in place
    assert not weight.any() and not bias.any()
    weight[...] = 3.0
    assert float(weight.sum()) == 3.0 * weight.size
    small = _Buffer([((4,), np.dtype(np.float64))], "cpu")  # below 2 MiB: an ordinary map
    small.views[0][...] = 1.0
    assert float(small.views[0].sum()) == 4.0


def _mlp_step_records(mesh: dt.DeviceMesh, unshard: str) -> tuple[list[tuple[str, str]], list[Any], dict[str, np.ndarray]]:
    """One first step of the fsdp MLP, fc1 unsharded beforehand (``unshard``: "", "sync" or
    "async"): the state each unit's forward finds, the collectives, the complete gradients."""
    seen: list[tuple[str, str]] = []
    dt.manual_seed(0)
    model = train_mlp.MLP(3, mesh)
    train_mlp.apply_plan(model, "fsdp")
    x_full, y_full = train_mlp.dataset("regression")
    x = dt.distribute_tensor(x_full, mesh, [S0])
    y = dt.distribute_tensor(y_full, mesh, [S0])
    fc1 = model.get_submodule("fc1")
    with dt.CommCounter() as moved:
        handle = fc1.unshard(async_op=unshard == "async") if unshard else None
        assert (handle is None) == (unshard != "async")
        if unshard:
            seen.append(("fc1 after unshard", fc1._fsdp_unit.state))
        gather = _Unit.gather

        def logged(self: _Unit) -> None:
            seen.append((type(self.module).__name__, self.state))
            gather(self)

        _Unit.gather = logged  # type: ignore[method-assign]
        try:
            out = model(x)
        finally:
            _Unit.gather = gather  # type: ignore[method-assign]
        if handle is not None:
            handle.wait()  # after the forward finished it: a no-op
        F.mse_loss(out, y).backward()
    grads = {k: to_numpy(p.grad.to_torch()) for k, p in model.named_parameters()}
    return seen, [(r.kind, r.bytes_sent, r.bytes_recv) for r in moved.records], grads


def test_unshard_gathers_ahead_of_the_forward_without_a_second_gather(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """FSDP2's ``unshard``: the forward finds the unit's all-gather started (async) or done
    (sync) and does not gather again; the collectives and gradients equal a step without it."""
    plain_seen, plain_calls, plain_grads = _mlp_step_records(mesh1d, "")
    for how, state in (("async", "pending"), ("sync", "gathered")):
        seen, calls, grads = _mlp_step_records(mesh1d, how)
        check.true(seen[0] == ("fc1 after unshard", state), f"{how}: {seen[0]}")
        fc1_found = next(st for name, st in seen[1:] if name == "Linear")  # (fc1 runs before head)
        check.true(fc1_found == state, f"{how}: fc1's forward found it {fc1_found}")
        check.true(sorted(calls) == sorted(plain_calls), f"{how}: collectives {calls} against {plain_calls}")
        for name, g in grads.items():
            check.equal(g, plain_grads[name], f"{how}: {name} grad", exact=True)
    check.true(all(st == "free" for _, st in plain_seen), f"without unshard: {plain_seen}")
    check.done()


def _after_a_change(mesh: dt.DeviceMesh, change: str, unshard: str, path: str,
                    again: bool = False) -> tuple[np.ndarray, list[str]]:
    """The forward after one training step and a change of the shards (``step``: the
    optimizer's; ``load``: ``load_state_dict`` of another model's values; ``checkpoint``:
    ``dt.load`` of them from ``path``), with ``a`` unsharded (``async`` / ``sync``) before the
    change, or not at all (``""``), and with ``again`` once more after it; and the collectives
    that forward ran. Without ``prefetch_after_step``: the step would gather ``a`` itself."""
    dt.manual_seed(0)
    model = Tower(5, mesh)
    _shard_all(model, mesh, True, ("a", "b"), after_step=False)
    dt.manual_seed(1)
    other = Tower(5, mesh)
    _shard_all(other, mesh, True, ("a", "b"))
    opt = dt.optim.SGD(model.parameters(), lr=0.5)
    rng = np.random.default_rng(0)
    x = dt.distribute_tensor(rng.standard_normal((6, 4)), mesh, [S0])
    y = dt.distribute_tensor(rng.standard_normal((6, 3)), mesh, [S0])
    F.mse_loss(model(x), y).backward()
    if change != "step":
        opt.step()
        dt.save({"model": other}, path)
    handle = model.a.unshard(async_op=unshard == "async") if unshard else None
    if change == "step":
        opt.step()
    elif change == "load":
        model.load_state_dict(other.state_dict())
    else:
        dt.load(path, {"model": model})
    if again:
        handle = model.a.unshard(async_op=unshard == "async")
    if handle is not None:
        handle.wait()
    with dt.CommCounter() as moved:
        out = model(x)
    return to_numpy(out.to_torch()), [r.kind for r in moved.records]


@pytest.mark.parametrize("change", ["step", "load", "checkpoint"])
def test_a_unit_unsharded_before_its_shards_change_gathers_them_again(mesh1d: dt.DeviceMesh, change: str,
                                                                       shared_dir: str, check: Checker) -> None:
    """``unshard()`` before ``optimizer.step()``, ``load_state_dict`` or ``dt.load``: the
    gathered values are the old ones, so the forward gathers again (it used them, silently,
    before) and computes what it computes without the ``unshard``, with the same collectives;
    an ``unshard()`` after the change gathers again there, so the forward gathers nothing."""
    path = os.path.join(shared_dir, "other.h5")
    want, want_calls = _after_a_change(mesh1d, change, "", path)
    for how in ("async", "sync"):
        out, calls = _after_a_change(mesh1d, change, how, path)
        check.equal(out, want, f"{change} after unshard ({how}): the forward's output", exact=True)
        check.true(calls == want_calls, f"{change} after unshard ({how}): collectives {calls} against {want_calls}")
        out, calls = _after_a_change(mesh1d, change, how, path, again=True)
        check.equal(out, want, f"{change} between two unshards ({how}): the forward's output", exact=True)
        check.true(len(calls) < len(want_calls) or not want_calls,  # (one rank: nothing is communicated)
                   f"{change} between two unshards ({how}): the forward gathered again: {calls}")
    check.done()


def _steps_and_forward_gathers(mesh: dt.DeviceMesh, after_step: bool, steps: int, stepped: str = "all",
                               change: bool = False) -> tuple[list[np.ndarray], list[int], list[str]]:
    """``steps`` SGD steps of a Tower sharded as ``a``, ``b`` and the root: each forward's output,
    the all-gathers each forward made, and ``a``'s state after each step. ``stepped``: the
    optimizer's parameters (``"all"``, or ``"b"``: not the first unit's); ``change``: a
    ``load_state_dict`` of another model's values after each step."""
    dt.manual_seed(0)
    model = Tower(5, mesh)
    _shard_all(model, mesh, True, ("a", "b"), after_step=after_step)
    dt.manual_seed(1)
    other = Tower(5, mesh)
    params = model.parameters() if stepped == "all" else model.b.parameters()
    opt = dt.optim.SGD(params, lr=0.5)
    rng = np.random.default_rng(0)
    x = dt.distribute_tensor(rng.standard_normal((6, 4)), mesh, [S0])
    y = dt.distribute_tensor(rng.standard_normal((6, 3)), mesh, [S0])
    outs, gathers, states = [], [], []
    for _ in range(steps):
        opt.zero_grad()
        with dt.CommCounter() as moved:
            out = model(x)
        outs.append(to_numpy(out.to_torch()))
        gathers.append(sum(r.kind == "all_gather" for r in moved.records))
        F.mse_loss(out, y).backward()
        opt.step()
        states.append(model.a._fsdp_unit.state)
        if change:
            model.load_state_dict(other.state_dict())
    return outs, gathers, states


def test_the_step_starts_the_first_units_gather_for_the_next_forward(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """``prefetch_after_step`` (the default): an optimizer step that updates the forward's
    first unit starts its all-gather, so the next forward gathers one unit fewer and computes
    the same outputs, bit for bit, as without it. Not when the step leaves that unit alone,
    nor with ``prefetch_after_step=False``; shards changed after the step are gathered again."""
    steps = 3
    want, plain_gathers, plain_states = _steps_and_forward_gathers(mesh1d, False, steps)
    outs, gathers, states = _steps_and_forward_gathers(mesh1d, True, steps)
    for i in range(steps):
        check.equal(outs[i], want[i], f"step {i}: the forward's output", exact=True)
    communicates = SIZE > 1
    check.true(plain_states == ["free"] * steps, f"without prefetch_after_step, a after each step: {plain_states}")
    check.true(states == ["pending"] * steps, f"a after each step: {states}")
    first = 2 if communicates else 0  # a's weight and bias
    check.true(gathers == plain_gathers[:1] + [n - first for n in plain_gathers[1:]],
               f"the forwards' all-gathers {gathers}, without the prefetch {plain_gathers}")
    _, gathers_b, states_b = _steps_and_forward_gathers(mesh1d, True, steps, stepped="b")
    check.true(states_b == ["free"] * steps and gathers_b == plain_gathers,
               f"a step of b's parameters only: a {states_b}, gathers {gathers_b}")
    want_changed, plain_changed, _ = _steps_and_forward_gathers(mesh1d, False, steps, change=True)
    outs_changed, gathers_changed, _ = _steps_and_forward_gathers(mesh1d, True, steps, change=True)
    for i in range(steps):
        check.equal(outs_changed[i], want_changed[i], f"loaded after step {i}: the forward's output", exact=True)
    check.true(gathers_changed == plain_changed, f"loaded after each step: gathers {gathers_changed} "
                                                 f"against {plain_changed} (the prefetched ones are stale)")
    check.done()


def test_reshard_frees_an_unsharded_unit(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    dt.manual_seed(0)
    model = Tower(5, mesh1d)
    _shard_all(model, mesh1d, True, ("a", "b"))
    unit = model.a._fsdp_unit
    handle = model.a.unshard(async_op=True)
    handle.wait()
    check.true(unit.state == "gathered", f"after wait: {unit.state}")
    want = to_numpy(dt.DTensor(unit.slots[0].sharded.to_local(), unit.slots[0].sharded.spec).to_torch())
    check.equal(to_numpy(unit.slots[0].gathered.to_local()), want, "the gathered weight", exact=True)
    model.a.reshard()
    check.true(unit.state == "free", f"after reshard: {unit.state}")
    if mesh1d.device_type == "cpu":
        check.true(all(not v.any() for v in unit.buffer.views), "a resharded buffer still holds its pages")
    handle.wait()  # a no-op now: it does not gather again
    check.true(unit.state == "free", f"a stale handle's wait gathered again: {unit.state}")
    check.done()


@pytest.mark.parametrize("width", lengths_for(SIZE))
def test_gradient_sync_off_accumulates_without_reduce_scatters(mesh1d: dt.DeviceMesh, width: int,
                                                               check: Checker) -> None:
    """FSDP2's ``set_requires_gradient_sync(False)``: micro-batches' backwards move no
    gradient and leave the shards' ``.grad`` alone; the first backward with sync on reduces
    the sum, equal to the replicated model's accumulated gradients."""
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((5, 4)), rng.standard_normal((5, 3))) for _ in range(3)]
    dt.manual_seed(0)
    plain = Tower(width, mesh1d)
    dt.manual_seed(0)
    model = Tower(width, mesh1d)
    _shard_all(model, mesh1d, True, ("a", "b"))
    with pytest.raises(TypeError, match="set_requires_gradient_sync takes a bool, got 0"):
        model.set_requires_gradient_sync(0)  # type: ignore[arg-type]
    model.set_requires_gradient_sync(False, recurse=False)
    check.true(model.a._fsdp_unit.sync_gradients and not model._fsdp_unit.sync_gradients,
               "recurse=False reaches only the module's own unit")
    model.set_requires_gradient_sync(False)
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        if last:
            model.set_requires_gradient_sync(True)
        for m in (plain, model):
            xd = dt.distribute_tensor(x, mesh1d, [S0])
            with dt.CommCounter() as moved:
                out = m(xd)
                F.mse_loss(out, dt.distribute_tensor(y, mesh1d, out.placements)).backward()
            if m is model:
                scattered = [r for r in moved.records if r.kind == "reduce_scatter"]
                check.true(not scattered if not last else (bool(scattered) or SIZE == 1),
                           f"micro-batch {i}: reduce-scatters {scattered}")
                check.true(last or all(p.grad is None for p in model.parameters()),
                           f"micro-batch {i}: a shard's .grad was written with sync off")
    nn.utils.reduce_gradients(list(plain.parameters()))
    want = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        check.true(p.grad is not None and p.grad.placements == (S0,), f"{name}: grad {p.grad}")
        check.equal(to_numpy(p.grad.to_torch()), to_numpy(want[name].grad.to_torch()),
                    f"{name} grad", exact=False, rtol=0, atol=1e-12)
    check.done()


def _check_gradients_equal_reduced(plain: nn.Module, model: nn.Module, check: Checker) -> None:
    """``model``'s gradients equal ``plain``'s (the replicated reference) reduced."""
    nn.utils.reduce_gradients(list(plain.parameters()))
    want = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        check.equal(to_numpy(p.grad.to_torch()), to_numpy(want[name].grad.to_torch()),
                    f"{name} grad", exact=False, rtol=0, atol=1e-12)
    check.done()


def _accumulation_case(mesh: dt.DeviceMesh, seed: int,
                       micro: int) -> tuple[np.random.Generator, list[tuple[np.ndarray, np.ndarray]], nn.Module, nn.Module]:
    """``micro`` batches of 5 rows, a replicated Tower (the reference) and the same Tower
    fully_shard-ed (units a, b and the root), widths not divisible by the rank count."""
    rng = np.random.default_rng(seed)
    batches = [(rng.standard_normal((5, 4)), rng.standard_normal((5, 3))) for _ in range(micro)]
    dt.manual_seed(0)
    plain = Tower(SIZE + 1, mesh)
    dt.manual_seed(0)
    model = Tower(SIZE + 1, mesh)
    _shard_all(model, mesh, True, ("a", "b"))
    return rng, batches, plain, model


def test_a_failed_forward_keeps_the_accumulation_and_the_next_steps_train(mesh1d: dt.DeviceMesh,
                                                                         check: Checker) -> None:
    """A forward raising (a batch of the wrong width, after the first unit gathered and
    prefetched the next) between micro-batches with sync off: its gathers complete and are
    dropped, and the gradients accumulated before it are kept, so the next synced backward
    reduces the sum of the micro-batches that ran, as the replicated model's accumulation."""
    rng, batches, plain, model = _accumulation_case(mesh1d, seed=11, micro=2)
    for i, (x, y) in enumerate(batches):
        model.set_requires_gradient_sync(i == len(batches) - 1)
        for m in (plain, model):
            out = m(dt.distribute_tensor(x, mesh1d, [S0]))
            F.mse_loss(out, dt.distribute_tensor(y, mesh1d, out.placements)).backward()
        if i == 0:
            with pytest.raises(ValueError):
                model(dt.distribute_tensor(rng.standard_normal((5, 6)), mesh1d, [S0]))
            check.true(all(u.state == "free" and not u.pending for u in model._fsdp_unit.group.units),
                       "the failed forward's gathers left behind")
    _check_gradients_equal_reduced(plain, model, check)


def test_a_failed_backward_with_sync_off_drops_the_whole_accumulation(mesh1d: dt.DeviceMesh,
                                                                      check: Checker) -> None:
    """A backward raising midway with sync off: the gradients accumulated since the last synced
    backward cannot be told apart from the failed one's partial ones, so all are dropped; the
    next synced backward's gradients are its own alone (not a silent mix)."""
    _, batches, plain, model = _accumulation_case(mesh1d, seed=7, micro=3)
    model.set_requires_gradient_sync(False)

    def fail(_leaf: dt.DTensor) -> None:
        raise ValueError("a hook failed")

    for i, (x, y) in enumerate(batches):
        xd = dt.distribute_tensor(x, mesh1d, [S0])
        handle = model.b._fsdp_unit.slots[0].gathered.register_post_accumulate_grad_hook(fail) if i == 1 else None
        if i == 2:
            model.set_requires_gradient_sync(True)
        out = model(xd)
        loss = F.mse_loss(out, dt.distribute_tensor(y, mesh1d, out.placements))
        if handle is None:
            loss.backward()
            continue
        with pytest.raises(ValueError, match="a hook failed"):
            loss.backward()
        handle.remove()  # (the failed backward's state is discarded when the next one starts)
    out = plain(dt.distribute_tensor(batches[2][0], mesh1d, [S0]))
    F.mse_loss(out, dt.distribute_tensor(batches[2][1], mesh1d, out.placements)).backward()
    _check_gradients_equal_reduced(plain, model, check)


@pytest.mark.parametrize("root", [True, False], ids=["one_group", "blocks_without_root"])
def test_gradients_accumulated_unsynced_are_reduced_by_a_backward_that_skips_their_unit(
        mesh1d: dt.DeviceMesh, root: bool, check: Checker) -> None:
    """A unit used only in micro-batches with sync off: the synced backward, which never
    reaches it, still reduces what it accumulated (at the end of backward), also when the unit
    is a group of its own (blocks sharded without a root: no hook of its runs in that backward)."""
    rng = np.random.default_rng(6)
    batches = [(rng.standard_normal((5, 4)), rng.standard_normal((5, 3))) for _ in range(2)]
    dt.manual_seed(0)
    plain = Branches(mesh1d)
    dt.manual_seed(0)
    model = Branches(mesh1d)
    for block in (model.a, model.b):
        dt.fully_shard(block, mesh=mesh1d)
    if root:
        dt.fully_shard(model, mesh=mesh1d)
    for i, (x, y) in enumerate(batches):
        for block in (model.a, model.b):
            block.set_requires_gradient_sync(i == len(batches) - 1)
        for m in (plain, model):
            m.order = "ab" if i == 0 else "a"
            xd = dt.distribute_tensor(x, mesh1d, [S0])
            out = m(xd)
            F.mse_loss(out, dt.distribute_tensor(y, mesh1d, out.placements)).backward()
    nn.utils.reduce_gradients(list(plain.parameters()))
    want = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        check.true(p.grad is not None, f"{name}: its accumulated gradient was never reduced")
        if p.grad is not None:
            check.equal(to_numpy(p.grad.to_torch()), to_numpy(want[name].grad.to_torch()),
                        f"{name} grad", exact=False, rtol=0, atol=1e-12)
    check.true(not model.b._fsdp_unit.holds_gradients(), "b still holds a gathered gradient")
    check.done()
