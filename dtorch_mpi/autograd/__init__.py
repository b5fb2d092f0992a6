"""Reverse-mode autograd over DTensor operators (see docs/autograd.md)."""

from .grad_mode import enable_grad, is_grad_enabled, no_grad
from .graph import (
    RemovableHandle,
    current_backward,
    queue_callback,
    register_hook,
    register_post_accumulate_grad_hook,
)

__all__ = ["RemovableHandle", "current_backward", "enable_grad", "is_grad_enabled", "no_grad", "queue_callback",
           "register_hook", "register_post_accumulate_grad_hook"]
