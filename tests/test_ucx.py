"""UCX's rendezvous threshold (dtorch_mpi/ucx.py): set at import, before MPI starts, on a host
without an RDMA device; left alone where the process chose, where MPI started first, where the
host has an RDMA device, and when turned off. Each case imports the library in a child
interpreter: the variable is read once, when MPI starts."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import RUN_ONCE
from mpi_launch import child_env, run

from dtorch_mpi import ucx

pytestmark = RUN_ONCE

# what the library did, and the variable MPI started with
_CHILD = """
import os
{first}
from dtorch_mpi import ucx
from mpi4py import MPI
assert MPI.Is_initialized()
print(ucx.state, os.environ.get("UCX_RNDV_THRESH", "-"))
"""
_HERE = "RDMA device" if ucx._has_rdma_device() else "set"  # what this host gets by default


def _child(first: str = "import dtorch_mpi", **env: str) -> tuple[str, str]:
    environ = child_env(**env)
    for name in ("UCX_RNDV_THRESH", "DTORCH_UCX_RNDV_THRESH"):
        if name not in env:
            environ.pop(name, None)
    proc = run([sys.executable, "-c", _CHILD.format(first=first)], timeout=120, env=environ)
    assert proc.returncode == 0, proc.stderr
    state, value = proc.stdout.strip().rsplit(" ", 1)
    return state, value


def test_importing_the_library_first_sets_the_threshold_before_mpi_starts() -> None:
    want = "256k" if _HERE == "set" else "-"
    assert _child() == (_HERE, want)


def test_the_setting_chooses_the_value() -> None:
    want = "64k" if _HERE == "set" else "-"
    assert _child(DTORCH_UCX_RNDV_THRESH="64k") == (_HERE, want)


def test_the_process_s_own_value_is_kept() -> None:
    assert _child(UCX_RNDV_THRESH="1m") == ("the process's own", "1m")


def test_off_leaves_ucx_alone() -> None:
    assert _child(DTORCH_UCX_RNDV_THRESH="off") == ("off", "-")


def test_mpi_started_before_the_library_keeps_ucx_s_own_threshold() -> None:
    assert _child(first="from mpi4py import MPI; import dtorch_mpi") == ("MPI already started", "-")


def test_a_bad_value_fails_the_import_by_name() -> None:
    environ = child_env(DTORCH_UCX_RNDV_THRESH="lots")
    proc = run([sys.executable, "-c", "import dtorch_mpi"], timeout=120, env=environ)
    assert proc.returncode != 0 and "DTORCH_UCX_RNDV_THRESH='lots' is not a size" in proc.stderr


@pytest.mark.parametrize("devices,want", [([], "set"), (["mlx5_0"], "RDMA device")])
def test_a_host_with_an_rdma_device_keeps_ucx_s_own_threshold(
        tmp_path: os.PathLike[str], devices: list[str], want: str) -> None:
    for device in devices:
        os.mkdir(os.path.join(tmp_path, device))
    before, environ = ucx.state, {}
    try:
        assert ucx.choose(environ, rdma_devices=str(tmp_path), mpi_started=False) == want
    finally:
        ucx.state = before
    assert environ == ({"UCX_RNDV_THRESH": "256k"} if want == "set" else {})


def test_no_rdma_class_at_all_is_no_rdma_device(tmp_path: os.PathLike[str]) -> None:
    assert not ucx._has_rdma_device(os.path.join(tmp_path, "absent"))
