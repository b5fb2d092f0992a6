"""What every side of scripts/bench_train.py shares: the hyperparameters, the MLP's initial
weights and data, and the transformer block of examples/train_transformer_block.py sized per case."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_transformer_block as tb

WORLD = MPI.COMM_WORLD
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
Step = Callable[[], float]


def mlp_weights(h: int, dtype: Any) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(h)
    f = 4 * h
    return {"0.weight": rng.uniform(-h ** -0.5, h ** -0.5, (f, h)).astype(dtype),
            "0.bias": rng.uniform(-h ** -0.5, h ** -0.5, f).astype(dtype),
            "2.weight": rng.uniform(-f ** -0.5, f ** -0.5, (h, f)).astype(dtype),
            "2.bias": rng.uniform(-f ** -0.5, f ** -0.5, h).astype(dtype)}


def mlp_data(h: int, batch: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((batch, h)).astype(dtype), rng.standard_normal((batch, h)).astype(dtype)



def configure_block(d: int, vocab: int, batch: int, seq: int) -> None:
    """Set the example's size constants (read when a Block is built and run)."""
    tb.D, tb.HEADS, tb.DH, tb.FF, tb.VOCAB, tb.BATCH, tb.SEQ = d, d // 64, 64, 4 * d, vocab, batch, seq


def block_setup(mesh: dt.DeviceMesh) -> tuple[tb.Block, np.ndarray, np.ndarray]:
    dt.manual_seed(0)
    return (tb.Block(mesh), *tb.next_token_data())
