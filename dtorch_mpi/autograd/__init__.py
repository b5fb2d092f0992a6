"""Reverse-mode autograd over DTensor operators (see docs/autograd.md)."""

from .grad_mode import enable_grad, is_grad_enabled, no_grad

__all__ = ["enable_grad", "is_grad_enabled", "no_grad"]
