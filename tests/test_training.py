"""Sharding-invariant training: examples/train_mlp.py's loop under every plan valid at this
world size (replicated, data parallel, tensor parallel, both on a 2-D mesh), with SGD +
momentum and AdamW, on a regression (mse_loss) and a classification (vocab-parallel
cross_entropy) task, equals a single-process NumPy reference of the same math (forward and
backward by hand, the optimizers' formulas) step by step, in float64, to 1e-9."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from conftest import SIZE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import train_mlp

import dtorch_mpi as dt

PLANS = [p for p in sorted(train_mlp.PLANS) if train_mlp.mesh_shape(p, SIZE) is not None]
STEPS = 4


@pytest.mark.parametrize("task", sorted(train_mlp.OUT))
@pytest.mark.parametrize("optimizer", sorted(train_mlp.OPTIMIZERS))
@pytest.mark.parametrize("plan", PLANS)
def test_training_matches_the_numpy_reference(plan: str, optimizer: str, task: str) -> None:
    losses, initial, final = train_mlp.train(plan, optimizer, task, steps=STEPS)
    want_losses, want_final = train_mlp.reference(initial, optimizer, task, steps=STEPS)
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-9)
    assert losses[-1] < losses[0], f"loss did not decrease: {losses}"
    for name, value in want_final.items():
        np.testing.assert_allclose(final[name], value, rtol=0, atol=1e-9, err_msg=name)
        assert not np.allclose(value, initial[name]), f"{name} did not move"


def test_plans_place_parameters_and_reduce_gradients_packed() -> None:
    """The tp/dp_tp plans shard the parameters as declared, and one step's gradient reduction
    is packed: data parallel all-reduces all six gradients in one collective."""
    mesh = dt.init_device_mesh("cpu", (SIZE,))
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
