"""EMULATED DEVICE (test double): ``cupyx.scipy``."""

from . import special  # noqa: F401
