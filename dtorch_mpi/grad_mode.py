"""Whether operators record the autograd graph: on by default, off inside ``no_grad()``."""

from __future__ import annotations

from types import TracebackType


class _GradMode:
    enabled = True
    """Grad mode (``no_grad()`` turns it off)."""
    seen = False
    """Some tensor has required grad in this process (an inference-only program never records)."""
    recording = False
    """``enabled and seen``: the one flag the operator hot path tests."""

    @classmethod
    def set(cls, enabled: bool | None = None, seen: bool | None = None) -> None:
        cls.enabled = cls.enabled if enabled is None else enabled
        cls.seen = cls.seen or bool(seen)
        cls.recording = cls.enabled and cls.seen


def note_requires_grad() -> None:
    """Called whenever a tensor starts requiring grad: from now on operators check operands."""
    if not _GradMode.seen:
        _GradMode.set(seen=True)


def is_grad_enabled() -> bool:
    """True when operators on tensors that require grad record what backward needs."""
    return _GradMode.enabled


class _SetGradMode:
    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._previous = True

    def __enter__(self) -> None:
        self._previous = _GradMode.enabled
        _GradMode.set(enabled=self._enabled)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _GradMode.set(enabled=self._previous)


def no_grad() -> _SetGradMode:
    """``with dtorch.no_grad():`` operators record nothing (as torch.no_grad)."""
    return _SetGradMode(False)


def enable_grad() -> _SetGradMode:
    """``with dtorch.enable_grad():`` recording on again inside a ``no_grad`` block."""
    return _SetGradMode(True)
