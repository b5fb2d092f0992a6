"""What every data-parallel wrapper (``fully_shard``, ``replicate``) checks of its arguments."""

from __future__ import annotations

from typing import Any

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
