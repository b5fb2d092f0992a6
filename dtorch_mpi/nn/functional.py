"""``dtorch.nn.functional``: layer math as functions of DTensors, built from ``dtorch``
operators (so each follows their placement rules and never communicates on its own).

``embedding`` has its own small rule table (``EMBEDDING_RULES``): a lookup needs a whole
index and is local on every rule; a ``Shard(0)`` (vocab-parallel) weight gives a
``Partial("sum")`` result that the caller reduces explicitly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import factory
from ..arrays import array_namespace
from ..autograd.graph import attach
from ..autograd.record import needs_recording
from ..dtensor import DTensor
from ..errors import PlacementError
from ..grad_mode import _GradMode
from ..ops.catalog import log_softmax, softmax
from ..placement import Partial, Placement, Replicate, Shard
from ..spec import DTensorSpec
from .indices import require_in_range
from .losses import cross_entropy

__all__ = ["cross_entropy", "dropout", "embedding", "gelu", "layer_norm", "linear", "log_softmax", "mse_loss", "relu",
           "rms_norm", "silu", "softmax"]


def linear(x: Any, weight: DTensor, bias: DTensor | None = None) -> Any:
    """``x @ weight.T + bias`` (weight ``[out, in]``)."""
    y = x @ weight.T
    return y + bias if bias is not None else y


def relu(x: DTensor) -> DTensor:
    return x.relu()


def gelu(x: DTensor, approximate: str = "none") -> DTensor:
    """``x * Phi(x)`` (``"none"``, erf form) or its tanh approximation (``"tanh"``), as
    ``dtorch.gelu(x, approximate=...)`` computes it."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return x.gelu(approximate=approximate)


def silu(x: DTensor) -> DTensor:
    return x.silu()


def dropout(x: DTensor, p: float = 0.5, training: bool = True) -> DTensor:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    The mask is ``dtorch.rand`` of ``x``'s global shape (``Partial`` mesh dims get a
    ``Replicate`` mask), so after ``manual_seed`` the same elements drop on any mesh and plan.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    plc = [Replicate() if pl.is_partial() else pl for pl in x.placements]
    u = factory.rand(*x.shape, dtype=x.dtype, device_mesh=x.device_mesh, placements=plc)
    return x * ((u >= p).astype(x.dtype) * (1.0 / (1.0 - p)))


def layer_norm(x: DTensor, normalized_shape: int | tuple[int, ...], weight: DTensor | None = None,
               bias: DTensor | None = None, eps: float = 1e-5) -> DTensor:
    """Normalise over the trailing ``normalized_shape`` dims (not sharded), then scale and shift."""
    dims = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    axes = tuple(range(x.ndim - len(dims), x.ndim))
    mu = x.mean(axes, keepdim=True)
    centred = x - mu
    y = centred / ((centred * centred).mean(axes, keepdim=True) + eps).sqrt()
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def rms_norm(x: DTensor, weight: DTensor | None = None, eps: float | None = None) -> DTensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight``; ``eps=None`` is the dtype's machine epsilon."""
    eps = float(np.finfo(x.dtype).eps) if eps is None else eps
    y = x / ((x * x).mean(-1, keepdim=True) + eps).sqrt()
    return y * weight if weight is not None else y


def mse_loss(input: DTensor, target: Any, reduction: str = "mean") -> DTensor:
    """``(input - target)^2`` reduced by ``"mean"``, ``"sum"`` or ``"none"`` (a sharded input
    gives a ``Partial`` scalar, as ``mean``/``sum`` do)."""
    sq = (input - target) ** 2
    reducers = {"mean": lambda t: t.mean(), "sum": lambda t: t.sum(), "none": lambda t: t}
    if reduction not in reducers:
        raise ValueError(f"mse_loss: reduction must be one of {sorted(reducers)}, got {reduction!r}")
    return reducers[reduction](sq)


# --- embedding --------------------------------------------------------------------------------

EMBEDDING_RULES: dict[tuple[str, str], str] = {
    ("Replicate()", "Replicate()"): "Replicate()",
    ("Replicate()", "Shard(d)"): "Shard(d)",
    ("Shard(1)", "Replicate()"): "Shard(-1)",
    ("Shard(0)", "Replicate()"): 'Partial("sum")',
}
"""(weight, index) -> output, per mesh dim. ``Shard(0)``: each rank looks up the rows it owns
and writes zeros for the others (vocab-parallel); the output is their sum."""


def _output_placement(mesh_dim: int, w: Placement, i: Placement, index_ndim: int) -> Placement:
    key = (f"Shard({w.dim})" if isinstance(w, Shard) else repr(w), "Shard(d)" if isinstance(i, Shard) else repr(i))
    if key not in EMBEDDING_RULES:
        rules = "; ".join(f"(weight {a}, index {b}) -> {c}" for (a, b), c in EMBEDDING_RULES.items())
        raise PlacementError(
            f"embedding: weight {w!r} with index {i!r} at mesh dim {mesh_dim} matches no rule ({rules}); "
            f"e.g. index.redistribute(placements=[Replicate()] ...) or weight.redistribute(...)")
    return {"Replicate()": Replicate(), "Shard(d)": i, "Shard(-1)": Shard(index_ndim),
            'Partial("sum")': Partial("sum")}[EMBEDDING_RULES[key]]


def embedding(index: Any, weight: DTensor) -> DTensor:
    """Rows of ``weight`` (``[num_embeddings, dim]``) at integer ``index`` (a NumPy/CuPy array,
    the same on every rank, or an integer DTensor on ``weight``'s mesh). See EMBEDDING_RULES."""
    mesh = weight.device_mesh
    if not isinstance(index, DTensor):
        index = DTensor.from_local(index, mesh, [Replicate()] * mesh.ndim, shape=index.shape)
    if index.dtype.kind not in "iu":
        raise TypeError(f"embedding: index must be an integer array, got {index.dtype}")
    if index.device_mesh != weight.device_mesh:
        raise PlacementError("embedding: index and weight live on different meshes")
    plc = tuple(_output_placement(k, w, i, index.ndim) for k, (w, i) in enumerate(zip(weight.placements, index.placements)))
    spec = DTensorSpec(mesh, plc, index.shape + (weight.shape[1],), weight.dtype)
    idx, table = index.to_local(), weight.to_local()
    (rows, _), (row0, _) = weight.spec.local_shape_and_offset
    num = weight.shape[0]
    comm = mesh.get_comm() if any(p.is_shard() for p in index.placements) else None
    require_in_range("embedding: index", idx, num, comm)  # a sharded index: ranks agree on the check
    xp = array_namespace(mesh.device_type)
    own = (idx >= row0) & (idx < row0 + rows)
    if rows == num:
        out = table[idx]
    else:
        out = xp.zeros(idx.shape + (table.shape[1],), dtype=table.dtype)
        out[own] = table[idx[own] - row0]
    result = DTensor(out, spec)
    if not (_GradMode.recording and needs_recording((weight,))):
        return result
    hit_rows, w_spec = idx[own] - row0, weight.spec

    def backward(grad: DTensor) -> list[DTensor | None]:
        """Each looked-up row's gradient added into that row of this rank's piece (the
        adjoint of the local gather): a Shard weight gets its Shard back, a Replicate weight
        the output gradient's placement, or Partial("sum") where the index is sharded."""
        g = grad.to_local()
        local = xp.zeros(w_spec.local_shape, dtype=w_spec.dtype)
        scatter_add(local, hit_rows, g[own])
        plc = tuple(w if isinstance(w, Shard) else Partial("sum") if isinstance(i, Shard) else gp
                    for w, i, gp in zip(w_spec.placements, index.placements, grad.placements))
        return [DTensor(local, w_spec.with_placements(plc))]

    return attach(result, "embedding", (weight,), backward)


def scatter_add(out: Any, rows: Any, values: Any) -> None:
    """``out[rows[i]] += values[i]`` with repeated rows summed (NumPy's or CuPy's add.at)."""
    if isinstance(out, np.ndarray):
        np.add.at(out, rows, values)
    else:  # CuPy
        import cupyx  # type: ignore[import-not-found]

        cupyx.scatter_add(out, rows, values)
