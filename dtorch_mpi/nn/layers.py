"""Layers: Linear, ReLU, Sequential, LayerNorm. Initial values come from the
sharding-invariant RNG, so a model has the same weights whatever its parallel plan."""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np

from .. import factory
from ..dtensor import DTensor
from ..mesh import DeviceMesh, init_device_mesh
from ..placement import Replicate
from .module import Module, Parameter

_default_mesh: DeviceMesh | None = None


def default_mesh() -> DeviceMesh:
    """A 1-D CPU mesh over every world rank, made (collectively) on first use."""
    global _default_mesh
    if _default_mesh is None:
        from mpi4py import MPI

        _default_mesh = init_device_mesh("cpu", (MPI.COMM_WORLD.Get_size(),))
    return _default_mesh


def _uniform(shape: tuple[int, ...], bound: float, mesh: DeviceMesh, dtype: Any) -> Parameter:
    u = factory.rand(*shape, dtype=dtype, device_mesh=mesh, placements=[Replicate()] * mesh.ndim)
    return Parameter(cast(DTensor, u * (2 * bound) - bound))


def linear(x: Any, weight: DTensor, bias: DTensor | None = None) -> Any:
    """``x @ weight.T + bias`` (weight ``[out, in]``)."""
    y = x @ weight.T
    return y + bias if bias is not None else y


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
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ReLU(Module):
    """max(x, 0) on DTensors and on plain local arrays (between parallel layers)."""

    def forward(self, x: Any) -> Any:
        if isinstance(x, DTensor):
            return x.relu()
        return x * (x > 0)


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
        rep = [Replicate()] * mesh.ndim
        self.weight = Parameter(factory.ones(normalized_shape, dtype=dtype, device_mesh=mesh, placements=rep))
        self.bias = Parameter(factory.zeros(normalized_shape, dtype=dtype, device_mesh=mesh, placements=rep))

    def forward(self, x: DTensor) -> DTensor:
        mu = x.mean(-1, keepdim=True)
        centred = x - mu
        var = (centred * centred).mean(-1, keepdim=True)
        return centred / (var + self.eps).sqrt() * self.weight + self.bias

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
