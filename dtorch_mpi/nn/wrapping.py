"""What every data-parallel wrapper (``fully_shard``, ``replicate``) checks of its arguments, and
the tensors of a forward's output it hooks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..dtensor import DTensor
from ..mesh import DeviceMesh
from .module import Module


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
