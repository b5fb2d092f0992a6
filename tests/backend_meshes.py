"""The two fixtures a test module imports to run every body over each array backend:
``from backend_meshes import mesh1d_per_backend, mesh2d_per_backend`` makes that module's
``mesh1d`` / ``mesh2d`` conftest's ``xp_mesh1d`` / ``xp_mesh2d`` (NumPy pieces, and CuPy pieces
where every rank has a GPU: the emulated CuPy, a test double, under ``--device emulated``). They
are registered under the names ``mesh1d`` / ``mesh2d``, overriding conftest's in that module only;
the import names differ so that the test parameters do not shadow them."""

from __future__ import annotations

import pytest

import dtorch_mpi as dt


@pytest.fixture(name="mesh1d")
def mesh1d_per_backend(xp_mesh1d: dt.DeviceMesh) -> dt.DeviceMesh:
    """The importing module's ``mesh1d``: one per array backend."""
    return xp_mesh1d


@pytest.fixture(name="mesh2d")
def mesh2d_per_backend(xp_mesh2d: dt.DeviceMesh) -> dt.DeviceMesh:
    """``mesh2d`` per array backend (see ``mesh1d_per_backend``)."""
    return xp_mesh2d
