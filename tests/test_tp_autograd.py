"""Tensor-parallel styles train the way a PyTorch user writes them (SPEC: "Parallel styles train
the way a PyTorch user writes them"): the default ``{"fc1": ColwiseParallel(), "fc2":
RowwiseParallel()}`` plan gives every parameter its gradient, equal to the replicated model's at
every rank count (sharding invariance, runs everywhere) and to PyTorch's own tensor-parallel run
over gloo (float64, 10 AdamW steps, to 1e-10; runs where ``torch`` is installed, skipped
otherwise). ``use_local_output=True``, which would cut the graph, is refused on every rank."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from backend_meshes import mesh1d_per_backend  # noqa: F401 (fixtures: this module's meshes, per array backend)
from conftest import RANK, SIZE, WORLD, Checker, lengths_for, on_mesh, reference

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.arrays import array_namespace
from dtorch_mpi.nn import functional as F

HIDDEN = sorted(set(lengths_for(SIZE)) | {6})  # 6: the Linear(4, 6)
TARGET = np.array([0, 1, 2, 0, 1])
ADAMW = {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}


def _mlp(mesh: dt.DeviceMesh, hidden: int) -> nn.Sequential:
    dt.manual_seed(3)  # sharding-invariant RNG: the same weights whatever the plan
    return nn.Sequential(nn.Linear(4, hidden, device_mesh=mesh, dtype=np.float64), nn.GELU(),
                         nn.Linear(hidden, 3, device_mesh=mesh, dtype=np.float64))


def _default_plan() -> dict[str, Any]:
    return {"0": dt.ColwiseParallel(), "2": dt.RowwiseParallel()}


def _step(model: nn.Sequential, opt: dt.optim.Optimizer, x: np.ndarray) -> dict[str, np.ndarray]:
    """One training step; returns every parameter's complete gradient (all ranks)."""
    opt.zero_grad()
    F.cross_entropy(model(x), TARGET).backward()
    params = list(model.parameters())
    nn.utils.reduce_gradients(params)
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = p.grad.to_torch() if p.grad is not None else None
    opt.step()
    return grads


@pytest.mark.parametrize("hidden", HIDDEN)
def test_default_tp_plan_trains_like_the_replicated_model(mesh1d: dt.DeviceMesh, check: Checker,
                                                          hidden: int) -> None:
    """Linear(4, h) -> GELU -> Linear(h, 3), cross_entropy, AdamW: the default plan's gradients
    and parameters equal the replicated model's, step by step; fc1 trains (its grad is
    Shard(0), as its weight), and the style's output supports the operators (``.relu()``)."""
    x = on_mesh(mesh1d, reference((5, 4), seed=1))  # a plain piece of the mesh's array library
    tp, rep = _mlp(mesh1d, hidden), _mlp(mesh1d, hidden)
    dt.parallelize_module(tp, mesh1d, _default_plan())
    check.true(tp[0].weight.placements == (dt.Shard(0),), "fc1 weight Shard(0)")
    check.true(isinstance(tp[0](x), dt.DTensor) and tp[0](x).relu().placements == (dt.Shard(1),),
               "Colwise's output is a Shard(-1) DTensor with the operators")
    opt_tp = dt.optim.AdamW(list(tp.named_parameters()), **ADAMW)
    opt_rep = dt.optim.AdamW(list(rep.named_parameters()), **ADAMW)
    for step in range(3):
        got, want = _step(tp, opt_tp, x), _step(rep, opt_rep, x)
        for name, g in want.items():
            if got[name] is None:
                check.true(False, f"step {step}: {name} got no gradient")
                continue
            check.equal(got[name], g, f"step {step}: grad of {name}", exact=False, rtol=1e-12, atol=1e-13)
        for (name, p), (_, q) in zip(tp.named_parameters(), rep.named_parameters()):
            check.equal(p.to_torch(), q.to_torch(), f"step {step}: {name}", exact=False, rtol=1e-12, atol=1e-13)
    check.true(tp[0].weight.grad is not None and tp[0].weight.grad.placements == (dt.Shard(0),),
               "fc1's gradient has its weight's placements")
    check.done()


def test_local_output_that_would_cut_the_graph_is_refused(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    """use_local_output=True returns a plain array only where nothing requires grad (no_grad,
    frozen parameters); with grad on it raises on every rank, naming the fix."""
    x = on_mesh(mesh1d, reference((5, 4), seed=1))
    plain = array_namespace(mesh1d.device_type).ndarray
    for style in (dt.ColwiseParallel(use_local_output=True), dt.RowwiseParallel(use_local_output=True,
                                                                                input_layouts=dt.Replicate())):
        lin = nn.Linear(4, 2 * SIZE + 1, device_mesh=mesh1d, dtype=np.float64)
        dt.parallelize_module(lin, mesh1d, style)
        name = type(style).__name__
        with pytest.raises(RuntimeError, match=rf"{name}\(use_local_output=True\).*autograd cannot follow.*"
                                               rf"use_local_output=False.*no_grad"):
            lin(x)
        with dt.no_grad():
            check.true(isinstance(lin(x), plain), f"{name}: a plain piece under no_grad")
        for p in lin.parameters():
            p.requires_grad_(False)
        check.true(isinstance(lin(x), plain), f"{name}: a plain piece with frozen parameters")
    emb = nn.Embedding(2 * SIZE + 1, 3, device_mesh=mesh1d, dtype=np.float64)
    dt.parallelize_module(emb, mesh1d, dt.RowwiseParallel(use_local_output=True))
    with pytest.raises(RuntimeError, match=r"RowwiseParallel\(use_local_output=True\)"):
        emb(on_mesh(mesh1d, np.array([0, 1])))
    check.done()


# --- against PyTorch itself (tensor parallel over gloo) ------------------------------------------

@pytest.fixture(scope="module")
def torch_tp() -> Iterator[Any]:
    """``torch`` with a gloo process group over this job's ranks (one host), or a skip."""
    torch = pytest.importorskip("torch")
    import torch.distributed as tdist

    hosts = WORLD.allgather(socket.gethostname())
    if len(set(hosts)) != 1 or not tdist.is_available() or not tdist.is_gloo_available():
        pytest.skip("PyTorch's tensor-parallel reference needs gloo and every rank on one host")
    port = 0
    if RANK == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = WORLD.bcast(port, root=0)
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=RANK, world_size=SIZE)
    yield torch
    tdist.destroy_process_group()


@pytest.mark.parametrize("hidden", [12, 2 * SIZE + 1])
def test_default_tp_plan_matches_pytorch(mesh1d: dt.DeviceMesh, check: Checker, torch_tp: Any, hidden: int) -> None:
    """The same plan, weights, data and AdamW in PyTorch's DTensor tensor parallel (gloo):
    gradients and parameters agree to 1e-10 over 10 steps in float64. PyTorch's default
    Colwise hands a local tensor whose global shape its Rowwise infers as an even split, so
    where ``hidden`` is uneven PyTorch's side uses ``ColwiseParallel(use_local_output=False)``
    (our default plan is the same on both)."""
    if mesh1d.device_type != "cpu":
        pytest.skip("PyTorch interop: the reference is PyTorch's CPU tensor parallel over gloo, fed NumPy "
                    "pieces; the device plan is checked against the replicated model above")
    torch = torch_tp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    x = reference((5, 4), seed=1)
    ours = _mlp(mesh1d, hidden)
    theirs = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 3)).double()
    with torch.no_grad():
        for p, q in zip(ours.parameters(), theirs.parameters()):
            q.copy_(torch.from_numpy(np.array(p.to_torch())))
    dt.parallelize_module(ours, mesh1d, _default_plan())
    colwise = ColwiseParallel() if hidden % SIZE == 0 else ColwiseParallel(use_local_output=False)
    parallelize_module(theirs, init_device_mesh("cpu", (SIZE,)), {"0": colwise, "2": RowwiseParallel()})
    opt_ours = dt.optim.AdamW(list(ours.named_parameters()), **ADAMW)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), **ADAMW, foreach=False)
    tx, tt = torch.from_numpy(x), torch.from_numpy(TARGET)
    worst = 0.0
    for step in range(10):
        got = _step(ours, opt_ours, x)
        opt_theirs.zero_grad()
        torch.nn.functional.cross_entropy(theirs(tx), tt).backward()
        want = {n: q.grad.full_tensor().numpy() for n, q in theirs.named_parameters()}
        opt_theirs.step()
        for name, g in want.items():
            if got[name] is None:
                check.true(False, f"step {step}: {name} got no gradient")
                continue
            worst = max(worst, float(np.max(np.abs(got[name] - g), initial=0.0)))
            check.equal(got[name], g, f"step {step}: grad of {name}", exact=False, rtol=1e-10, atol=1e-10)
        for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
            full = q.full_tensor().detach().numpy()
            worst = max(worst, float(np.max(np.abs(p.to_torch() - full), initial=0.0)))
            check.equal(p.to_torch(), full, f"step {step}: {name}", exact=False, rtol=1e-10, atol=1e-10)
    if RANK == 0:
        print(f"hidden={hidden}, {SIZE} ranks: largest |dtorch - PyTorch| over 10 AdamW steps {worst:.3g}")
    check.done()
