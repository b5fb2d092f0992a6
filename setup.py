"""Packaging is declared in pyproject.toml; this file adds only the one compiled module, which
setuptools takes from ``setup.py`` (its pyproject form is still experimental)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # The divergence check's shared-memory board (dtorch_mpi/comm/divergence.py's _Board):
        # optional, the same rules run in Python where it cannot be built (no compiler or headers).
        Extension("dtorch_mpi.comm._board", sources=["dtorch_mpi/comm/_board.c"], optional=True),
    ]
)
