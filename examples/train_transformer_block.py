"""Train a tensor-parallel pre-norm transformer block on a synthetic next-token task: heads
split across ranks as whole heads (4 heads over 3 ranks: 2/1/1), a vocab-parallel embedding
and output layer, and a vocab-parallel cross_entropy that never gathers the logits.

Run: mpiexec -n 3 python examples/train_transformer_block.py [--steps 30]

The block (float64, parameters from the sharding-invariant RNG, so the loss curve is the same
on any number of ranks):
  x = embedding(tokens)                     weight [V, d] Shard(0): Partial lookup, 1 all-reduce
  x = x + attention(rms_norm(x))            Wq/Wk/Wv [H, d, Dh], Wo [H, Dh, d] Shard(0): whole heads
  x = x + W2 @ gelu(W1 @ rms_norm(x))       W1 [F, d] Shard(0) (Colwise), W2 [d, F] Shard(1) (Rowwise)
  logits = rms_norm(x) @ Wout.T             Wout [V, d] Shard(0): logits sharded over the vocabulary
Attention keeps the head dim as its own tensor dim: ``x.unsqueeze(1) @ Wq`` is a batched
matmul ([B, 1, T, d] Replicate @ [H, d, Dh] Shard(0) -> [B, H, T, Dh] Shard(1)) that moves
nothing, scores and softmax are per head, and the output projection summed over heads is
Partial("sum"): one all-reduce. No reshape of a sharded dim is needed, and a head is never
cut. Checkpoint resume is left out until ``dtorch.save`` takes nested training state.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.nn import functional as F

R, S0, S1 = dt.Replicate(), dt.Shard(0), dt.Shard(1)
VOCAB, D, HEADS, DH, FF, BATCH, SEQ = 11, 8, 4, 3, 13, 4, 6


def replicate(t: dt.DTensor) -> dt.DTensor:
    """All-reduce a Partial result (the only communication of each sub-block)."""
    return t.redistribute(placements=[R]) if t.placements != (R,) else t


class Block(nn.Module):
    def __init__(self, mesh: dt.DeviceMesh) -> None:
        super().__init__()

        def param(shape: tuple[int, ...], placement: dt.Placement, scale: float) -> nn.Parameter:
            return nn.Parameter(dt.randn(*shape, dtype=np.float64, device_mesh=mesh, placements=[placement]) * scale)

        def ones() -> nn.Parameter:
            return nn.Parameter(dt.ones(D, dtype=np.float64, device_mesh=mesh, placements=[R]))

        self.embed = param((VOCAB, D), S0, 1.0)
        self.norm1, self.norm2, self.norm3 = ones(), ones(), ones()
        self.wq, self.wk, self.wv = (param((HEADS, D, DH), S0, D ** -0.5) for _ in range(3))
        self.wo = param((HEADS, DH, D), S0, (HEADS * DH) ** -0.5)
        self.w1, self.w2 = param((FF, D), S0, D ** -0.5), param((D, FF), S1, FF ** -0.5)
        self.out = param((VOCAB, D), S0, D ** -0.5)
        causal = np.triu(np.full((SEQ, SEQ), -1e9), 1)
        self.causal = dt.distribute_tensor(causal, mesh, [R], src_data_rank=None)

    def attention(self, h: dt.DTensor) -> dt.DTensor:
        h = h.unsqueeze(1)  # [B, 1, T, d]: broadcast over the (sharded) head dim
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv  # [B, H, T, Dh] Shard(1): whole heads per rank
        p = F.softmax(q @ k.transpose(-1, -2) * (1 / math.sqrt(DH)) + self.causal, -1)
        return replicate(((p @ v) @ self.wo).sum(1))  # per-head projections summed: one all-reduce

    def forward(self, tokens: np.ndarray) -> dt.DTensor:
        x = replicate(F.embedding(tokens, self.embed))
        x = x + self.attention(F.rms_norm(x, self.norm1))
        x = x + replicate(F.gelu(F.rms_norm(x, self.norm2) @ self.w1.T, "tanh") @ self.w2.T)
        return F.rms_norm(x, self.norm3) @ self.out.T  # [B, T, V] Shard(2): vocab-parallel logits


def next_token_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sequences that follow a fixed random permutation of the vocabulary; the target of each
    position is the next token."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(VOCAB)
    seq = np.empty((BATCH, SEQ + 1), dtype=np.int64)
    seq[:, 0] = rng.integers(0, VOCAB, size=BATCH)
    for t in range(SEQ):
        seq[:, t + 1] = perm[seq[:, t]]
    return seq[:, :-1], seq[:, 1:]


def train(steps: int, lr: float = 0.05) -> tuple[list[float], dict[str, dt.CommCounter], int]:
    """Train ``steps`` AdamW steps on the world's 1-D mesh; return the losses, the
    collectives of the last step and the number of heads this rank holds."""
    mesh = dt.init_device_mesh("cpu", (MPI.COMM_WORLD.Get_size(),), mesh_dim_names=("tp",))
    try:
        dt.manual_seed(0)
        model = Block(mesh)
        opt = dt.optim.AdamW(model.named_parameters(), lr=lr, weight_decay=0.0)
        tokens, targets = next_token_data()
        losses = []
        moved: dict[str, dt.CommCounter] = {}
        for _ in range(steps):
            opt.zero_grad()
            with dt.CommCounter() as moved["forward"]:
                loss = F.cross_entropy(model(tokens), targets)
            with dt.CommCounter() as moved["backward"]:
                loss.backward()
            with dt.CommCounter() as moved["reduce_gradients"]:
                nn.utils.reduce_gradients(list(model.parameters()))
            with dt.CommCounter() as moved["optimizer step"]:
                opt.step()
            losses.append(float(loss.to_torch()))
        return losses, moved, model.wq.to_local().shape[0]
    finally:
        mesh.free()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    losses, moved, local_heads = train(args.steps)
    heads = MPI.COMM_WORLD.allgather(local_heads)
    if MPI.COMM_WORLD.Get_rank() == 0:
        size = MPI.COMM_WORLD.Get_size()
        print(f"{HEADS} heads over {size} rank(s), vocabulary {VOCAB} sharded; AdamW")
        for step, loss in enumerate(losses):
            print(f"step {step} loss {loss:.12f}")
        print(f"loss decreased: {losses[-1] < 0.5 * losses[0]}")
        print(f"heads per rank: {heads}")
        print("collectives of one training step (rank 0):")
        for phase, counter in moved.items():
            print(f"  {phase}: {counter.count} ({', '.join(counter.kinds()) or 'none'}), {counter.bytes_sent:,} bytes")


if __name__ == "__main__":
    main()
