"""Every ``DTORCH_*`` environment variable, declared once: name, type, default, what it does,
how its text is parsed and when it is read (docs/settings.md is generated from this table by
scripts/gen_settings.py; tests/test_docs.py checks it is current).

``get(name)`` is the one way the library reads a setting. A setting read at *first use* is
parsed once and kept (its module's ``set_*`` function replaces the kept value through ``put``);
every other one is parsed from the environment each time it is asked for, which is when its
``read`` column says. The settings marked ``agreed`` decide which MPI calls the library makes
or how long it waits on them: every ``DeviceMesh`` construction checks that all ranks hold the
same values (``agreed()``, mesh.py). A ``DTORCH_*`` variable that is neither a setting nor one
the test suite and scripts read (``TOOLING``) is warned about once, when the package is
imported, with the closest known name: a typo is otherwise silently ignored.

A leaf module: it imports nothing from the package, so any module may read a setting.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["READ_AT", "SETTINGS", "TOOLING", "Setting", "agreed", "get", "parse", "put", "unknown"]

PREFIX = "DTORCH_"

READ_AT = {
    "import": "when its module is imported",
    "first use": "at its first use, then kept (a `set_*` call replaces it)",
    "mesh creation": "at each `DeviceMesh` construction",
    "first cuda mesh": "at the first `cuda` `DeviceMesh` construction, then kept",
    "per call": "at every call that uses it",
}


@dataclass(frozen=True)
class Setting:
    """One environment variable the library reads."""

    name: str
    type: str  # what the text may be, for the docs table
    default: str | None  # the text used when the variable is unset (None: unset means "ask MPI")
    doc: str
    parse: Callable[[str], Any]  # text -> value; raises ValueError naming the variable and the fix
    read: str  # a key of READ_AT
    used_by: str  # the module that acts on it
    agreed: bool = False  # decides MPI calls: every rank must hold the same value (checked per mesh)


# --- parsers (each raises ValueError with the variable's name and what it accepts) ----------
def _choice(name: str, values: tuple[str, ...], verb: str = " is not one of") -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError(f"{name}={text!r}{verb} {', '.join(values)}")
        return text

    return parse


def _on_unless_empty_or_zero(text: str) -> bool:
    return text not in ("", "0")


def _on_unless_off(text: str) -> bool:
    return text.strip().lower() not in ("0", "false", "no", "off")


def _ucx_size_or_off(text: str) -> str | None:
    """A size as UCX writes one (``256k``, ``1m``, ``65536``), or ``off`` (or empty): None."""
    if text.strip().lower() in ("", "off"):
        return None
    if not re.fullmatch(r"[0-9]+[kmg]?b?", text.strip().lower()):
        raise ValueError(f"DTORCH_UCX_RNDV_THRESH={text!r} is not a size such as 256k, 1m or 65536, nor off")
    return text.strip()


N = TypeVar("N", int, float)


def _number(name: str, convert: Callable[[str], N], not_one: str,
            refused: Callable[[N], bool] = lambda value: False, refusal: str | None = None) -> Callable[[str], N]:
    """A number's parser: text ``convert`` (int, float) rejects raises "NAME='text' <not_one>",
    a value ``refused`` (out of range) "NAME='text' <refusal>" (by default the same phrase)."""
    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} {not_one}") from None
        if refused(value):
            raise ValueError(f"{name}={text!r} {refusal or not_one}")
        return value

    return parse


COMM_PATHS = ("auto", "padded", "variable")
PROGRESS_MODES = ("thread", "off")
ISSUE_MODES = ("thread", "inline")
CHECK_FORMS = ("auto", "allreduce")

SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("DTORCH_COMM_PATH", "`auto` \\| `padded` \\| `variable`", "auto",
            "Which collectives move unequal pieces: `auto` takes the equal-size ones for equal "
            "pieces and the `v`/`w` ones otherwise, `padded` always pads to equal sizes (NCCL's "
            "path, selectable on CPU), `variable` always takes the `v`/`w` ones.",
            _choice("DTORCH_COMM_PATH", COMM_PATHS), "first use", "comm/config.py", agreed=True),
    Setting("DTORCH_SPMD_DEBUG", "flag (`1` on; unset, empty or `0` off)", "",
            "Every collective first checks that all ranks of its group make the same call "
            "(kind, shapes, dtype, MPI method and counts), raising `SPMDDivergenceError` instead "
            "of hanging; random calls and `from_local` are checked too.",
            _on_unless_empty_or_zero, "first use", "comm/config.py", agreed=True),
    Setting("DTORCH_SPMD_CHECK", "flag (`0` off; unset or `1` on)", "1",
            "The default divergence check: for a collective whose group-wide payload is 64 KiB or "
            "more (and the bucket all-reduces of `replicate` and `reduce_gradients` and the first call "
            "of each batch of a `fully_shard` unit, whatever their size), the group compares a fingerprint of the call (one 2-int64 persistent all-reduce "
            "on a communicator of its own; with the MPI backend on MPICH a blocking call's data "
            "moves meanwhile, on another communicator of its own, and nothing is returned before "
            "the verdict; on one node the comparison is a shared-memory board instead, see "
            "`DTORCH_SPMD_CHECK_FORM`) and raises `SPMDDivergenceError` on every rank instead of returning data "
            "of different calls. `0` turns it off (to measure its cost).",
            _on_unless_empty_or_zero, "first use", "comm/config.py", agreed=True),
    Setting("DTORCH_SPMD_CHECK_FORM", "`auto` \\| `allreduce`", "auto",
            "How the divergence check compares a group's fingerprints: `auto` on a shared-memory "
            "board where the group's ranks share one node (a store and a few loads per check, no "
            "collective) and with the all-reduce elsewhere; `allreduce` always with the all-reduce "
            "(for an MPI whose shared-memory windows misbehave). Read when a mesh is built.",
            _choice("DTORCH_SPMD_CHECK_FORM", CHECK_FORMS), "first use", "comm/config.py", agreed=True),
    Setting("DTORCH_COLLECTIVE_TIMEOUT", "seconds (a number; `0` turns the deadline off)", "600",
            "How long a collective may take before `CollectiveTimeoutError` names it.",
            _number("DTORCH_COLLECTIVE_TIMEOUT", float, "is not a number of seconds"),
            "first use", "comm/deadline.py", agreed=True),
    Setting("DTORCH_WAIT_SPIN", "microseconds >= 0", "500",
            "How long a rank waiting in a collective polls without pause before it backs off "
            "to short sleeps (growing to 1 ms, at most an eighth of the time waited so far), "
            "so waiting ranks leave shared cores to the ranks still working. The library's "
            "background issue thread spins at most 50 µs (its polls hold the GIL).",
            _number("DTORCH_WAIT_SPIN", float, "is not a number of microseconds",
                    lambda us: not us >= 0, "must be a number of microseconds >= 0"),
            "first use", "comm/deadline.py"),
    Setting("DTORCH_BUFFER_POOL_BYTES", "byte count >= 0 (`0` turns reuse off)", str(256 << 20),
            "The most bytes the collective buffer pool keeps for reuse (oldest sizes go first).",
            _number("DTORCH_BUFFER_POOL_BYTES", int, "must be a byte count >= 0 (0 turns buffer reuse off)",
                    lambda n: n < 0), "first use", "comm/pool.py"),
    Setting("DTORCH_ASYNC_PROGRESS", "`thread` \\| `off`", "thread",
            "Who advances nonblocking collectives: a daemon thread (where MPI runs at "
            "`MPI_THREAD_MULTIPLE`; below that it is `off`), or only the library's own calls.",
            _choice("DTORCH_ASYNC_PROGRESS", PROGRESS_MODES, ": use one of"), "per call", "comm/progress.py"),
    Setting("DTORCH_PROGRESS_INTERVAL", "microseconds > 0", "50",
            "The progress thread's base poll interval.",
            _number("DTORCH_PROGRESS_INTERVAL", float, "is not a number of microseconds",
                    lambda us: us <= 0, "must be a positive number of microseconds"), "per call", "comm/progress.py"),
    Setting("DTORCH_ASYNC_ISSUE", "`thread` \\| `inline`", "thread",
            "Who checks and starts the collectives `fully_shard` and `replicate` overlap with "
            "compute (prefetched all-gathers, reduce-scatters, bucket all-reduces of 64 KiB or "
            "more): a daemon thread, in the order the program made them (where MPI runs at "
            "`MPI_THREAD_MULTIPLE` and the check's data moves on a communicator of its own: the "
            "MPI backend on MPICH; never in SPMD debug mode, which checks every call before it "
            "starts), so the wait for the other ranks' check and MPI's first copy "
            "leave the computing thread; or the calling thread (`inline`). An error such a call's "
            "check finds is raised at the library's wait for it.",
            _choice("DTORCH_ASYNC_ISSUE", ISSUE_MODES, ": use one of"), "first use", "comm/issuer.py"),
    Setting("DTORCH_SAVE_NICE", "integer 0-19", "10",
            "The nice value of an asynchronous save's writer thread (on Linux a thread has its "
            "own): the threads of the training loop take a busy core first and the write the "
            "cycles they leave. `10` (about a tenth of a core against a thread at 0): on 2 cores, "
            "NumPy work beside the write slowed 3-4 % instead of 42-45 % at 3 ranks, off-core work "
            "6-15 % instead of 15-18 % at 4 (docs/training.md); `19` did worse (the writer, holding "
            "the GIL, waited for a core); `0` shares the cores equally.",
            _number("DTORCH_SAVE_NICE", int, "is not an integer",
                    lambda n: not 0 <= n <= 19, "must be an integer from 0 to 19"),
            "per call", "checkpoint/writer.py"),
    Setting("DTORCH_GPU_BACKEND", "`auto` or a registered cuda backend (`nccl` \\| `cuda-aware-mpi` "
            "\\| `host-staging`)", "auto",
            "The backend of `cuda` meshes; `auto` takes NCCL where every rank has a GPU of its "
            "own, else CUDA-aware MPI where MPI is, else host staging. Agreed across ranks when "
            "it is chosen.",
            str, "first cuda mesh", "comm/gpu_select.py"),
    Setting("DTORCH_CUDA_AWARE_MPI", "flag (`1` yes, empty or `0` no)", None,
            "Declares whether MPI takes GPU memory; unset, MPI is asked (`MPI.Query_cuda_support`).",
            _on_unless_empty_or_zero, "first cuda mesh", "comm/gpu_select.py"),
    Setting("DTORCH_ABORT_ON_EXCEPTION", "flag (`0`, `false`, `no`, `off` turn it off)", "1",
            "An uncaught exception on one rank of a multi-rank, non-interactive run calls "
            "`MPI_Abort`, ending the whole job instead of leaving the other ranks waiting.",
            _on_unless_off, "mesh creation", "abort.py"),
    Setting("DTORCH_SEED", "integer", "0",
            "The seed of the counter-based random sequence (the same on every rank).",
            _number("DTORCH_SEED", int, "is not an integer"), "first use", "random.py"),
    Setting("DTORCH_TRACE", "a file path (empty: off)", "",
            "Trace the whole program: a Chrome-trace / Perfetto timeline of collectives, backward "
            "nodes and spans, written at exit as `PATH` with `.rank<r>` before the suffix.",
            str, "import", "timeline.py"),
    Setting("DTORCH_COMM_REPORT", "flag (`1` on; unset, empty or `0` off)", "",
            "Count every collective of the script and print the table at exit (rank 0).",
            _on_unless_empty_or_zero, "import", "comm/counter.py"),
    Setting("DTORCH_MALLOC_TUNING", "flag (`1` on; unset, empty or `0` off)", "",
            "Opt in: on glibc, set the allocator's mmap threshold to 64 MiB and its trim "
            "threshold to 256 MiB at import, so MB-sized arrays a step makes anew (gradients, "
            "MPI's own temporary buffers) reuse freed heap memory instead of faulting in fresh "
            "pages and unmapping them again; left alone where `GLIBC_TUNABLES` or glibc's "
            "`MALLOC_MMAP_THRESHOLD_`/`MALLOC_TRIM_THRESHOLD_` chose already.",
            _on_unless_empty_or_zero, "import", "heap.py"),
    Setting("DTORCH_UCX_RNDV_THRESH", "a size as UCX writes one (`256k`, `1m`), or `off`", "256k",
            "UCX's rendezvous threshold (`UCX_RNDV_THRESH`), set at import before MPI starts where "
            "the host has no RDMA device, so that a message between hosts over TCP above it streams "
            "in instead of arriving in 64 KiB fragments that each wait for a poll: a 2 MB collective "
            "beside compute finishes 2-3x sooner. Left alone where `UCX_RNDV_THRESH` is set, where "
            "MPI started before `dtorch_mpi` was imported, and with `off`.",
            _ucx_size_or_off, "import", "ucx.py"),
)}

TOOLING: dict[str, str] = {
    "DTORCH_TEST_ALL_OUTPUT": "tests/rank_wrapper.sh: every rank prints to the terminal (else ranks > 0 log "
                              "to `.mpi-logs/`)",
    "DTORCH_TEST_LOGDIR": "tests/rank_wrapper.sh: where ranks > 0 log (scripts/run_tests.py sets one per run)",
    "DTORCH_FUZZ_EXAMPLES": "tests/test_fuzz.py: Hypothesis examples per property (`make fuzz` runs 500)",
    "DTORCH_PYTHON": "scripts/slurm/test_slurm.sh and scripts/test_multihost.sh: the Python the jobs run",
    "DTORCH_TEST_MULTIHOST": "tests/test_multihost.py: set by scripts/test_multihost.sh (the job spans fake hosts)",
    "DTORCH_TEST_PRIVATE_TMP": "tests/test_multihost.py: each fake host has its own /tmp",
    "DTORCH_MULTIHOST_TIMEOUT": "scripts/test_multihost.sh: seconds each multi-host run may take (600)",
    "DTORCH_EMULATED_GPUS": "tests/emulated_cupy (test double): devices per host (default one per rank)",
    "DTORCH_EMULATED_SYNC_LIMIT": "tests/emulated_cupy (test double): seconds a synchronize waits before giving up",
    "DTORCH_TEST_DEVICE": "tests/conftest.py: the device switch (`emulated` | `cuda`), as `--device`",
    "DTORCH_EXAMPLE_RESULTS": "examples/quickstart.py, tensor_parallel_mlp.py: where tests/test_examples.py "
                              "has the example save what it recomputes",
}
"""``DTORCH_*`` variables read by the test suite and scripts, not by the library."""

_kept: dict[str, Any] = {}


def _setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not a dtorch_mpi setting (known: {', '.join(SETTINGS)})") from None


def parse(name: str, text: str) -> Any:
    """``text`` as setting ``name``'s value (ValueError naming the variable when it is not one)."""
    return _setting(name).parse(text)


def get(name: str) -> Any:
    """The setting's value: kept after its first use, or parsed from the environment now
    (see ``read``); None for a setting unset without a default."""
    try:
        return _kept[name]  # only first-use settings are kept: the common case, on every collective
    except KeyError:
        pass
    s = _setting(name)
    text = os.environ.get(name, s.default)
    value = None if text is None else s.parse(text)
    if s.read == "first use":
        _kept[name] = value
    return value


def put(name: str, value: Any) -> None:
    """Replace a first-use setting's kept value for this process (its module's ``set_*``)."""
    if _setting(name).read != "first use":
        raise ValueError(f"{name} is read {READ_AT[_setting(name).read]}; it has no process-wide value to set")
    _kept[name] = value


def agreed() -> dict[str, Any]:
    """The values every rank must share (the ``agreed`` settings), for the mesh's check."""
    return {name: get(name) for name, s in SETTINGS.items() if s.agreed}


def unknown(environ: Mapping[str, str]) -> dict[str, str | None]:
    """The ``DTORCH_*`` names in ``environ`` nobody reads, each with the closest known name."""
    known = [*SETTINGS, *TOOLING]
    tails = {name[len(PREFIX):]: name for name in known}  # compared without the common prefix

    def closest(name: str) -> str | None:
        match = difflib.get_close_matches(name[len(PREFIX):], list(tails), n=1, cutoff=0.6)
        return tails[match[0]] if match else None

    return {name: closest(name) for name in sorted(environ) if name.startswith(PREFIX) and name not in known}


def warn_unknown(environ: Mapping[str, str] = os.environ) -> None:
    """One warning naming every unknown ``DTORCH_*`` variable (called once, at import)."""
    found = unknown(environ)
    if found:
        names = "; ".join(f"{n}" + (f" (did you mean {close}?)" if close else "") for n, close in found.items())
        warnings.warn(f"unknown dtorch_mpi environment variable(s), ignored: {names}. Settings: docs/settings.md",
                      RuntimeWarning, stacklevel=2)


warn_unknown()
