"""The dtorch_mpi side of scripts/bench_train.py: the models built and parallelized with
dtorch_mpi, one step each (forward, backward, ``reduce_gradients``, AdamW)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from bench_train_setup import BETAS, EPS, LR, WD, Step, tb

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.nn import functional as F

R = dt.Replicate()


def dtorch_step(model: nn.Module, loss_fn: Callable[[], dt.DTensor]) -> Step:
    params = list(model.parameters())
    opt = dt.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    def step() -> float:
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        nn.utils.reduce_gradients(params)
        opt.step()
        return float(loss.to_local())

    return step



def dtorch_mlp(mesh: dt.DeviceMesh, weights: dict[str, np.ndarray], x: np.ndarray,
               y: np.ndarray) -> tuple[Step, nn.Module]:
    h, dtype = x.shape[1], x.dtype
    model = nn.Sequential(nn.Linear(h, 4 * h, device_mesh=mesh, dtype=dtype), nn.GELU(approximate="tanh"),
                          nn.Linear(4 * h, h, device_mesh=mesh, dtype=dtype))
    dt.parallelize_module(model, mesh, {"0": dt.ColwiseParallel(use_local_output=False),
                                        "2": dt.RowwiseParallel(use_local_output=False)})
    model.load_state_dict(weights)
    xd = dt.distribute_tensor(x, mesh, [R], src_data_rank=None)
    yd = dt.distribute_tensor(y, mesh, [R], src_data_rank=None)
    return dtorch_step(model, lambda: ((model(xd) - yd) ** 2).mean()), model



def dtorch_block(model: tb.Block, tokens: np.ndarray, targets: np.ndarray) -> Step:
    return dtorch_step(model, lambda: F.cross_entropy(model(tokens), targets))
