"""The PyTorch DTensor side of scripts/bench_train.py (gloo over the same ranks): the same models
and placements; absent when torch is not installed."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from bench_train_setup import BETAS, EPS, LR, WD, WORLD, Step, tb


class Torch:
    """PyTorch DTensor on gloo over the same ranks (None when torch is not installed)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as tdist
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(1)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29547")
        tdist.init_process_group("gloo", rank=WORLD.Get_rank(), world_size=WORLD.Get_size())
        self.torch, self.tdist = torch, tdist
        self.mesh = init_device_mesh("cpu", (WORLD.Get_size(),))
        self.version = torch.__version__

    def close(self) -> None:
        self.tdist.destroy_process_group()

    def _step(self, params: list[Any], loss_fn: Callable[[], Any], ctx: Callable[[], Any] | None = None) -> Step:
        import contextlib

        opt = self.torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

        def step() -> float:
            opt.zero_grad()
            with ctx() if ctx else contextlib.nullcontext():
                loss = loss_fn()
                loss.backward()
            opt.step()
            return float(loss.detach().full_tensor())

        return step

    def mlp(self, weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> Step:
        torch = self.torch
        from torch.distributed.tensor import Replicate, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        h = x.shape[1]
        model = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(approximate="tanh"),
                                    torch.nn.Linear(4 * h, h))
        model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
        parallelize_module(model, self.mesh, {"0": ColwiseParallel(use_local_output=False),
                                              "2": RowwiseParallel(use_local_output=False)})
        xt = torch.from_numpy(x)
        yt = distribute_tensor(torch.from_numpy(y), self.mesh, [Replicate()])
        return self._step(list(model.parameters()), lambda: ((model(xt) - yt) ** 2).mean())

    def block(self, model: tb.Block, tokens: np.ndarray, targets: np.ndarray) -> Step:
        """The block with the example's placements, written with torch DTensor ops. Attention
        runs heads-first (``[H, B, T, Dh]``, Shard(0)), the projections as 2-D matmuls with
        flattened head weights: torch's batched matmul (and einsum) flattens ``[B, H]`` and
        refuses when the head dim, second there, is sharded."""
        torch = self.torch
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import loss_parallel

        mesh, rep = self.mesh, [Replicate()]
        params = {name: torch.nn.Parameter(distribute_tensor(torch.from_numpy(np.array(p.to_torch())), mesh,
                                                             [Shard(p.placements[0].dim) if p.placements[0].is_shard()
                                                              else Replicate()]))
                  for name, p in model.named_parameters()}
        causal = distribute_tensor(torch.from_numpy(np.array(model.causal.to_torch())), mesh, rep)
        tok = distribute_tensor(torch.from_numpy(tokens), mesh, rep)
        tgt = distribute_tensor(torch.from_numpy(targets).reshape(-1), mesh, rep)
        eps = float(np.finfo(np.float64).eps)

        def rms(x: Any, w: Any) -> Any:
            return x / ((x * x).mean(-1, keepdim=True) + eps).sqrt() * w

        def replicate(t: Any) -> Any:
            return t.redistribute(mesh, rep)

        def loss_fn() -> Any:
            p = params
            # from_local: torch cannot take the residual stream's Partial gradient back to the
            # lookup's MaskPartial; this all-reduces it to Replicate first (Megatron's "f").
            x = DTensor.from_local(replicate(torch.nn.functional.embedding(tok, p["embed"])).to_local(), mesh, rep)
            b, t, d = x.shape
            hh = rms(x, p["norm1"]).reshape(b * t, d)
            q, k, v = ((hh @ p[w].permute(1, 0, 2).reshape(d, -1)).reshape(b, t, -1, tb.DH).permute(2, 0, 1, 3)
                       for w in ("wq", "wk", "wv"))  # [H, B, T, Dh] Shard(0)
            att = torch.softmax(q @ k.transpose(-1, -2) * (1 / math.sqrt(tb.DH)) + causal, -1)
            o = (att @ v).permute(1, 2, 0, 3).reshape(b * t, -1)  # [B*T, H*Dh] Shard(1)
            x = x + replicate((o @ p["wo"].reshape(-1, d)).reshape(b, t, d))
            gact = torch.nn.functional.gelu(rms(x, p["norm2"]) @ p["w1"].T, approximate="tanh")
            x = x + replicate(gact @ p["w2"].T)
            logits = rms(x, p["norm3"]) @ p["out"].T
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt)

        return self._step(list(params.values()), loss_fn, loss_parallel)


def try_torch() -> Torch | None:
    try:
        return Torch()
    except ImportError:
        return None
