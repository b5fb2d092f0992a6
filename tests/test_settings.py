"""The settings registry (dtorch_mpi/settings.py): every ``DTORCH_*`` name the code reads is
declared there and read through it, each default parses and each bad value is refused by name,
first-use settings are kept and replaced by their ``set_*`` functions, the mesh's agreement
takes exactly the ``agreed`` settings, and an unknown ``DTORCH_*`` variable is warned about once
with the closest known name."""

from __future__ import annotations

import os
import re
import sys

import pytest
from conftest import RUN_ONCE
from mpi_launch import ROOT, child_env, run

import dtorch_mpi as dt
from dtorch_mpi import settings

pytestmark = RUN_ONCE  # reads the registry, the sources and one child interpreter: no communication

NAME = re.compile(r"\bDTORCH_[A-Z0-9_]*[A-Z0-9]\b")


def _sources(*folders: str, exts: tuple[str, ...] = (".py", ".sh", ".md")) -> dict[str, str]:
    found = {}
    for folder in folders:
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(exts):
                    path = os.path.join(base, name)
                    with open(path, encoding="utf-8") as fh:
                        found[os.path.relpath(path, ROOT)] = fh.read()
    return found


def test_every_name_the_library_reads_is_declared_and_read_through_the_registry() -> None:
    library = _sources("dtorch_mpi", exts=(".py",))
    library.pop(os.path.join("dtorch_mpi", "settings.py"))
    names = {n for text in library.values() for n in NAME.findall(text)}
    assert names - set(settings.SETTINGS) == set(), "declare these in dtorch_mpi/settings.py"
    direct = [path for path, text in library.items()
              if re.search(r"environ(\.get)?[\[(]\s*['\"]DTORCH_|getenv\(\s*['\"]DTORCH_", text)]
    assert direct == [], f"read these through dtorch_mpi.settings.get: {direct}"


def test_every_name_the_suite_scripts_and_docs_use_is_known() -> None:
    """A name in tests/, scripts/, examples/ or docs/ that is neither a setting nor a tooling
    variable would be warned about as unknown: declare it (settings.TOOLING for the suite's)."""
    texts = _sources("tests", "scripts", "examples", "docs")
    texts.pop(os.path.join("tests", "test_settings.py"))  # its planted unknown names
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        texts["README.md"] = fh.read()
    unknown = {(path, n) for path, text in texts.items() for n in NAME.findall(text)
               if n not in settings.SETTINGS and n not in settings.TOOLING}
    assert unknown == set()


@pytest.mark.parametrize("name", sorted(settings.SETTINGS))
def test_defaults_parse_and_the_entry_is_complete(name: str) -> None:
    s = settings.SETTINGS[name]
    assert s.name == name and s.doc and s.type and s.used_by and s.read in settings.READ_AT
    assert os.path.exists(os.path.join(ROOT, "dtorch_mpi", s.used_by)), s.used_by
    if s.default is not None:
        s.parse(s.default)


@pytest.mark.parametrize("name,text,message", [
    ("DTORCH_COMM_PATH", "fast", "DTORCH_COMM_PATH='fast' is not one of auto, padded, variable"),
    ("DTORCH_COLLECTIVE_TIMEOUT", "soon", "DTORCH_COLLECTIVE_TIMEOUT='soon' is not a number of seconds"),
    ("DTORCH_BUFFER_POOL_BYTES", "-1", "DTORCH_BUFFER_POOL_BYTES='-1' must be a byte count >= 0"),
    ("DTORCH_BUFFER_POOL_BYTES", "1M", "DTORCH_BUFFER_POOL_BYTES='1M' must be a byte count >= 0"),
    ("DTORCH_ASYNC_PROGRESS", "fibre", "DTORCH_ASYNC_PROGRESS='fibre': use one of thread, off"),
    ("DTORCH_PROGRESS_INTERVAL", "0", "DTORCH_PROGRESS_INTERVAL='0' must be a positive number of microseconds"),
    ("DTORCH_PROGRESS_INTERVAL", "x", "DTORCH_PROGRESS_INTERVAL='x' is not a number of microseconds"),
    ("DTORCH_SEED", "one", "DTORCH_SEED='one' is not an integer"),
    ("DTORCH_UCX_RNDV_THRESH", "big", "DTORCH_UCX_RNDV_THRESH='big' is not a size such as 256k, 1m or 65536, nor off"),
    ("DTORCH_UCX_RNDV_THRESH", "2 MB", "DTORCH_UCX_RNDV_THRESH='2 MB' is not a size"),
])
def test_bad_values_are_refused_by_name(name: str, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        settings.parse(name, text)


@pytest.mark.parametrize("name,text,want", [
    ("DTORCH_SPMD_DEBUG", "", False), ("DTORCH_SPMD_DEBUG", "0", False), ("DTORCH_SPMD_DEBUG", "1", True),
    ("DTORCH_ABORT_ON_EXCEPTION", "Off", False), ("DTORCH_ABORT_ON_EXCEPTION", " no ", False),
    ("DTORCH_ABORT_ON_EXCEPTION", "1", True), ("DTORCH_CUDA_AWARE_MPI", "0", False),
    ("DTORCH_COLLECTIVE_TIMEOUT", "2.5", 2.5), ("DTORCH_BUFFER_POOL_BYTES", "0", 0),
    ("DTORCH_PROGRESS_INTERVAL", "10", 10.0), ("DTORCH_SEED", "-3", -3),
    ("DTORCH_UCX_RNDV_THRESH", "256k", "256k"), ("DTORCH_UCX_RNDV_THRESH", "65536", "65536"),
    ("DTORCH_UCX_RNDV_THRESH", "1MB", "1MB"), ("DTORCH_UCX_RNDV_THRESH", "Off", None),
    ("DTORCH_UCX_RNDV_THRESH", "", None),
])
def test_values_parse_as_before(name: str, text: str, want: object) -> None:
    assert settings.parse(name, text) == want


def test_first_use_settings_are_kept_and_set_functions_replace_them(monkeypatch: pytest.MonkeyPatch) -> None:
    before = dt.comm.comm_path()
    monkeypatch.setenv("DTORCH_COMM_PATH", "padded" if before != "padded" else "variable")
    assert dt.comm.comm_path() == before, "read at first use, then kept"
    try:
        dt.set_comm_path("variable")
        assert settings.get("DTORCH_COMM_PATH") == "variable" and dt.comm.comm_path() == "variable"
        with pytest.raises(ValueError, match="is not one of"):
            dt.set_comm_path("fast")
        assert dt.comm.comm_path() == "variable", "a refused value changes nothing"
    finally:
        dt.set_comm_path(before)
    monkeypatch.setenv("DTORCH_PROGRESS_INTERVAL", "7")
    assert settings.get("DTORCH_PROGRESS_INTERVAL") == 7.0, "a per-call setting is read at every call"
    with pytest.raises(ValueError, match="no process-wide value"):
        settings.put("DTORCH_PROGRESS_INTERVAL", 1.0)


def test_the_mesh_agrees_on_exactly_the_agreed_settings() -> None:
    assert set(settings.agreed()) == {"DTORCH_COMM_PATH", "DTORCH_SPMD_DEBUG", "DTORCH_SPMD_CHECK",
                                     "DTORCH_SPMD_CHECK_FORM", "DTORCH_COLLECTIVE_TIMEOUT"}
    assert settings.agreed() == {"DTORCH_COMM_PATH": dt.comm.comm_path(),
                                 "DTORCH_SPMD_DEBUG": dt.comm.config.spmd_debug(),
                                 "DTORCH_SPMD_CHECK": dt.comm.config.spmd_check(),
                                 "DTORCH_SPMD_CHECK_FORM": dt.comm.config.check_form(),
                                 "DTORCH_COLLECTIVE_TIMEOUT": dt.comm.deadline.collective_timeout()}


def test_unknown_names_get_the_closest_known_one() -> None:
    env = {"DTORCH_COMM_PAHT": "padded", "DTORCH_SEED": "1", "DTORCH_TEST_LOGDIR": "x", "DTORCH_ZZZ": "1",
           "HOME": "/"}
    assert settings.unknown(env) == {"DTORCH_COMM_PAHT": "DTORCH_COMM_PATH", "DTORCH_ZZZ": None}
    assert settings.unknown({"DTORCH_SEED": "1", "PATH": "/bin"}) == {}


def test_an_unknown_variable_is_warned_about_once_at_import() -> None:
    code = "import dtorch_mpi, dtorch_mpi.settings as s, importlib; s.get('DTORCH_COMM_PATH'); print('imported')"
    env = child_env(DTORCH_COMM_PAHT="padded", DTORCH_SEED="2")
    env.pop("DTORCH_TEST_ALL_OUTPUT", None)
    proc = run([sys.executable, "-c", code], timeout=120, env=env)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.count("unknown dtorch_mpi environment variable") == 1, proc.stderr
    assert "DTORCH_COMM_PAHT (did you mean DTORCH_COMM_PATH?)" in proc.stderr, proc.stderr
    assert "DTORCH_SEED" not in proc.stderr, proc.stderr
