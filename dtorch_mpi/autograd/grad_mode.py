"""Whether operators record the autograd graph: on by default, off inside ``no_grad()``."""

from __future__ import annotations

from types import TracebackType


class _GradMode:
    enabled = True


def is_grad_enabled() -> bool:
    """True when operators on tensors that require grad record what backward needs."""
    return _GradMode.enabled


class _SetGradMode:
    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._previous = True

    def __enter__(self) -> None:
        self._previous = _GradMode.enabled
        _GradMode.enabled = self._enabled

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _GradMode.enabled = self._previous


def no_grad() -> _SetGradMode:
    """``with dtorch.no_grad():`` operators record nothing (as torch.no_grad)."""
    return _SetGradMode(False)


def enable_grad() -> _SetGradMode:
    """``with dtorch.enable_grad():`` recording on again inside a ``no_grad`` block."""
    return _SetGradMode(True)
