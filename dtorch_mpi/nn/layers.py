"""Layers: Linear, ReLU, Sequential, LayerNorm, RMSNorm, Embedding, GELU, SiLU, Dropout. Initial values come from the
sharding-invariant RNG, so a model has the same weights whatever its parallel plan.

A plain (NumPy/CuPy) array input is handled one way by every layer (docs/concepts.md, "Modules
and plain arrays"): a layer with parameters takes it as the complete value, the same on every
rank (``Replicate`` on the parameters' mesh: no communication, no check), as ``Embedding`` takes
a plain index and ``ColwiseParallel`` a plain input, and returns a DTensor; a parameter-free
elementwise layer (ReLU, GELU, SiLU, Dropout) computes on the array where it is and returns an
array, which is how the local outputs of parallel layers (``use_local_output=True``) flow
between them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import factory
from .. import random as _random
from ..arrays import array_module_of as _xp
from ..construction import checked_shape, make_spec
from ..dtensor import DTensor
from ..dtypes import check_dtype
from ..errors import DTypeMismatchError
from ..mesh import DeviceMesh, init_device_mesh
from ..ops import activations as K
from ..placement import Replicate
from . import functional as F
from .deferred import deferred_parameter
from .functional import linear
from .module import Module, Parameter

_default_mesh: DeviceMesh | None = None


def default_mesh() -> DeviceMesh:
    """A 1-D CPU mesh over every world rank, made (collectively) on first use."""
    global _default_mesh
    if _default_mesh is None:
        from mpi4py import MPI

        _default_mesh = init_device_mesh("cpu", (MPI.COMM_WORLD.Get_size(),))
    return _default_mesh


def _deferred(shape: tuple[int, ...], mesh: DeviceMesh, dtype: Any, fill: factory.Fill) -> Parameter:
    """A replicated parameter whose pieces are made when first needed, in the placements known
    by then (nn/deferred.py): building a model allocates nothing, sharding it only the shards."""
    spec = make_spec(mesh, (Replicate(),) * mesh.ndim, checked_shape(shape), check_dtype(dtype))
    return deferred_parameter(spec, fill)


def _uniform(shape: tuple[int, ...], bound: float, mesh: DeviceMesh, dtype: Any) -> Parameter:
    """Uniform in ±bound: ``rand * (2 * bound) - bound`` of the sharding-invariant RNG (the key
    is drawn now, in construction order; the values are made per piece, in place)."""
    draw = factory.random_fill("rand", shape, dtype, mesh)

    def fill(s: tuple[int, ...], o: tuple[int, ...], xp: Any) -> Any:
        u = draw(s, o, xp)
        xp.multiply(u, 2 * bound, out=u)
        xp.subtract(u, bound, out=u)
        return u

    return _deferred(shape, mesh, dtype, fill)


def lift(x: Any, mesh: DeviceMesh) -> DTensor:
    """A layer's input as a DTensor: a plain array is the complete value, the same on every rank
    (``Replicate`` on every dim of ``mesh``; no communication, no check that ranks agree)."""
    if isinstance(x, DTensor):
        return x
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"a layer takes a DTensor or an array, got {type(x).__name__}")
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, shape=x.shape)


class Linear(Module):
    """``y = x @ W.T + b`` with ``W`` of shape ``[out_features, in_features]`` (like torch),
    initialised uniform in ±1/sqrt(in_features), replicated until a plan shards it."""

    weight: Parameter
    bias: Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 device_mesh: DeviceMesh | None = None, dtype: Any = np.float32) -> None:
        super().__init__()
        mesh = device_mesh or default_mesh()
        self.in_features, self.out_features = in_features, out_features
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        self.weight = _uniform((out_features, in_features), bound, mesh, dtype)
        self.register_parameter("bias", _uniform((out_features,), bound, mesh, dtype) if bias else None)

    def forward(self, x: Any) -> Any:
        return linear(lift(x, self.weight.device_mesh), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ReLU(Module):
    """max(x, 0) on DTensors and on plain local arrays (between parallel layers)."""

    def forward(self, x: Any) -> Any:
        return x.relu() if isinstance(x, DTensor) else K.relu_kernel(_xp(x), x)


class Sequential(Module):
    def __init__(self, *layers: Module) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def forward(self, x: Any) -> Any:
        for layer in self._modules.values():
            x = layer(x)
        return x


class LayerNorm(Module):
    """Normalise over the last dim (which must not be sharded), then scale and shift."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *,
                 device_mesh: DeviceMesh | None = None, dtype: Any = np.float32) -> None:
        super().__init__()
        mesh = device_mesh or default_mesh()
        self.normalized_shape, self.eps = normalized_shape, eps
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.weight = _replicated(_ones, shape, mesh, dtype)
        self.bias = _replicated(_zeros, shape, mesh, dtype)

    def forward(self, x: Any) -> DTensor:
        return F.layer_norm(lift(x, self.weight.device_mesh), self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


def _ones(shape: tuple[int, ...], mesh: DeviceMesh, dtype: Any) -> factory.Fill:
    return lambda s, o, xp: xp.ones(s, dtype=dtype)


def _zeros(shape: tuple[int, ...], mesh: DeviceMesh, dtype: Any) -> factory.Fill:
    return lambda s, o, xp: xp.zeros(s, dtype=dtype)


def _normal(shape: tuple[int, ...], mesh: DeviceMesh, dtype: Any) -> factory.Fill:
    return factory.random_fill("randn", shape, dtype, mesh)


def _replicated(fill: Any, shape: tuple[int, ...], mesh: DeviceMesh, dtype: Any) -> Parameter:
    """A deferred replicated parameter filled by ``fill(shape, mesh, dtype)``'s fill."""
    dt = check_dtype(dtype)
    return _deferred(shape, mesh, dt, fill(shape, mesh, dt))


class RMSNorm(Module):
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dim (which must not be
    sharded); ``eps=None`` is the dtype's machine epsilon, as in torch."""

    def __init__(self, dim: int, eps: float | None = None, *, device_mesh: DeviceMesh | None = None,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = _replicated(_ones, (dim,), device_mesh or default_mesh(), dtype)

    def forward(self, x: Any) -> DTensor:
        return F.rms_norm(lift(x, self.weight.device_mesh), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class Embedding(Module):
    """A lookup table ``weight [num_embeddings, embedding_dim]`` initialised N(0, 1) (as torch),
    replicated until a plan shards it: ``RowwiseParallel()`` shards its rows (vocab-parallel:
    the lookup is ``Partial("sum")`` and the style reduces it), ``ColwiseParallel()`` its
    columns. See ``functional.embedding`` for the placement rules."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, device_mesh: DeviceMesh | None = None,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = _replicated(_normal, (num_embeddings, embedding_dim), device_mesh or default_mesh(), dtype)

    def forward(self, index: Any) -> DTensor:
        return F.embedding(index, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class GELU(Module):
    """``x * Phi(x)``; ``approximate="tanh"`` for the tanh approximation."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Any) -> Any:
        if isinstance(x, DTensor):
            return F.gelu(x, self.approximate)
        return K.gelu_kernel(_xp(x), x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(Module):
    """``x * sigmoid(x)``."""

    def forward(self, x: Any) -> Any:
        return F.silu(x) if isinstance(x, DTensor) else K.silu_kernel(_xp(x), x)


class Dropout(Module):
    """Zero elements with probability ``p`` in training mode (masks from the
    sharding-invariant RNG: the same mask on any mesh and plan); identity after ``eval()``."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p

    def forward(self, x: Any) -> Any:
        if isinstance(x, DTensor) or not self.training or self.p in (0.0, 1.0):
            return F.dropout(x, self.p, self.training)
        # a plain array: the mask a replicated tensor of its shape gets (the same random call)
        dtype = np.dtype(x.dtype)
        if dtype.kind != "f":
            raise DTypeMismatchError(f"Dropout needs a floating-point input, got {dtype}")
        u = _random.uniform(_random.next_key(), x.shape, x.shape, (0,) * x.ndim, dtype, _xp(x))
        return x * ((u >= self.p).astype(dtype) * (1.0 / (1.0 - self.p)))

    def extra_repr(self) -> str:
        return f"p={self.p}"
