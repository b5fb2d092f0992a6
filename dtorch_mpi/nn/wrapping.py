"""What every data-parallel wrapper (``fully_shard``, ``replicate``) checks of its arguments, the
wrapping agreed across the mesh, and the tensors of a forward's output it hooks."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..dtensor import DTensor
from ..mesh import DeviceMesh
from ..placement import Replicate
from ..spmd import require_same
from .deferred import leading_values
from .module import Module

_WRAPPED: dict[tuple[Any, ...], "itertools.count[int]"] = {}  # per set of mesh ranks: wrappers made on it
_SAMPLED = 64  # values of each replicated parameter compared across the ranks (its first row's first)


def check_module_and_dp_mesh(api: str, module: Any, mesh: Any) -> None:
    """``module`` is a Module and ``mesh`` a 1-D DeviceMesh (the data-parallel dim), or a clear
    ``TypeError`` / ``ValueError`` naming ``api`` and the fix."""
    if not isinstance(module, Module):
        raise TypeError(f"{api} takes a dtorch_mpi.nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{api}(module, *, mesh=...): mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"{api} needs a 1-D mesh (the data-parallel dim), got a {mesh.ndim}-D mesh; "
                         f"pass a sub-mesh such as mesh['dp']")


def agree_on_wrapping(api: str, module: Module, mesh: DeviceMesh, options: Mapping[str, object],
                      problem: BaseException | None = None) -> int:
    """The wrapper's number on ``mesh`` (0, 1, ... in the order every rank wraps), checked
    across the mesh's ranks together with the module's parameters (names, shapes, dtypes,
    placements, meshes: all the wrapper reads of them, so what it refuses after this it
    refuses on every rank) and ``options``: one small all-reduce, as DDP's constructor
    verifies its parameters' shapes. A wrapper is collective on its mesh, so the number names
    it alike on every rank: the divergence check then tells apart sibling modules wrapped
    separately, which hold parameters of the same names and shapes. The replicated
    parameters' leading values are compared too (a checksum of up to 64 each, made from the
    recipe where a parameter is still deferred, so nothing is materialised and a rank that
    already made its piece agrees with one that did not), so ranks that wrapped different
    siblings, or initialised with different seeds, are refused. ``problem`` (this rank's
    own refusal, checked before: an argument, a module wrapped already) raises on every rank,
    and still takes the number, as on the others."""
    serial = next(_WRAPPED.setdefault((mesh.device_type, tuple(mesh.mesh.ravel().tolist())), itertools.count()))
    named = list(module.named_parameters())
    params = tuple((name, tuple(p.shape), str(p.dtype), repr(p.placements), p.device_mesh.identity,  # (a sub-mesh's
                    p.requires_grad) for name, p in named)  # identity is the same on every rank; its ranks are not)
    values = tuple(zlib.crc32(np.ascontiguousarray(leading_values(p, _SAMPLED)).tobytes()) for _, p in named
                   if 0 not in tuple(p.shape) and all(isinstance(q, Replicate) for q in p.placements))
    require_same(mesh.get_comm(), {"wrapped before": serial, "parameters": params, **options, "values": values}, what={
        "wrapped before": f"{api}: the ranks of the mesh wrapped different numbers of modules on it before this "
                          f"one ({api} is collective on its mesh: every rank wraps the same modules, in the same order)",
        "parameters": f"{api}: the {type(module).__name__}'s parameters (names, shapes, dtypes, placements, "
                      f"meshes, requires_grad) differ between ranks; every rank must build the same model",
        **{name: f"{api}: {name} differs between ranks; pass the same {name} on every rank" for name in options},
        "values": f"{api}: the {type(module).__name__}'s replicated parameters hold different values on "
                  f"different ranks (checksums of their leading values): a model initialised with different "
                  f"seeds, or a different module of the same shapes wrapped on each rank; seed every rank alike "
                  f"(dt.manual_seed) and wrap the same module everywhere"}, problem=problem)
    return serial


def output_tensors(out: Any) -> Iterator[DTensor]:
    """The DTensors in a forward's output (nested tuples, lists and dicts): where a wrapper
    hooks the start of the module's backward."""
    if isinstance(out, DTensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for x in out:
            yield from output_tensors(x)
    elif isinstance(out, dict):
        for x in out.values():
            yield from output_tensors(x)
