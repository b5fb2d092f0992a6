"""Train a tensor-parallel pre-norm transformer block on a synthetic next-token task: heads
split across ranks as whole heads (4 heads over 3 ranks: 2/1/1), a vocab-parallel embedding
and output layer, and a vocab-parallel cross_entropy that never gathers the logits.

Run: mpiexec -n 3 python examples/train_transformer_block.py [--steps 30] [--plan tp|replicated|fsdp]
       [--activation-checkpointing]
Save and resume (training state in one checkpoint: model, AdamW moments and step counts, step):
  mpiexec -n 3 python examples/train_transformer_block.py --checkpoint ck.h5 --save-at 10 --resume-plan replicated
    trains under --plan, saves after step 10, then resumes from ck.h5 in a fresh model and
    optimizer under --resume-plan and prints both curves: the resumed one continues identically
  mpiexec -n 1 python examples/train_transformer_block.py --checkpoint ck.h5 --resume
    resumes from ck.h5 at another rank count (the checkpoint is resharded on load)

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
cut. The ``replicated`` plan holds every parameter whole on every rank (no communication): the
same math, the same curve. The ``fsdp`` plan is fully sharded data parallel: the block is one
``fully_shard`` unit (every parameter Shard(0) between uses, gathered for forward and again for
backward, gradients reduce-scattered), each rank trains on its rows of the batch (uneven at 3
ranks), and the attention and MLP sub-blocks are activation-checkpointed (recomputed in
backward on the gathered parameters); ``--activation-checkpointing`` adds that to any plan.
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
PLANS: dict[str, dict[str, dt.Placement]] = {
    "tp": {"embed": S0, "wq": S0, "wk": S0, "wv": S0, "wo": S0, "w1": S0, "w2": S1, "out": S0},
    "replicated": {name: R for name in ("embed", "wq", "wk", "wv", "wo", "w1", "w2", "out")},
}
PLANS["fsdp"] = PLANS["replicated"]  # built replicated, then fully_shard stores every parameter Shard(0)
BATCH_SPLIT = {"fsdp"}
"""Plans whose ranks each take their rows of the batch (the others feed every rank all of it)."""
"""Per plan: each weight's placement on the 1-D mesh (the norm weights are always Replicate)."""


def replicate(t: dt.DTensor) -> dt.DTensor:
    """All-reduce a Partial result (the only communication of each sub-block); a batch-sharded
    one (fsdp) stays as it is."""
    return t.redistribute(placements=[R]) if any(p.is_partial() for p in t.placements) else t


class Block(nn.Module):
    def __init__(self, mesh: dt.DeviceMesh, plan: str = "tp", recompute: bool = False) -> None:
        super().__init__()
        place = PLANS[plan]
        self.recompute = recompute or plan == "fsdp"  # activation checkpointing of both sub-blocks

        def param(shape: tuple[int, ...], placement: dt.Placement, scale: float) -> nn.Parameter:
            return nn.Parameter(dt.randn(*shape, dtype=np.float64, device_mesh=mesh, placements=[placement]) * scale)

        def ones() -> nn.Parameter:
            return nn.Parameter(dt.ones(D, dtype=np.float64, device_mesh=mesh, placements=[R]))

        self.embed = param((VOCAB, D), place["embed"], 1.0)
        self.norm1, self.norm2, self.norm3 = ones(), ones(), ones()
        self.wq, self.wk, self.wv = (param((HEADS, D, DH), place[w], D ** -0.5) for w in ("wq", "wk", "wv"))
        self.wo = param((HEADS, DH, D), place["wo"], (HEADS * DH) ** -0.5)
        self.w1, self.w2 = param((FF, D), place["w1"], D ** -0.5), param((D, FF), place["w2"], FF ** -0.5)
        self.out = param((VOCAB, D), place["out"], D ** -0.5)
        causal = np.triu(np.full((SEQ, SEQ), -1e9), 1)
        self.causal = dt.distribute_tensor(causal, mesh, [R], src_data_rank=None)

    def attention(self, h: dt.DTensor) -> dt.DTensor:
        h = h.unsqueeze(1)  # [B, 1, T, d]: broadcast over the (sharded) head dim
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv  # [B, H, T, Dh] Shard(1): whole heads per rank
        p = F.softmax(q @ k.transpose(-1, -2) * (1 / math.sqrt(DH)) + self.causal, -1)
        return replicate(((p @ v) @ self.wo).sum(1))  # per-head projections summed: one all-reduce

    def mlp(self, h: dt.DTensor) -> dt.DTensor:
        return replicate(F.gelu(h @ self.w1.T, "tanh") @ self.w2.T)

    def forward(self, tokens: np.ndarray | dt.DTensor) -> dt.DTensor:
        run = nn.utils.checkpoint if self.recompute else (lambda fn, h: fn(h))
        x = replicate(F.embedding(tokens, self.embed))
        x = x + run(self.attention, F.rms_norm(x, self.norm1))
        x = x + run(self.mlp, F.rms_norm(x, self.norm2))
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


def train(steps: int, plan: str = "tp", lr: float = 0.05, *, checkpoint: str | None = None,
          save_at: int | None = None, resume: bool = False, recompute: bool = False) -> tuple[dict[int, float], dict[str, dt.CommCounter], int]:
    """Train up to step ``steps`` with AdamW on the world's 1-D mesh under ``plan``; with
    ``resume``, first restore model, optimizer and step count from ``checkpoint`` (resharded
    onto this plan and rank count); with ``save_at``, save them there after that step. Returns
    the loss of each step trained, the collectives of the last step and this rank's head count."""
    mesh = dt.init_device_mesh("cpu", (MPI.COMM_WORLD.Get_size(),), mesh_dim_names=("tp",))
    try:
        dt.manual_seed(0)
        model = Block(mesh, plan, recompute)
        if plan == "fsdp":
            dt.fully_shard(model, mesh=mesh)  # one unit: the block
        opt = dt.optim.AdamW(model.named_parameters(), lr=lr, weight_decay=0.0)
        state = {"model": model, "optim": opt, "step": 0}
        if resume:
            assert checkpoint is not None, "resume needs a checkpoint"
            dt.load(checkpoint, state)
        tokens, targets = next_token_data()
        if plan in BATCH_SPLIT:  # this rank's rows of the batch (every rank holds the data)
            tokens, targets = (dt.distribute_tensor(a, mesh, [S0], src_data_rank=None) for a in (tokens, targets))
        losses: dict[int, float] = {}
        moved: dict[str, dt.CommCounter] = {}
        for step in range(int(state["step"]), steps):
            opt.zero_grad()
            with dt.CommCounter() as moved["forward"]:
                loss = F.cross_entropy(model(tokens), targets)
            with dt.CommCounter() as moved["backward"]:
                loss.backward()
            with dt.CommCounter() as moved["reduce_gradients"]:
                nn.utils.reduce_gradients(list(model.parameters()))
            with dt.CommCounter() as moved["optimizer step"]:
                opt.step()
            losses[step] = float(loss.to_torch())
            if step + 1 == save_at and checkpoint:
                dt.save({"model": model, "optim": opt, "step": step + 1}, checkpoint)
        return losses, moved, model.wq.to_local().shape[0]
    finally:
        mesh.free()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--plan", choices=sorted(PLANS), default="tp")
    parser.add_argument("--checkpoint", help="checkpoint file to save to (--save-at) or resume from (--resume)")
    parser.add_argument("--save-at", type=int, help="save model, optimizer and step after this step")
    parser.add_argument("--resume-plan", choices=sorted(PLANS), help="then resume from the checkpoint on this plan")
    parser.add_argument("--resume", action="store_true", help="start from the checkpoint instead of step 0")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute the attention and MLP sub-blocks in backward (always on with --plan fsdp)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    losses, moved, local_heads = train(args.steps, args.plan, checkpoint=args.checkpoint, save_at=args.save_at,
                                       resume=args.resume, recompute=args.activation_checkpointing)
    heads = world.allgather(local_heads)
    resumed = (train(args.steps, args.resume_plan, checkpoint=args.checkpoint, resume=True,
                     recompute=args.activation_checkpointing)[0]
               if args.resume_plan and args.save_at and args.checkpoint else {})
    if world.Get_rank() != 0:
        return
    print(f"{HEADS} heads over {world.Get_size()} rank(s), vocabulary {VOCAB}, plan {args.plan}; AdamW")
    if args.resume:
        print(f"resumed from {args.checkpoint} at step {min(losses, default=args.steps)}")
    for step, loss in losses.items():
        print(f"step {step} loss {loss:.12f}")
    first = min(losses, default=0)
    print(f"loss decreased: {losses[max(losses)] < 0.5 * losses[first]}" if losses else "no steps left to train")
    print(f"heads per rank: {heads}")
    print("collectives of one training step (rank 0):")
    for phase, counter in moved.items():
        print(f"  {phase}: {counter.count} ({', '.join(counter.kinds()) or 'none'}), {counter.bytes_sent:,} bytes")
    if args.save_at and args.checkpoint:
        print(f"saved model, optimizer and step after step {args.save_at} to {args.checkpoint}")
    if resumed:
        for step, loss in resumed.items():
            print(f"resumed step {step} loss {loss:.12f}")
        gap = max(abs(loss - losses[step]) for step, loss in resumed.items())
        print(f"resumed on plan {args.resume_plan} from step {args.save_at}: "
              f"max |loss - uninterrupted loss| {gap:.1e}")


if __name__ == "__main__":
    main()
