"""Train a three-layer MLP under any parallel plan; the loss curve is the same on every plan and
rank count (sharding-invariant training), and equals a single-process NumPy reference.

Run: mpiexec -n 4 python examples/train_mlp.py --plan dp_tp --optimizer adamw --task classification
(``--device cuda``: the same on a "cuda" mesh, CuPy pieces, one GPU per rank)

Plans (``PLANS``: placements per mesh dim, as data):
  replicated  every rank holds everything and the whole batch
  dp          data parallel: the batch is Shard(0), parameters Replicate; gradients are
              Partial("sum") and ``reduce_gradients`` all-reduces them (packed)
  replicate   dp with ``dtorch.replicate``: the same sums, all-reduced in buckets started
              during backward as each bucket's gradients complete (no ``reduce_gradients``)
  tp          tensor parallel: fc1 Colwise (weight Shard(0)), fc2 Rowwise (Shard(1), its
              Partial output all-reduced once), head Colwise: class-sharded logits for the
              vocab-parallel cross_entropy (which never gathers them)
  dp_tp       both on a 2-D (dp, tp) mesh, 2 x (ranks / 2)
  fsdp        fully sharded data parallel (ZeRO-3): the batch is Shard(0); ``fully_shard`` on
              each layer, then on the model, stores every parameter Shard(0), gathers a layer's
              just before its forward and frees them after, re-gathers in backward and
              reduce-scatters the gradients during backward (no ``reduce_gradients``)
  fsdp_keep   the same with ``reshard_after_forward=False`` (gathered from forward to backward)
  fsdp_tp     2-D: dp_tp's tensor-parallel placements, then ``fully_shard`` over the dp dim
              (each tp piece split further over dp; stored on the (tp, dp) order of the mesh)
The model: ``head(gelu(fc2(gelu(fc1(x)))))``, GELU in its tanh form, float64, initialised from
the sharding-invariant RNG (the same weights on every plan). Each step: forward, backward,
``reduce_gradients``, optimizer step (SGD with momentum, or AdamW).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi import nn
from dtorch_mpi.nn import functional as F

R, S0, S1 = dt.Replicate(), dt.Shard(0), dt.Shard(1)
D_IN, HIDDEN, D_MID, BATCH = 6, 9, 7, 11  # uneven on every rank count
OUT = {"regression": 3, "classification": 5}
OPTIMIZERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "sgd": (dt.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),
    "adamw": (dt.optim.AdamW, {"lr": 0.02, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}),
}

PLANS: dict[str, dict[str, Any]] = {
    "replicated": {"batch": [R], "fc1": ([R], [R]), "fc2": ([R], [R]), "head": ([R], [R])},
    "dp": {"batch": [S0], "fc1": ([R], [R]), "fc2": ([R], [R]), "head": ([R], [R])},
    "replicate": {"batch": [S0], "fc1": ([R], [R]), "fc2": ([R], [R]), "head": ([R], [R]), "replicate": {}},
    "tp": {"batch": [R], "fc1": ([S0], [S0]), "fc2": ([S1], [R]), "head": ([S0], [S0])},
    "dp_tp": {"batch": [S0, R], "fc1": ([R, S0], [R, S0]), "fc2": ([R, S1], [R, R]), "head": ([R, S0], [R, S0])},
    "fsdp": {"batch": [S0], "fc1": ([R], [R]), "fc2": ([R], [R]), "head": ([R], [R]),
             "fully_shard": {"reshard_after_forward": True}},
    "fsdp_keep": {"batch": [S0], "fc1": ([R], [R]), "fc2": ([R], [R]), "head": ([R], [R]),
                  "fully_shard": {"reshard_after_forward": False}},
    "fsdp_tp": {"batch": [S0, R], "fc1": ([R, S0], [R, S0]), "fc2": ([R, S1], [R, R]), "head": ([R, S0], [R, S0]),
                "fully_shard": {"reshard_after_forward": True}},
}
"""Per plan: the batch's placements, each layer's (weight, bias) placements and, for the
fully sharded plans, the ``fully_shard`` options (applied per layer, then to the model), for
``replicate`` its options (applied to the model)."""


def mesh_shape(plan: str, size: int) -> tuple[int, ...] | None:
    """The plan's mesh at ``size`` ranks (None: the plan needs another rank count)."""
    if plan not in ("dp_tp", "fsdp_tp"):
        return (size,)
    return (2, size // 2) if size % 2 == 0 else None


def replicate_partial(t: dt.DTensor) -> dt.DTensor:
    """The Rowwise boundary, explicit: all-reduce the mesh dims where ``t`` is Partial."""
    if not any(p.is_partial() for p in t.placements):
        return t
    return t.redistribute(placements=[R if p.is_partial() else p for p in t.placements])


class RowLinear(nn.Linear):
    """``x @ W.T + b`` with the Rowwise boundary explicit: a Partial product is all-reduced
    before the bias is added (a no-op on the plans that leave it whole)."""

    def forward(self, x: dt.DTensor) -> dt.DTensor:
        return replicate_partial(x @ self.weight.T) + self.bias


class MLP(nn.Module):
    def __init__(self, d_out: int, mesh: dt.DeviceMesh) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN, device_mesh=mesh, dtype=np.float64)
        self.fc2 = RowLinear(HIDDEN, D_MID, device_mesh=mesh, dtype=np.float64)
        self.head = nn.Linear(D_MID, d_out, device_mesh=mesh, dtype=np.float64)

    def forward(self, x: dt.DTensor) -> dt.DTensor:
        h = F.gelu(self.fc1(x), "tanh")  # each layer through its module: a fully_shard unit's forward
        h = F.gelu(self.fc2(h), "tanh")
        return self.head(h)


def apply_plan(model: MLP, plan: str) -> None:
    """Place every parameter as the plan says (a local slice of the replicated initial value);
    the fully sharded plans then apply ``fully_shard`` bottom-up: each layer, then the model."""
    for layer in ("fc1", "fc2", "head"):
        module = getattr(model, layer)
        for name, placements in zip(("weight", "bias"), PLANS[plan][layer]):
            setattr(module, name, nn.Parameter(getattr(module, name).redistribute(placements=placements)))
    if "replicate" in PLANS[plan]:  # dp with the all-reduce in buckets during backward
        dt.replicate(model, mesh=model.fc1.weight.device_mesh, **PLANS[plan]["replicate"])
    options = PLANS[plan].get("fully_shard")
    if options is not None:
        mesh = model.fc1.weight.device_mesh
        mesh = mesh["dp"] if mesh.ndim == 2 else mesh  # 2-D: shard over dp, inside the tp pieces
        for layer in ("fc1", "fc2", "head"):
            dt.fully_shard(getattr(model, layer), mesh=mesh, **options)
        dt.fully_shard(model, mesh=mesh, **options)


def dataset(task: str) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic data from a fixed seed, the same on every rank: inputs and regression targets
    (a smooth function of them) or class labels (the argmax of a random projection)."""
    x = np.random.default_rng(1000).standard_normal((BATCH, D_IN))
    proj = np.random.default_rng(7).standard_normal((D_IN, OUT[task]))
    return (x, np.sin(x @ proj)) if task == "regression" else (x, np.argmax(x @ proj, axis=1))


def host(a: Any) -> np.ndarray:
    """A NumPy copy of a complete value (a CuPy one on a ``"cuda"`` mesh comes to the host)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.array(a)


def train(plan: str, optimizer: str = "sgd", task: str = "regression", steps: int = 5,
          seed: int = 0, device: str = "cpu") -> tuple[list[float], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Train ``steps`` steps under ``plan`` (collective over the world) on a mesh of ``device``
    ("cpu": NumPy pieces, "cuda": CuPy); return the losses, the initial and the final
    parameters as complete NumPy arrays."""
    shape = mesh_shape(plan, MPI.COMM_WORLD.Get_size())
    if shape is None:
        raise ValueError(f"plan {plan!r} needs an even number of ranks")
    mesh = dt.init_device_mesh(device, shape, mesh_dim_names=("dp", "tp")[-len(shape):])
    try:
        dt.manual_seed(seed)
        model = MLP(OUT[task], mesh)
        initial = {k: host(p.to_torch()) for k, p in model.named_parameters()}  # a copy: steps update in place
        apply_plan(model, plan)
        params = list(model.named_parameters())
        cls, kwargs = OPTIMIZERS[optimizer]
        opt = cls(params, **kwargs)
        losses = []
        x_full, y_full = dataset(task)
        x = dt.distribute_tensor(x_full, mesh, PLANS[plan]["batch"])
        for _ in range(steps):
            opt.zero_grad()
            out = model(x)
            if task == "regression":
                loss = F.mse_loss(out, dt.distribute_tensor(y_full, mesh, out.placements))
            else:
                loss = F.cross_entropy(out, y_full)
            loss.backward()
            if not {"fully_shard", "replicate"} & PLANS[plan].keys():  # those reduced them during backward
                nn.utils.reduce_gradients([p for _, p in params])
            opt.step()
            losses.append(float(loss.to_torch()))
        return losses, initial, {k: host(p.to_torch()) for k, p in params}
    finally:
        mesh.free()


# --- the single-process NumPy reference of the same math --------------------------------------
C_GELU = math.sqrt(2 / math.pi)


def _gelu(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """tanh-GELU and its derivative."""
    t = np.tanh(C_GELU * (a + 0.044715 * a ** 3))
    return 0.5 * a * (1 + t), 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * C_GELU * (1 + 3 * 0.044715 * a * a)


def _loss_and_grad(out: np.ndarray, y: np.ndarray, task: str) -> tuple[float, np.ndarray]:
    if task == "regression":
        return float(((out - y) ** 2).mean()), 2 * (out - y) / out.size
    p = np.exp(out - out.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(-np.log(p[rows, y]).mean())
    p[rows, y] -= 1
    return loss, p / len(y)


def _sgd(p: np.ndarray, g: np.ndarray, state: dict[str, Any], lr: float, momentum: float,
         weight_decay: float) -> np.ndarray:
    g = g + weight_decay * p
    buf = state.get("buf")
    state["buf"] = buf = g.copy() if buf is None else momentum * buf + g
    return p - lr * buf


def _adamw(p: np.ndarray, g: np.ndarray, state: dict[str, Any], lr: float, betas: tuple[float, float],
           eps: float, weight_decay: float) -> np.ndarray:
    b1, b2 = betas
    t = state["t"] = state.get("t", 0) + 1
    m = state["m"] = b1 * state.get("m", 0.0) + (1 - b1) * g
    v = state["v"] = b2 * state.get("v", 0.0) + (1 - b2) * g * g
    p = p * (1 - lr * weight_decay)
    return p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)


REFERENCE_STEPS: dict[str, Callable[..., np.ndarray]] = {"sgd": _sgd, "adamw": _adamw}


def reference(initial: dict[str, np.ndarray], optimizer: str = "sgd", task: str = "regression",
              steps: int = 5) -> tuple[list[float], dict[str, np.ndarray]]:
    """The same training in single-process NumPy: forward, backward by hand, the optimizer."""
    p = {k: v.astype(np.float64).copy() for k, v in initial.items()}
    state: dict[str, dict[str, Any]] = {k: {} for k in p}
    losses = []
    x, y = dataset(task)
    for _ in range(steps):
        a1 = x @ p["fc1.weight"].T + p["fc1.bias"]
        h1, d1 = _gelu(a1)
        a2 = h1 @ p["fc2.weight"].T + p["fc2.bias"]
        h2, d2 = _gelu(a2)
        out = h2 @ p["head.weight"].T + p["head.bias"]
        loss, g_out = _loss_and_grad(out, y, task)
        g_a2 = (g_out @ p["head.weight"]) * d2
        g_a1 = (g_a2 @ p["fc2.weight"]) * d1
        grads = {"head.weight": g_out.T @ h2, "head.bias": g_out.sum(0), "fc2.weight": g_a2.T @ h1,
                 "fc2.bias": g_a2.sum(0), "fc1.weight": g_a1.T @ x, "fc1.bias": g_a1.sum(0)}
        hyper = OPTIMIZERS[optimizer][1]
        for k in p:
            p[k] = REFERENCE_STEPS[optimizer](p[k], grads[k], state[k], **hyper)
        losses.append(loss)
    return losses, p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", choices=sorted(PLANS), default="dp")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--task", choices=sorted(OUT), default="regression")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the mesh's device type (cuda: CuPy)")
    args = parser.parse_args()
    losses, initial, final = train(args.plan, args.optimizer, args.task, args.steps, device=args.device)
    ref_losses, ref_final = reference(initial, args.optimizer, args.task, args.steps)
    size = MPI.COMM_WORLD.Get_size()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"plan {args.plan} on {size} rank(s), mesh {mesh_shape(args.plan, size)}, "
              f"{args.optimizer}, {args.task}")
        for step, loss in enumerate(losses):
            print(f"step {step} loss {loss:.12f}")
        dloss = max(abs(a - b) for a, b in zip(losses, ref_losses))
        dparam = max(float(np.abs(final[k] - ref_final[k]).max()) for k in final)
        print(f"max |loss - NumPy reference| {dloss:.1e}, max |param - NumPy reference| {dparam:.1e}")


if __name__ == "__main__":
    main()
