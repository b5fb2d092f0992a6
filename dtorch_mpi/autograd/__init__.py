"""Reverse-mode autograd over DTensor operators (see docs/autograd.md)."""

from typing import Any

from ..grad_mode import enable_grad, is_grad_enabled, no_grad
from .graph import (
    RemovableHandle,
    current_backward,
    queue_callback,
    register_hook,
    register_post_accumulate_grad_hook,
)


def wire(wiring: Any) -> None:
    """Connect DTensor's autograd methods (``backward``, hooks, recording a redistribute) to the
    graph: called once by ``dtorch_mpi/__init__.py`` (dtensor.py does not import autograd)."""
    from .graph import run_backward
    from .record import check_grad_layout, record_redistribute

    wiring.run_backward, wiring.check_grad_layout = run_backward, check_grad_layout
    wiring.register_hook, wiring.register_post_accumulate_grad_hook = register_hook, register_post_accumulate_grad_hook
    wiring.record_redistribute = record_redistribute


__all__ = ["RemovableHandle", "current_backward", "enable_grad", "is_grad_enabled", "no_grad", "queue_callback",
           "register_hook", "register_post_accumulate_grad_hook", "wire"]
