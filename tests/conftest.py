"""MPI test harness: one verdict for all ranks, meshes as fixtures, SPMD-safe checks.

After every test phase (setup, call, teardown) the ranks agree on the outcome: a test that
fails on any rank is reported failed on every rank, with the failing ranks' tracebacks.
Nothing can hang: pytest-timeout (thread method) ends a stuck rank's process, and mpiexec
then ends the others; every mpiexec run is bounded by scripts/run_tests.py.
"""

from __future__ import annotations

import dtorch_mpi as dt  # first, as a user's program would: its import chooses UCX's threshold (dtorch_mpi/ucx.py)

# isort: split
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from dtorch_mpi.comm.deadline import allgather_bytes

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
RANK = WORLD.Get_rank()

try:  # absent on a bare GPU machine (scripts/gpu_check.sh runs only tests that do not need it)
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "spmd",
        derandomize=True,  # every rank draws the same examples
        database=None,
        deadline=None,
        max_examples=25,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.load_profile("spmd")
except ImportError:
    pass


RANK_INDEPENDENT = "rank_independent"
PATH_INDEPENDENT = "path_independent"
MAX_RANKS = "max_ranks"
RUN_ONCE = [getattr(pytest.mark, RANK_INDEPENDENT), getattr(pytest.mark, PATH_INDEPENDENT)]
"""The marks of a test whose result depends on neither the rank count nor the collective path
(a pure function, or one that launches its own mpiexec jobs): it runs once, in the 1-process
run on the first path. Which file takes which mark, and why: docs/testing.md."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--skip-path-independent", action="store_true",
                     help="this run repeats a collective path already run: deselect the tests marked "
                          f"{PATH_INDEPENDENT} (scripts/run_tests.py passes it on every path but the first)")
    _add_device_option(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Only rank 0 writes ``--junitxml`` (its verdicts are every rank's: the collective verdict
    below); the other ranks would overwrite the same file."""
    if RANK > 0 and getattr(config.option, "xmlpath", None):
        config.option.xmlpath = None
    _configure_device(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect what this run adds nothing to: ``rank_independent`` tests under mpiexec (they
    ran in the 1-process run), ``max_ranks(n)`` ones above n ranks, with
    ``--skip-path-independent`` ``path_independent`` ones, and with ``--device`` everything but
    the device-array cases. The same on every rank (marks and options are), so every rank runs
    the same tests."""
    skip_paths = config.getoption("--skip-path-independent")
    off_device = {id(item) for item in _select_for_device(items)}
    keep, drop = [], []
    for item in items:
        limit = item.get_closest_marker(MAX_RANKS)
        repeat = (SIZE > 1 and item.get_closest_marker(RANK_INDEPENDENT) is not None) or (
            skip_paths and item.get_closest_marker(PATH_INDEPENDENT) is not None) or (
            limit is not None and int(limit.args[0]) < SIZE)
        (drop if repeat or id(item) in off_device else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if SIZE == 1:
        return
    mine = report.longreprtext.encode() if report.failed else b""
    flag = np.array([1 if report.failed else 0], dtype=np.int32)
    flags = np.zeros(SIZE, dtype=np.int32)
    WORLD.Allgather(flag, flags)
    if not flags.any():
        return
    texts = allgather_bytes(WORLD, mine)
    failing = [r for r in range(SIZE) if flags[r]]
    others = [r for r in failing if r != RANK]
    if not others:
        return
    detail = "\n".join(
        f"----- rank {r} -----\n{texts[r].decode(errors='replace')[-4000:]}" for r in others
    )
    header = f"[{report.when}] failed on rank(s) {failing} of {SIZE}"
    if report.failed:
        report.sections.append((header, detail))
    else:
        report.outcome = "failed"
        report.longrepr = f"{header}\n{detail}"


class Checker:
    """Collects mismatches instead of asserting at once, so every rank reaches every collective
    of a test; ``done()`` asserts at the end, and the ``check`` fixture calls it at teardown so
    no test can forget it (failures a ``done()`` already reported are not reported again)."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.reported = 0  # failures done() has already seen

    def equal(self, got: Any, want: Any, what: str, *, exact: bool = True, rtol: float = 1e-5,
              atol: float = 1e-6) -> None:
        got_a, want_a = to_numpy(got), to_numpy(want)
        if got_a.shape != want_a.shape:
            self.failures.append(f"{what}: shape {got_a.shape} != {want_a.shape}")
        elif got_a.dtype != want_a.dtype:
            self.failures.append(f"{what}: dtype {got_a.dtype} != {want_a.dtype}")
        elif exact and not np.array_equal(got_a, want_a, equal_nan=got_a.dtype.kind in "fc"):
            self.failures.append(f"{what}: values differ")
        elif not exact and not np.allclose(got_a, want_a, rtol=rtol, atol=atol, equal_nan=True):
            self.failures.append(f"{what}: values differ beyond tolerance")

    def true(self, cond: bool, what: str) -> None:
        if not cond:
            self.failures.append(what)

    def done(self) -> None:
        new, self.reported = self.failures[self.reported:], len(self.failures)
        assert not new, f"{len(new)} mismatches:\n" + "\n".join(new[:30])


@pytest.fixture
def check() -> Iterator[Checker]:
    checker = Checker()
    yield checker
    checker.done()  # a test that never called done() is still verified


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A fresh directory every rank sees (made by rank 0, removed after the test)."""
    path = WORLD.bcast(tempfile.mkdtemp(prefix="dtorch-test-") if RANK == 0 else None, root=0)
    yield path
    WORLD.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=[600.0, 0.0], ids=["deadline", "no-deadline"])
def deadline(request: pytest.FixtureRequest) -> Iterator[float]:
    """The collective deadline on (600 s) and off (0: the same calls, polled without a clock),
    restored after the test."""
    from dtorch_mpi.comm import deadline as module

    before = module.collective_timeout()
    module.set_collective_timeout(request.param)
    yield request.param
    module.set_collective_timeout(before)


MESH2D_SHAPES = {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}


@pytest.fixture(scope="session")
def mesh1d() -> Iterator[dt.DeviceMesh]:
    mesh = dt.init_device_mesh("cpu", (SIZE,))
    yield mesh
    mesh.free()


@pytest.fixture(scope="session")
def mesh2d() -> Iterator[dt.DeviceMesh]:
    mesh = dt.init_device_mesh("cpu", MESH2D_SHAPES.get(SIZE, (SIZE, 1)), mesh_dim_names=("dp", "tp"))
    yield mesh
    mesh.free()


def _device_option() -> str:
    """``--device`` (read from the command line here, as the array backends below are fixed at
    import; ``pytest_configure`` checks it agrees with pytest's parse) or ``DTORCH_TEST_DEVICE``."""
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return os.environ.get("DTORCH_TEST_DEVICE", "auto")


DEVICE = _device_option()
EMULATED_CUPY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "emulated_cupy")
if DEVICE == "emulated":  # the test double of a GPU (tests/emulated_cupy), imported as ``cupy``
    if "cupy" in sys.modules and not getattr(sys.modules["cupy"], "EMULATED", False):
        raise RuntimeError("--device emulated: the real CuPy is imported already")
    sys.path.insert(0, EMULATED_CUPY)
    import cupy as _emulated

    assert _emulated.EMULATED, _emulated.__file__


def _add_device_option(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="auto", choices=("auto", "emulated", "cuda"),
                     help="the device of the CuPy array backend: auto (a real GPU where there is one), emulated "
                          "(tests/emulated_cupy, a test double of CuPy and NCCL over MPI: only the device-array "
                          "cases run), cuda (a real GPU required: only the device-array cases run)")


def _configure_device(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "device: runs in a --device pass too (a test of the GPU path itself)")
    if config.getoption("device") != DEVICE and "DTORCH_TEST_DEVICE" not in os.environ:
        raise pytest.UsageError(f"--device {config.getoption('device')!r} was not seen at import ({DEVICE!r})")
    if DEVICE == "cuda" and (not HAVE_GPU or getattr(sys.modules.get("cupy"), "EMULATED", False)):
        raise pytest.UsageError("--device cuda needs the real CuPy and a GPU on every rank "
                                "(--device emulated is the test double)")


def _select_for_device(items: list[pytest.Item]) -> list[pytest.Item]:
    """With a device chosen, only the device-array cases and the ``device``-marked tests run (the
    CPU pass runs everything else)."""
    if DEVICE == "auto":
        return []
    drop = []
    for item in items:
        params = getattr(item, "callspec", None)
        on_device = params is not None and any(params.params.get(f) == "cuda" for f in DEVICE_PARAMETRISED)
        if not (on_device or item.get_closest_marker("device")):
            drop.append(item)
    return drop


DEVICE_PARAMETRISED = ("xp_mesh1d", "xp_mesh2d", "xp_device", "any_mesh")


def _every_rank_has_a_gpu() -> bool:
    """CuPy importable and a GPU on every rank (agreed: every rank skips or none does)."""
    try:
        import cupy

        mine = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        mine = False
    return bool(WORLD.allreduce(int(mine), op=MPI.MIN))


HAVE_GPU = _every_rank_has_a_gpu()
NO_GPU = "CuPy array backend: needs CuPy and a GPU on every rank"
CUDA_ID = "cupy-emulated" if DEVICE == "emulated" else "cupy"  # the test double named in every test id
ARRAY_BACKENDS = [pytest.param("cpu", id="numpy"),
                  pytest.param("cuda", id=CUDA_ID, marks=pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU))]


def to_numpy(a: Any) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array (or scalar), for comparison with the reference."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def on_mesh(mesh: dt.DeviceMesh, a: np.ndarray) -> Any:
    """``a`` in the mesh's array library (a CuPy copy on a cuda mesh)."""
    if mesh.device_type == "cpu":
        return a
    import cupy

    return cupy.asarray(a)


@pytest.fixture(scope="session", params=ARRAY_BACKENDS)
def xp_mesh1d(request: pytest.FixtureRequest) -> Iterator[dt.DeviceMesh]:
    """A 1-d mesh per array backend (NumPy on "cpu", CuPy on "cuda"): the op and redistribute
    tests take it as their ``mesh1d``, so one test body runs over both (CuPy's ``testing``
    style); the CuPy case skips with one reason where there is no GPU."""
    mesh = dt.init_device_mesh(request.param, (SIZE,))
    yield mesh
    mesh.free()


@pytest.fixture(scope="session", params=ARRAY_BACKENDS)
def xp_mesh2d(request: pytest.FixtureRequest) -> Iterator[dt.DeviceMesh]:
    """``mesh2d``'s shape, per array backend (see ``xp_mesh1d``)."""
    mesh = dt.init_device_mesh(request.param, MESH2D_SHAPES.get(SIZE, (SIZE, 1)), mesh_dim_names=("dp", "tp"))
    yield mesh
    mesh.free()


@pytest.fixture(params=ARRAY_BACKENDS)
def xp_device(request: pytest.FixtureRequest) -> str:
    """The device type per array backend ("cpu": NumPy, "cuda": CuPy), for tests that build
    their own meshes (several shapes, as training plans do); see ``xp_mesh1d``."""
    return str(request.param)


def lengths_for(m: int) -> list[int]:
    """Lengths 0, 1, below, equal to and not divisible by the rank count ``m``."""
    return sorted({0, 1, max(m - 1, 0), m, m + 1, 2 * m + 1, 7})


def reference(shape: tuple[int, ...], dtype: Any = np.float64, seed: int = 0) -> np.ndarray:
    """A deterministic full array, identical on every rank."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(0, 100, size=shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture
def rule_hits() -> Any:
    """The forward rules operators run in the test, as ``(op name, rule index)`` (test_ops and
    test_autograd check that every declared rule ran)."""
    from dtorch_mpi.ops import apply, dispatch

    dispatch.RULE_HITS = set()
    apply.clear_plan_cache()
    yield dispatch.RULE_HITS
    dispatch.RULE_HITS = None
