"""Memory that shrinks with ranks (issue 25, SPEC "Scale-out training"): a sharded parameter's
piece owns only its bytes, building + sharding a model holds at most one complete parameter,
and activation checkpointing keeps only the inputs with bit-identical gradients."""

from __future__ import annotations

import gc
import math
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import SIZE, Checker, lengths_for, reference

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi import random as dtrandom
from dtorch_mpi.nn.deferred import is_deferred, materialize
from dtorch_mpi.nn.utils import apply_activation_checkpointing, checkpoint, checkpoint_module, checkpoint_sequential

R, S0, S1 = dt.Replicate(), dt.Shard(0), dt.Shard(1)
PAGE = 4096


def owns(local: Any) -> bool:
    """No view keeps a larger array alive (a collective's buffer is a page larger: comm/pool.py)."""
    base = local.base
    return base is None or base.nbytes <= local.nbytes + PAGE


# --- pieces own their bytes ----------------------------------------------------------------
def test_the_issue_reproducer_holds_only_its_shard(mesh1d: dt.DeviceMesh) -> None:
    lin = nn.Linear(64, 64, device_mesh=mesh1d)
    nn.ColwiseParallel().apply(lin, mesh1d)
    local = lin.weight.to_local()
    assert local.shape == lin.weight.spec.local_shape and (SIZE == 1 or local.shape[0] < 64)
    assert owns(local), (local.shape, local.base.shape)  # (base is not None here)


STYLES: dict[str, Callable[[], nn.ParallelStyle]] = {"colwise": nn.ColwiseParallel, "rowwise": nn.RowwiseParallel}


@pytest.mark.parametrize("touched", [False, True], ids=["deferred", "materialised"])
@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_styles_leave_pieces_that_own_their_bytes_and_the_replicated_values(
        kind: str, style: str, touched: bool, mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """Every length against the rank count (0, 1, below, equal, not divisible), a parameter
    still deferred or already made: after the style each piece owns its bytes and the
    parameter equals the one the replicated construction makes."""
    for n in lengths_for(SIZE):
        def build() -> nn.Module:
            dt.manual_seed(n)
            if kind == "linear":
                return nn.Linear(3, n, device_mesh=mesh1d, dtype=np.float64) if style == "colwise" \
                    else nn.Linear(n, 3, device_mesh=mesh1d, dtype=np.float64)
            return nn.Embedding(n, 3, device_mesh=mesh1d, dtype=np.float64) if style == "rowwise" \
                else nn.Embedding(3, n, device_mesh=mesh1d, dtype=np.float64)

        want = {name: p.to_torch().copy() for name, p in build().named_parameters()}
        mod = build()
        check.true(all(is_deferred(p) for p in mod.parameters()), f"n={n}: a new layer's parameters are deferred")
        if touched:
            for p in mod.parameters():
                p.to_local()
        STYLES[style]().apply(mod, mesh1d)
        for name, p in mod.named_parameters():
            if style == "rowwise" and name == "bias":  # left Replicate: made on first touch
                check.true(is_deferred(p) != touched, f"n={n} bias: deferred until touched")
            local = p.to_local()
            check.true(type(p) is nn.Parameter, f"n={n} {name}: a plain Parameter once made")
            check.true(owns(local), f"n={n} {name}: the piece is a view of a larger array")
            check.true(p.to_local().flags.c_contiguous, f"n={n} {name}: C-ordered")
            check.equal(p.to_torch(), want[name], f"n={n} {name} ({'touched' if touched else 'deferred'})")
    check.done()


def test_a_mixed_plan_leaves_only_owned_pieces(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """Embedding (vocab-parallel), Colwise, Rowwise and an untouched LayerNorm: every piece of
    every parameter owns its bytes and equals the replicated model's."""
    def build() -> nn.Module:
        dt.manual_seed(2)
        return nn.Sequential(nn.Embedding(2 * SIZE + 1, 6, device_mesh=mesh1d, dtype=np.float64),
                             nn.Linear(6, SIZE + 2, device_mesh=mesh1d, dtype=np.float64), nn.GELU(),
                             nn.Linear(SIZE + 2, 6, device_mesh=mesh1d, dtype=np.float64),
                             nn.LayerNorm(6, device_mesh=mesh1d, dtype=np.float64))
    want = {name: p.to_torch().copy() for name, p in build().named_parameters()}
    model = nn.parallelize_module(build(), mesh1d, {"0": nn.RowwiseParallel(), "1": nn.ColwiseParallel(),
                                                    "3": nn.RowwiseParallel()})
    for name, p in model.named_parameters():
        check.true(owns(p.to_local()), f"{name}: a view of a larger array")
        check.equal(p.to_torch(), want[name], name)
    check.done()


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_replicate_to_shard_copies_only_a_smaller_piece(dim: int, mesh1d: dt.DeviceMesh, check: Checker) -> None:
    for n in lengths_for(SIZE):
        shape = (n, 3) if dim == 0 else (3, n)
        full = reference(shape)
        x = dt.distribute_tensor(full, mesh1d, [R], src_data_rank=None)
        y = x.redistribute(placements=[dt.Shard(dim)])
        local = y.to_local()
        check.equal(y.to_torch(), full, f"{shape} Shard({dim})")
        check.true(owns(local), f"{shape} Shard({dim}): a view of {None if local.base is None else local.base.shape}")
        if SIZE == 1:
            check.true(local is x.to_local(), f"{shape}: one rank keeps the piece itself (no copy)")
    check.done()


def test_nested_and_two_dim_slices_own_their_bytes(mesh2d: dt.DeviceMesh, check: Checker) -> None:
    full = reference((2 * SIZE + 1, SIZE + 2))
    x = dt.distribute_tensor(full, mesh2d, [R, R], src_data_rank=None)
    for target in ([S0, S1], [S1, S0], [S0, S0], [R, S1], [S1, R]):
        y = x.redistribute(placements=target)
        check.equal(y.to_torch(), full, f"{target}")
        check.true(owns(y.to_local()), f"{target}: the piece is a view of a larger array")
    check.done()


def test_materialize_makes_the_piece_in_any_placements(mesh2d: dt.DeviceMesh, check: Checker) -> None:
    dt.manual_seed(5)
    want = nn.Linear(SIZE + 3, 2 * SIZE + 1, device_mesh=mesh2d, dtype=np.float64).weight.to_torch().copy()
    for target in ([S0, S1], [S1, S0], [R, S0], [R, R]):
        dt.manual_seed(5)
        w = nn.Linear(SIZE + 3, 2 * SIZE + 1, device_mesh=mesh2d, dtype=np.float64).weight
        materialize(w, target)
        check.true(w.placements == tuple(target) and not is_deferred(w), f"{target}: placed {w.placements}")
        check.true(owns(w.to_local()), f"{target}: owns its bytes")
        check.equal(w.to_torch(), want, f"{target}: the replicated construction's values")
    check.done()


def test_deferred_parameters_match_the_eager_formula(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """The per-piece fill is the factory call the layers made before (rand * 2b - b, randn,
    ones, zeros), bit for bit, and the random sequence advances the same."""
    for dtype in (np.float32, np.float64):
        dt.manual_seed(11)
        lin, emb, norm = (nn.Linear(7, 5, device_mesh=mesh1d, dtype=dtype), nn.Embedding(4, 3, device_mesh=mesh1d,
                          dtype=dtype), nn.LayerNorm(3, device_mesh=mesh1d, dtype=dtype))
        after = dtrandom.state()
        dt.manual_seed(11)
        bound = 1 / math.sqrt(7)  # a Python float, as the layer has
        w = dt.rand(5, 7, dtype=dtype, device_mesh=mesh1d) * (2 * bound) - bound
        b = dt.rand(5, dtype=dtype, device_mesh=mesh1d) * (2 * bound) - bound
        e = dt.randn(4, 3, dtype=dtype, device_mesh=mesh1d)
        check.true(dtrandom.state() == after, "the same random calls")
        for got, want, what in ((lin.weight, w, "weight"), (lin.bias, b, "bias"), (emb.weight, e, "embedding")):
            check.equal(got.to_torch(), want.to_torch(), f"{np.dtype(dtype)} {what}")
        check.equal(norm.weight.to_torch(), np.ones(3, dtype), "norm weight")
        check.equal(norm.bias.to_torch(), np.zeros(3, dtype), "norm bias")
    check.done()


def _peak(build: Callable[[], Any]) -> tuple[int, Any]:
    tracemalloc.start()
    try:
        out = build()
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


def test_building_and_sharding_holds_at_most_one_complete_parameter(mesh1d: dt.DeviceMesh) -> None:
    layers, width = 8, 128
    dt.rand(width, width, dtype=np.float64, device_mesh=mesh1d)  # the generator's kept scratch, made once

    def build() -> nn.Module:
        model = nn.Sequential(*(nn.Linear(width, width, device_mesh=mesh1d, dtype=np.float64) for _ in range(layers)))
        nn.parallelize_module(model, mesh1d, {"*": nn.ColwiseParallel()})
        for p in model.parameters():
            p.to_local()
        return model

    peak, model = _peak(build)
    full = layers * (width * width + width) * 8
    one = width * width * 8
    held = sum(p.to_local().nbytes for p in model.parameters())
    goal = full / SIZE + one
    slack = 96 << 10  # modules, specs, closures
    assert all(owns(p.to_local()) for p in model.parameters())
    assert peak <= goal + slack, f"peak {peak} bytes > model/N + one parameter {goal:.0f} (+{slack}); held {held}"
    assert held <= full / SIZE + (width * 8 if SIZE > 1 else 0) * layers + 1


# --- activation checkpointing ----------------------------------------------------------------
class Block(nn.Module):
    """``x + fc2(dropout(gelu(fc1(norm(x)))))``."""

    def __init__(self, d: int, mesh: dt.DeviceMesh, tp: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, device_mesh=mesh, dtype=np.float64)
        self.fc1 = nn.Linear(d, 2 * d + 1, device_mesh=mesh, dtype=np.float64)
        self.fc2 = nn.Linear(2 * d + 1, d, device_mesh=mesh, dtype=np.float64)
        self.act, self.drop = nn.GELU(), nn.Dropout(0.4)
        if tp:
            nn.ColwiseParallel(use_local_output=False).apply(self.fc1, mesh)
            nn.RowwiseParallel(use_local_output=False).apply(self.fc2, mesh)

    def forward(self, x: Any) -> Any:
        return x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


def _run(mesh: dt.DeviceMesh, tp: bool, how: str, blocks: int = 3, d: int = 5,
         batch: int = 2 * SIZE + 1) -> tuple[list[np.ndarray], Any]:
    dt.manual_seed(7)
    model = nn.Sequential(*(Block(d, mesh, tp) for _ in range(blocks)))
    x = dt.distribute_tensor(reference((batch, d), seed=3), mesh, [R if tp else S0], src_data_rank=None,
                             requires_grad=True)
    if how == "plain":
        h = model(x)
    elif how == "checkpoint":
        h = x
        for b in model._modules.values():
            h = checkpoint(b, h)
    elif how == "sequential":
        h = checkpoint_sequential(model, blocks, x)
    else:
        apply_activation_checkpointing(model, lambda m: isinstance(m, Block))
        h = model(x)
    loss = (h * h * h).sum()
    loss.backward()
    grads = [x.grad.to_torch()] + [p.grad.to_torch() for p in model.parameters()]  # type: ignore[union-attr]
    return [loss.to_torch(), *grads], dtrandom.state()


@pytest.mark.parametrize("how", ["checkpoint", "sequential", "per-block"])
@pytest.mark.parametrize("tp", [False, True], ids=["batch-sharded", "tensor-parallel"])
def test_checkpointed_gradients_are_bit_identical(how: str, tp: bool, mesh1d: dt.DeviceMesh, check: Checker) -> None:
    want, state = _run(mesh1d, tp, "plain")
    got, got_state = _run(mesh1d, tp, how)
    check.true(len(got) == len(want), "as many gradients")
    for i, (g, w) in enumerate(zip(got, want)):
        check.equal(g, w, f"{how}: value {i} (0: loss, 1: d/dx, then the parameters')")
    check.true(got_state == state, f"the random sequence ends where the plain run's does: {got_state} != {state}")
    check.done()


def _skipped_names(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The operations a recompute leaves uncomputed, appended to as they are (autograd/skipping.py)."""
    from dtorch_mpi.autograd import skipping

    names: list[str] = []
    real = skipping.stand_in

    def spy(name: str, operands: Any, xp: Any) -> Any:
        kernel = real(name, operands, xp)
        if kernel is not None:
            names.append(name)
        return kernel

    monkeypatch.setattr(skipping, "stand_in", spy)
    return names


def test_the_recompute_stops_where_no_backward_reads_on(mesh1d: dt.DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """The early stop: in ``x + fc2(h)`` the last matmul (it saves h and the weight, not its
    result) and the two additions are recorded without computing them, per block; under tensor
    parallelism fc2's result goes through a redistribute, whose backward is not one an operator
    declares, so the matmul runs. The gradients stay bit-identical (the test above)."""
    names = _skipped_names(monkeypatch)
    _run(mesh1d, False, "checkpoint")
    assert names == ["matmul", "add", "add"] * 3, names
    names.clear()
    _run(mesh1d, True, "checkpoint")
    assert names == ["add", "add"] * 3 if SIZE > 1 else ["matmul", "add", "add"] * 3, names


@pytest.mark.parametrize("case", ["exp-last", "mul-last", "detached", "detached-sum", "nested"])
def test_results_a_backward_reads_are_recomputed(case: str, mesh1d: dt.DeviceMesh, monkeypatch: pytest.MonkeyPatch,
                                                 check: Checker) -> None:
    """``exp`` keeps its own result, so it and the matmul before it run; ``x * (x @ w)`` keeps
    both factors, so only the product is skipped; in ``x * (t.detach() * 2)`` the matmul making
    ``t`` has no consumer the graph shows, but the product keeps a value made from it, and in
    ``exp(x + t.detach())`` the sum is computed from it: nothing is skipped; a checkpoint inside a checkpoint makes a node
    the outer one did not see, so the outer recompute skips nothing of its own (its last
    product would be), the inner one its matmul and addition."""
    w0 = reference((5, 5), seed=2) / 5
    x0 = reference((2 * SIZE + 1, 5), seed=4)
    fns = {"exp-last": lambda x, w: (x @ w).exp(),
           "mul-last": lambda x, w: x * (x @ w),
           "detached": lambda x, w: x * ((x @ w).detach() * 2.0),
           "detached-sum": lambda x, w: (x + (x @ w).detach()).exp(),
           "nested": lambda x, w: checkpoint(lambda y: (y @ w) + y, x) * 3.0}
    want_skipped = {"exp-last": [], "mul-last": ["mul"], "detached": [], "detached-sum": [], "nested": ["matmul", "add"]}

    def grads(use: bool) -> list[np.ndarray]:
        x = dt.distribute_tensor(x0, mesh1d, [S0], src_data_rank=None, requires_grad=True)
        w = dt.distribute_tensor(w0, mesh1d, [R], src_data_rank=None, requires_grad=True)
        out = checkpoint(fns[case], x, w) if use else fns[case](x, w)
        (out * out).sum().backward()
        return [t.grad.to_torch() for t in (x, w) if t.grad is not None]  # (w has none when detached)

    want = grads(False)
    names = _skipped_names(monkeypatch)
    got = grads(True)
    check.true(names == want_skipped[case], f"{case}: skipped {names}")
    check.true(len(got) == len(want), f"{case}: as many gradients")
    for g, v, what in zip(got, want, ("d/dx", "d/dw")):
        check.equal(g, v, f"{case}: {what}")
    check.done()


def test_dropout_masks_are_replayed_not_redrawn(mesh1d: dt.DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay is what makes the gradients equal: recomputing without it draws new masks."""
    want, _ = _run(mesh1d, False, "plain")
    monkeypatch.setattr(dtrandom, "set_state", lambda state: None)
    got, _ = _run(mesh1d, False, "checkpoint")
    assert not all(np.array_equal(g, w) for g, w in zip(got[1:], want[1:]))


def _array_bytes() -> int:
    """Bytes of NumPy array data alive now (NumPy's own tracemalloc domain: no Python objects,
    whose free lists would blur the count)."""
    snap = tracemalloc.take_snapshot().filter_traces(
        (tracemalloc.DomainFilter(inclusive=True, domain=np.lib.tracemalloc_domain),))
    return sum(t.size for t in snap.traces)


def test_checkpoint_keeps_only_the_inputs(mesh1d: dt.DeviceMesh) -> None:
    """After the forward of 6 blocks (d 32, ffn 65, 32 rows a rank) the arrays a checkpointed
    stack keeps are the block outputs (each the next block's input); the plain stack keeps every
    block's activations."""
    d, blocks, rows = 32, 6, 32 * SIZE
    dt.manual_seed(1)
    model = nn.Sequential(*(Block(d, mesh1d, False) for _ in range(blocks)))
    for p in model.parameters():
        p.to_local()
    x = dt.distribute_tensor(reference((rows, d)), mesh1d, [S0], src_data_rank=None, requires_grad=True)
    model(x).sum().backward()  # warm-up: compiled plans and kept buffers are not activations

    def kept(use: bool) -> int:
        gc.collect()
        tracemalloc.start()
        try:
            base = _array_bytes()
            h: Any = x
            for b in model._modules.values():
                h = checkpoint(b, h) if use else b(h)
            held = _array_bytes() - base
        finally:
            tracemalloc.stop()
        h.sum().backward()
        return held

    piece = x.to_local().nbytes
    plain, ckpt = kept(False), kept(True)
    budget = blocks * piece + 4096  # each block's output (+ room for a few scalars: under one piece)
    print(f"arrays kept: checkpointed {ckpt}, plain {plain}, budget {budget}")
    assert ckpt <= budget and plain > 3 * ckpt, \
        f"kept {ckpt} bytes of arrays checkpointed (budget {budget}), {plain} plain; one input is {piece}"


def test_checkpoint_errors_raise_on_every_rank(mesh1d: dt.DeviceMesh) -> None:
    w = dt.distribute_tensor(reference((3, 3)), mesh1d, [R], src_data_rank=None, requires_grad=True)
    x = dt.distribute_tensor(reference((2, 3), seed=1), mesh1d, [R], src_data_rank=None, requires_grad=True)
    with pytest.raises(TypeError, match="one DTensor result"):
        checkpoint(lambda a: (a @ w, a), x)
    y = checkpoint(lambda a: (a * 2.0) @ w, x)
    x2 = dt.distribute_tensor(reference((2, 3), seed=2), mesh1d, [R], src_data_rank=None, requires_grad=True)
    z = checkpoint(lambda a: a @ w, x2)
    with dt.no_grad():  # as an optimizer step between forward and backward would
        x2 += 1.0
    with pytest.raises(RuntimeError, match="modified in place"):
        z.sum().backward()
    calls = []

    def moody(a: dt.DTensor) -> dt.DTensor:
        calls.append(1)
        return a @ w if len(calls) == 1 else (a @ w).relu()

    with pytest.raises(RuntimeError, match="recorded other operations"):
        checkpoint(moody, x).sum().backward()
    y.sum().backward()  # an unrelated checkpoint still works
    assert np.allclose(w.grad.to_torch(), (2.0 * reference((2, 3), seed=1)).T @ np.ones((2, 3)))  # type: ignore[union-attr]


def test_checkpoint_without_grad_just_calls(mesh1d: dt.DeviceMesh) -> None:
    x = dt.distribute_tensor(reference((2, 3)), mesh1d, [R], src_data_rank=None, requires_grad=True)
    with dt.no_grad():
        y = checkpoint(lambda a: a * 2.0, x)
    assert y.grad_fn is None
    plain = np.arange(3.0)
    assert checkpoint(lambda a: a + 1, plain).tolist() == [1.0, 2.0, 3.0]


def test_checkpoint_module_keeps_names_and_wraps_once(mesh1d: dt.DeviceMesh) -> None:
    block = Block(4, mesh1d, False)
    names = [n for n, _ in block.named_parameters()]
    checkpoint_module(block)
    first = block.forward
    checkpoint_module(block)
    assert block.forward is first and [n for n, _ in block.named_parameters()] == names
