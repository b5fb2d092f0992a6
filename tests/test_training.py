"""Sharding-invariant training: examples/train_mlp.py's loop under every plan valid at this
world size (replicated, data parallel, tensor parallel, both on a 2-D mesh, fully sharded
data parallel with and without resharding after forward, and over the dp dim of the 2-D
tensor-parallel plan), with SGD +
momentum and AdamW, on a regression (mse_loss) and a classification (vocab-parallel
cross_entropy) task, equals a single-process NumPy reference of the same math (forward and
backward by hand, the optimizers' formulas) step by step, in float64, to 1e-9. Training state
saved under one plan and resumed under another continues the uninterrupted run exactly. Every
test runs per array backend (``xp_device``: NumPy pieces, and CuPy ones on a "cuda" mesh, the
emulated CuPy under ``--device emulated``)."""

from __future__ import annotations

import os
import sys
from typing import Any

import h5py
import numpy as np
import pytest
from conftest import SIZE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import train_mlp

import dtorch_mpi as dt
from dtorch_mpi.nn import functional as F

PLANS = [p for p in sorted(train_mlp.PLANS) if train_mlp.mesh_shape(p, SIZE) is not None]
STEPS = 4


@pytest.mark.parametrize("task", sorted(train_mlp.OUT))
@pytest.mark.parametrize("optimizer", sorted(train_mlp.OPTIMIZERS))
@pytest.mark.parametrize("plan", PLANS)
def test_training_matches_the_numpy_reference(plan: str, optimizer: str, task: str, xp_device: str) -> None:
    losses, initial, final = train_mlp.train(plan, optimizer, task, steps=STEPS, device=xp_device)
    want_losses, want_final = train_mlp.reference(initial, optimizer, task, steps=STEPS)
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-9)
    assert losses[-1] < losses[0], f"loss did not decrease: {losses}"
    for name, value in want_final.items():
        np.testing.assert_allclose(final[name], value, rtol=0, atol=1e-9, err_msg=name)
        assert not np.allclose(value, initial[name]), f"{name} did not move"


def test_plans_place_parameters_and_reduce_gradients_packed(xp_device: str) -> None:
    """The tp/dp_tp plans shard the parameters as declared, and one step's gradient reduction
    is packed: data parallel all-reduces all six gradients in one collective."""
    mesh = dt.init_device_mesh(xp_device, (SIZE,))
    try:
        dt.manual_seed(0)
        model = train_mlp.MLP(3, mesh)
        train_mlp.apply_plan(model, "dp")
        x_full, y_full = train_mlp.dataset("regression")
        x = dt.distribute_tensor(x_full, mesh, [dt.Shard(0)])
        out = model(x)
        dt.nn.functional.mse_loss(out, dt.distribute_tensor(y_full, mesh, out.placements)).backward()
        params = list(model.parameters())
        assert all(p.grad is not None and p.grad.placements == (dt.Partial(),) for p in params)
        with dt.CommCounter() as moved:
            dt.nn.utils.reduce_gradients(params)
        assert moved.kinds() == (["all_reduce"] if SIZE > 1 else [])
        assert all(p.grad is not None and p.grad.placements == p.placements for p in params)
        dt.manual_seed(0)
        model = train_mlp.MLP(5, mesh)
        train_mlp.apply_plan(model, "tp")
        placed = {k: p.placements for k, p in model.named_parameters()}
        assert placed["fc1.weight"] == (dt.Shard(0),) and placed["fc2.weight"] == (dt.Shard(1),)
        assert placed["head.weight"] == (dt.Shard(0),) and placed["fc2.bias"] == (dt.Replicate(),)
        assert all(p.is_leaf for p in model.parameters())
    finally:
        mesh.free()


# ---- training state in checkpoints: save under one plan, resume under another ----

RESUMES = [(a, b) for a, b in (("tp", "dp"), ("dp", "tp"), ("replicated", "dp_tp"), ("dp_tp", "replicated"),
                               ("fsdp", "tp"), ("replicated", "fsdp_keep"), ("fsdp_tp", "fsdp"))
           if a in PLANS and b in PLANS]


def run_steps(plan: str, optimizer: str, task: str, steps: int, *, seed: int = 0, lr_scale: float = 1.0,
              save: str | None = None, resume: str | None = None,
              device: str = "cpu") -> tuple[list[float], dict[str, np.ndarray]]:
    """train_mlp's model, plan, data and step, resumable: ``resume`` loads model + optimizer +
    step count from a checkpoint into a freshly built (differently seeded) model; ``save``
    writes them after the steps. Returns the losses and the final parameters (complete)."""
    shape = train_mlp.mesh_shape(plan, SIZE)
    assert shape is not None
    mesh = dt.init_device_mesh(device, shape, mesh_dim_names=("dp", "tp")[-len(shape):])
    try:
        dt.manual_seed(seed)
        model = train_mlp.MLP(train_mlp.OUT[task], mesh)
        train_mlp.apply_plan(model, plan)
        params = list(model.named_parameters())
        cls, kwargs = train_mlp.OPTIMIZERS[optimizer]
        opt = cls(params, **dict(kwargs, lr=kwargs["lr"] * lr_scale))
        state: dict[str, Any] = {"model": model, "optim": opt, "step": None}
        if resume:
            assert dt.load(resume, state) is state
            assert opt.param_groups[0]["lr"] == kwargs["lr"] and type(state["step"]) is int
            assert all(s["exp_avg" if optimizer == "adamw" else "momentum_buffer"].placements == p.placements
                       for p, s in opt.state.items()), "moments must follow their parameters' current placements"
        x_full, y_full = train_mlp.dataset(task)
        x = dt.distribute_tensor(x_full, mesh, train_mlp.PLANS[plan]["batch"])
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            out = model(x)
            loss = (F.mse_loss(out, dt.distribute_tensor(y_full, mesh, out.placements)) if task == "regression"
                    else F.cross_entropy(out, y_full))
            loss.backward()
            dt.nn.utils.reduce_gradients([p for _, p in params])
            opt.step()
            losses.append(float(loss.to_torch()))
        if save:
            dt.save({"model": model, "optim": opt, "step": (state["step"] or 0) + steps}, save)
        return losses, {k: train_mlp.host(p.to_torch()) for k, p in params}
    finally:
        mesh.free()


# what this adds is the resume (checkpoint exchanges: plain MPI); every plan's steps are checked
# on every path by test_training_matches_the_numpy_reference
@pytest.mark.path_independent
@pytest.mark.parametrize("optimizer", sorted(train_mlp.OPTIMIZERS))
@pytest.mark.parametrize(("saved_on", "resumed_on"), RESUMES)
def test_resume_on_another_plan_continues_the_uninterrupted_run(saved_on: str, resumed_on: str, optimizer: str,
                                                               shared_dir: str, xp_device: str) -> None:
    """N steps under one plan, saved; a fresh model and optimizer (other initial weights, other
    lr) under another plan and mesh shape load it and train M more steps: the losses and final
    parameters equal the uninterrupted N + M steps (float64, 1e-12)."""
    n, m, task = 3, 3, "classification"
    want_losses, _, want_final = train_mlp.train(saved_on, optimizer, task, steps=n + m)
    path = os.path.join(shared_dir, "resume.h5")
    first, _ = run_steps(saved_on, optimizer, task, n, save=path, device=xp_device)
    rest, final = run_steps(resumed_on, optimizer, task, m, seed=1, lr_scale=3.0, resume=path, device=xp_device)
    np.testing.assert_allclose(first + rest, want_losses, rtol=0, atol=1e-12)
    for name, value in want_final.items():
        np.testing.assert_allclose(final[name], value, rtol=0, atol=1e-12, err_msg=name)
    with h5py.File(path, "r") as f:  # plain h5py reads the training state too
        assert f["step"][()] == n and f["step"].attrs["pytype"] == b"int"
        assert list(f["optim/param_groups/0/params"][()]) == list(range(6))
