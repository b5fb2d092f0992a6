"""Launching a child MPI job from a test, portably across MPICH, Open MPI and Intel MPI.

Two rules, each from a hang or a silent failure seen under Open MPI:

- The launcher is the one of the Python running the test (``MPIEXEC`` as set per stack by
  ``scripts/run_tests.py``, else the ``mpiexec`` next to ``sys.executable``, else ``PATH``): an
  ``mpiexec`` of another MPI starts every rank as a separate one-process job.
- The child gets ``os.environ`` passed explicitly. ``os.environ`` is the environment as it was
  when Python started; ``from mpi4py import MPI`` (a singleton ``MPI_Init``) may add variables to
  the C environment afterwards (Open MPI 4.1: ``OMPI_MCA_ess``, ``PMIX_*``, about 27), and a child
  ``mpiexec`` that inherits them exits 1 without a message. ``subprocess`` without ``env=`` hands
  on the C environment, so never launch without ``env=``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _own_launcher() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return os.environ.get("MPIEXEC") or (beside if os.access(beside, os.X_OK) else "") or shutil.which(
        "mpiexec") or "mpiexec"


MPIEXEC = _own_launcher()


def child_env(**extra: str) -> dict[str, str]:
    """The environment Python started with (not the C environment MPI_Init may have changed),
    plus ``extra``; ``MPIEXEC`` is set so that a driver in the child uses the same launcher, and
    this checkout leads ``PYTHONPATH`` (``python examples/x.py`` puts ``examples/`` first on
    ``sys.path``, which would otherwise import an installed copy of the package)."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, MPIEXEC=MPIEXEC, PYTHONPATH=path, **extra)


def run(cmd: list[str], timeout: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` from the repository root with ``env`` (default ``child_env()``), output captured."""
    return subprocess.run(cmd, env=child_env() if env is None else env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def mpiexec(n: int, *args: str, timeout: int = 180, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """``MPIEXEC -n n args...`` (see ``run``)."""
    return run([*MPIEXEC.split(), "-n", str(n), *args], timeout, env)
