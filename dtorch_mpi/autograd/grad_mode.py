"""Grad mode, re-exported: it lives in ``dtorch_mpi/grad_mode.py`` because DTensor reads it and
the autograd package imports DTensor (so dtensor.py does not import autograd back)."""

from ..grad_mode import _GradMode, enable_grad, is_grad_enabled, no_grad, note_requires_grad

__all__ = ["_GradMode", "enable_grad", "is_grad_enabled", "no_grad", "note_requires_grad"]
