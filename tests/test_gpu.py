"""GPU path. The pure parts (backend selection, NCCL dtype mapping, unique-id forms, the
padding plan) and the host-staging backend (with a NumPy stand-in for the device) run
everywhere; the CuPy tests run one body over every available array backend and skip cleanly
without a GPU. With ``--device emulated`` they run on the emulated device (tests/emulated_cupy:
a test double of CuPy and NCCL over MPI, docs/emulated_device.md), once per
``DTORCH_GPU_BACKEND``; ``--device cuda`` on a real GPU (scripts/gpu_check.sh)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import ARRAY_BACKENDS, HAVE_GPU, RANK, SIZE, Checker, on_mesh, to_numpy

import dtorch_mpi as dt
from dtorch_mpi.comm import Group, gpu
from dtorch_mpi.comm.prologue import Prologued

try:
    import cupy  # the real CuPy, or the emulated device's (conftest put it first on sys.path)
except ImportError:
    cupy = None

pytestmark = pytest.mark.device  # every test here runs in a --device pass too


def test_backend_selection() -> None:
    assert gpu.choose_backend("auto", True, 1, 1, False) == "nccl"
    assert gpu.choose_backend("auto", True, 2, 1, False) == "host-staging"  # NCCL: one GPU per rank
    assert gpu.choose_backend("auto", True, 2, 1, True) == "cuda-aware-mpi"
    assert gpu.choose_backend("auto", False, 1, 4, False) == "host-staging"
    assert gpu.choose_backend("host-staging", True, 1, 8, True) == "host-staging"
    with pytest.raises(RuntimeError, match="one GPU per rank"):
        gpu.choose_backend("nccl", True, 2, 1, False)
    with pytest.raises(RuntimeError, match="not available"):
        gpu.choose_backend("nccl", False, 1, 1, False)
    with pytest.raises(ValueError, match="is not one of"):
        gpu.choose_backend("gloo", True, 1, 1, False)


def test_nccl_dtype_mapping() -> None:
    assert gpu.nccl_wire(np.float32, True) == (np.dtype(np.float32), 1)
    assert gpu.nccl_wire(np.bool_, True) == (np.dtype(np.uint8), 1)
    assert gpu.nccl_wire(np.complex64, True) == (np.dtype(np.float32), 2)
    assert gpu.nccl_wire(np.complex128, False) == (np.dtype(np.float64), 2)
    assert gpu.nccl_wire(np.int16, True) == (np.dtype(np.int32), 1)
    assert gpu.nccl_wire(np.int16, False) == (np.dtype(np.uint8), 2)


def test_unique_id_both_forms() -> None:
    raw = bytes(range(128))
    as_tuple = tuple(b - 256 if b > 127 else b for b in raw)
    assert gpu.uid_to_bytes(as_tuple) == raw and gpu.uid_to_bytes(raw) == raw
    assert gpu.uid_from_bytes(raw, as_tuple) == as_tuple
    assert gpu.uid_from_bytes(raw, b"x") == raw


def test_padding_plan() -> None:
    block, plan = gpu.padded_plan([3, 3, 2], 4)
    assert block == 12 and plan == [(12, 0, 0), (12, 12, 12), (8, 24, 24)]
    assert gpu.padded_plan([0, 0], 5) == (0, [(0, 0, 0), (0, 0, 0)])


class CountingAdapter(gpu.DeviceAdapter):
    """A NumPy stand-in for the device: staging copies, counted."""

    def __init__(self) -> None:
        self.copies = 0
        super().__init__(self._to_host, self._to_device)

    def _to_host(self, a: np.ndarray) -> np.ndarray:
        self.copies += 1
        return np.array(a, copy=True)

    def _to_device(self, h: np.ndarray, like: Any) -> np.ndarray:
        self.copies += 1
        return np.array(h, copy=True)


def test_host_staging_backend_with_a_stand_in_device(mesh1d: dt.DeviceMesh, check: Checker) -> None:
    adapter = CountingAdapter()
    backend = Prologued(gpu.HostStagingBackend(adapter))
    group = Group(mesh1d.get_group(0), 0)
    n = 2 * SIZE + 1
    full = np.arange(n * 3, dtype=np.float64).reshape(n, 3)
    sizes = dt.split.split_sizes(n, SIZE)
    off = sum(sizes[:RANK])
    piece = full[off : off + sizes[RANK]].copy()
    out = np.empty_like(full)
    check.equal(backend.all_gather(group, piece, out, 0, sizes).wait(), full, "all_gather")
    red = np.empty_like(full)
    check.equal(backend.all_reduce(group, full, red, "sum").wait(), full * SIZE, "all_reduce")
    mine = np.empty((sizes[RANK], 3))
    check.equal(backend.reduce_scatter(group, full, mine, 0, sizes, "max").wait(), piece, "reduce_scatter")
    handle = backend.all_gather(group, piece, np.empty_like(full), 0, sizes, async_op=True)
    check.equal(handle.wait(), full, "async all_gather")
    check.true(handle.done(), "done after wait")
    check.true(adapter.copies >= 8 if SIZE > 1 else adapter.copies == 0,  # one rank: the prologue moves nothing
               "staging copied through the host")
    check.done()


@pytest.mark.skipif(SIZE == 1, reason="a divergence needs two ranks")
def test_every_backend_gets_the_debug_check(mesh1d: dt.DeviceMesh) -> None:
    """The prologue is the registry's, not the MPI backend's: a GPU-type backend (host
    staging, with the stand-in device) names a divergent call too, with its own call name."""
    from dtorch_mpi.comm import config

    backend = Prologued(gpu.HostStagingBackend(CountingAdapter()))
    group = Group(mesh1d.get_group(0), 0)
    sizes = [2] * SIZE if RANK == 0 else [3, 1] + [2] * (SIZE - 2)
    config.set_spmd_debug(True)
    try:
        with pytest.raises(dt.SPMDDivergenceError, match="different collective calls") as err:
            backend.all_gather(group, np.zeros((sizes[RANK], 3)), np.empty((2 * SIZE, 3)), 0, sizes)
    finally:
        config.set_spmd_debug(False)
    assert "host-staging=" in str(err.value), str(err.value)


def test_nccl_names_its_calls() -> None:
    """What the debug check and CommCounter see of NCCL (pure: no GPU needed)."""
    nccl = gpu.NCCLBackend()
    assert nccl.call_for("reduce_scatter", None, None, {"sizes": (2, 2)}) == ("reduceScatter", False)
    assert nccl.call_for("reduce_scatter", None, None, {"sizes": (3, 2)}) == ("reduceScatter", True)
    assert nccl.call_for("all_to_all", None, None, {"split_sizes": (3, 2)}) == ("send/recv", False)
    assert nccl.call_for("all_gather", None, None, {"sizes": (1, 0)}) == ("allGather", True)


@pytest.fixture(params=ARRAY_BACKENDS)  # GPU detection agreed across ranks (conftest)
def any_mesh(request: pytest.FixtureRequest) -> Iterator[dt.DeviceMesh]:
    mesh = dt.init_device_mesh(request.param, (SIZE,))
    yield mesh
    mesh.free()


def test_one_body_every_array_backend(any_mesh: dt.DeviceMesh, check: Checker) -> None:
    """Factories, RNG, redistribute, operators and state_dict: same results on NumPy and CuPy."""
    n = 2 * SIZE + 1
    full = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    x = dt.distribute_tensor(on_mesh(any_mesh, full), any_mesh, [dt.Shard(0)])
    for dst in ([dt.Shard(1)], [dt.Replicate()], [dt.Partial()]):
        check.equal(to_numpy(x.redistribute(placements=dst).to_torch()), full, f"{any_mesh.device_type} {dst}")
    y = (x * 2 + 1).sum(0)
    check.equal(to_numpy(y.to_torch()), (full * 2 + 1).sum(0), "ops", exact=False)
    dt.manual_seed(3)
    r = dt.randn(n, 5, device_mesh=any_mesh, placements=[dt.Shard(1)])
    dt.manual_seed(3)
    ref_mesh = dt.init_device_mesh("cpu", (SIZE,))
    ref = dt.randn(n, 5, device_mesh=ref_mesh, placements=[dt.Replicate()]).to_torch()
    ref_mesh.free()
    check.equal(to_numpy(r.to_torch()), ref, "RNG identical to NumPy's", exact=False, rtol=1e-6)
    lin = dt.nn.Linear(4, n, device_mesh=any_mesh)
    dt.parallelize_module(lin, any_mesh, dt.ColwiseParallel())
    w = np.ones((n, 4), np.float32)
    lin.load_state_dict({"weight": w, "bias": np.zeros(n, np.float32)})
    check.equal(to_numpy(lin.weight.to_torch()), w, "state_dict")
    check.done()


def test_backend_facts_are_agreed_across_ranks() -> None:
    """Issue 18 audit: a node without NCCL or with fewer GPUs must not let its ranks pick
    another backend than the rest (one rank in NCCL while another calls MPI hangs)."""
    from mpi4py import MPI

    facts = gpu.agreed_facts(MPI.COMM_WORLD, "auto", RANK != SIZE - 1, 1 + RANK % 2, 1, RANK == 0)
    everyone = MPI.COMM_WORLD.allgather(facts)
    assert all(f == everyone[0] for f in everyone)
    assert facts == (False, 1 + min(SIZE - 1, 1), 1, SIZE == 1)
    names = MPI.COMM_WORLD.allgather(gpu.choose_backend("auto", *facts))
    assert len(set(names)) == 1
    if SIZE > 1:
        with pytest.raises(ValueError, match="differs between ranks"):
            gpu.agreed_facts(MPI.COMM_WORLD, "nccl" if RANK else "auto", True, 1, 1, False)


# --- the device's own backends (a real GPU, or the emulated device: tests/emulated_cupy) -------
EMULATED = HAVE_GPU and getattr(cupy, "EMULATED", False)
needs_device = pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy with a device (a GPU or --device emulated)")
needs_peers = pytest.mark.skipif(SIZE == 1, reason="NCCL's collectives need two ranks")


@needs_device
def test_the_requested_backend_is_the_one_running(any_mesh: dt.DeviceMesh) -> None:
    """A per-backend run (DTORCH_GPU_BACKEND=...) really runs that backend on cuda meshes."""
    import os

    from dtorch_mpi.comm import backend_for

    want = os.environ.get("DTORCH_GPU_BACKEND", "auto")
    got = backend_for(any_mesh.device_type).inner.name
    assert got == ("mpi" if any_mesh.device_type == "cpu" else want) or want == "auto", got


def nccl_group() -> tuple[Any, gpu.NCCLBackend, Group]:
    """A fresh communicator over the world and the NCCL backend object itself (no prologue, so
    every call reaches NCCL; a rank's own device first, as NCCL needs)."""
    from mpi4py import MPI

    if cupy.cuda.runtime.getDeviceCount() < SIZE:
        pytest.skip("NCCL needs one device per rank")
    cupy.cuda.Device(RANK).use()
    comm = MPI.COMM_WORLD.Dup()
    backend, group = gpu.NCCLBackend(), Group(comm, 0)
    backend._nccl(group)  # the NCCL communicator, made by every rank together
    return comm, backend, group


@needs_device
@needs_peers
@pytest.mark.parametrize("op", ["max", "min"])
def test_nccl_max_min_keep_nan_as_numpy(op: str, check: Checker) -> None:
    """NCCL's max/min may drop NaN (the emulated NCCL does): the backend's NaN pass restores
    NumPy's result, for all_reduce and reduce_scatter, uneven blocks included."""
    comm, nccl, group = nccl_group()
    n = 2 * SIZE + 1
    pieces = [np.arange(n * 2, dtype=np.float32).reshape(n, 2) * (r + 1) for r in range(SIZE)]
    for r, p in enumerate(pieces):
        p[r % n, r % 2] = np.nan
    want = getattr(np, op)(np.stack(pieces), axis=0)
    out = cupy.empty((n, 2), np.float32)
    check.equal(nccl.all_reduce(group, cupy.asarray(pieces[RANK]), out, op).wait(), want, f"all_reduce {op}")
    sizes = dt.split.split_sizes(n, SIZE)
    off = sum(sizes[:RANK])
    mine = cupy.empty((sizes[RANK], 2), np.float32)
    check.equal(nccl.reduce_scatter(group, cupy.asarray(pieces[RANK]), mine, 0, sizes, op).wait(),
                want[off : off + sizes[RANK]], f"reduce_scatter {op}")
    comm.Free()
    check.done()


@needs_device
@needs_peers
def test_nccl_broadcast_fills_a_strided_buffer(check: Checker) -> None:
    """NCCL fills memory in order: a non-contiguous buffer is broadcast through a contiguous
    copy and filled in place on completion."""
    comm, nccl, group = nccl_group()
    full = np.arange(5 * 4, dtype=np.float64).reshape(5, 4)
    wide = cupy.asarray(np.repeat(full, 2, axis=1) if RANK == 0 else np.zeros((5, 8)))
    nccl.broadcast(group, wide[:, ::2], 0).wait()
    check.equal(wide[:, ::2], full, "strided broadcast")
    comm.Free()
    check.done()


@needs_device
@needs_peers
def test_nccl_is_nonblocking_and_bounded_by_the_deadline() -> None:
    """async_op=True returns before the peers have joined (done() is False until they do); a
    collective one rank never joins raises CollectiveTimeoutError within the deadline on the
    rank waiting, and aborts the NCCL communicator (ncclCommAbort)."""
    import time

    from mpi4py import MPI

    from dtorch_mpi.comm import deadline

    comm, nccl, group = nccl_group()
    x = cupy.asarray(np.full(5, RANK + 1.0))
    out = cupy.empty(5)
    pending = False
    if RANK == 0:
        handle = nccl.all_reduce(group, x, out, "sum", async_op=True)
        pending = handle.done()  # the other ranks make the call only after the barrier
    MPI.COMM_WORLD.Barrier()
    if RANK != 0:
        handle = nccl.all_reduce(group, x, out, "sum", async_op=True)
    got = handle.wait()
    assert not pending, "an NCCL collective reported done before every rank made it"
    assert np.array_equal(cupy.asnumpy(got), np.full(5, SIZE * (SIZE + 1) / 2))
    before = deadline.collective_timeout()
    deadline.set_collective_timeout(0.5)
    try:
        if RANK == 0:  # the others never make this call
            start = time.monotonic()
            with pytest.raises(dt.CollectiveTimeoutError, match="NCCL allReduce"):
                nccl.all_reduce(group, x, out, "sum").wait()
            assert time.monotonic() - start < 10, "the timeout was not bounded"
            if EMULATED:
                assert nccl._nccl(group).aborted, "the timed-out NCCL communicator was not aborted"
    finally:
        deadline.set_collective_timeout(before)
        MPI.COMM_WORLD.Barrier()
        comm.Free()


@pytest.mark.skipif(not EMULATED, reason="checks the emulated device itself (the test double)")
@needs_peers
def test_emulated_nccl_refuses_what_nccl_would() -> None:
    """The test double fails loudly where NCCL would refuse or corrupt: counts that differ across
    ranks (on every rank), an unknown pointer, a count past the buffer, a type NCCL lacks, two
    ranks on one device."""
    from cupy.cuda import nccl as emulated

    comm, _, group = nccl_group()
    raw = gpu.NCCLBackend()._nccl(group)
    stream = cupy.cuda.get_current_stream()
    a = cupy.zeros(4 + RANK, np.float32)
    raw.allReduce(a.data.ptr, a.data.ptr, a.size, emulated.NCCL_FLOAT32, emulated.NCCL_SUM, stream.ptr)
    with pytest.raises(emulated.NcclError, match="different calls"):
        stream.synchronize()
    host = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="not a device pointer"):
        raw.allReduce(host.ctypes.data, host.ctypes.data, 4, emulated.NCCL_FLOAT32, emulated.NCCL_SUM, stream.ptr)
    with pytest.raises(ValueError, match="past its allocation"):
        raw.allReduce(a.data.ptr, a.data.ptr, 64, emulated.NCCL_FLOAT32, emulated.NCCL_SUM, stream.ptr)
    with pytest.raises(emulated.NcclError, match="not an NCCL type"):
        raw.allReduce(a.data.ptr, a.data.ptr, 1, 42, emulated.NCCL_SUM, stream.ptr)
    cupy.cuda.Device(0).use()  # every rank on device 0
    uid = comm.bcast(emulated.get_unique_id() if RANK == 0 else None, root=0)
    with pytest.raises(emulated.NcclError, match="same device"):
        emulated.NcclCommunicator(SIZE, uid, RANK)
    cupy.cuda.Device(RANK).use()
    comm.Free()


def test_cuda_aware_flag_overrides_the_query(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTORCH_CUDA_AWARE_MPI", "1")
    assert gpu.mpi_is_cuda_aware()
    monkeypatch.setenv("DTORCH_CUDA_AWARE_MPI", "0")
    assert not gpu.mpi_is_cuda_aware()


@needs_device
def test_device_backend_broadcast_and_average(check: Checker) -> None:
    """The selected cuda backend's broadcast and its averaging reductions (floats divide, integers floor as NumPy's ``//``), uneven blocks."""
    from mpi4py import MPI

    from dtorch_mpi.comm import backend_for

    mesh = dt.init_device_mesh("cuda", (SIZE,))
    backend, group = backend_for("cuda"), Group(mesh.get_group(0), 0)
    n = 2 * SIZE + 1
    full = np.arange(n * 4, dtype=np.float64).reshape(n, 4)
    for root in sorted({0, SIZE - 1}):
        buf = cupy.asarray(full if root == RANK else np.zeros_like(full))
        check.equal(backend.broadcast(group, buf, root).wait(), full, f"broadcast from {root}")
    sizes = dt.split.split_sizes(n, SIZE)
    off = sum(sizes[:RANK])
    for dtype in (np.float32, np.int64):
        mine = (full * (RANK + 1)).astype(dtype)
        every = np.stack([(full * (r + 1)).astype(dtype) for r in range(SIZE)])
        want = every.sum(0) / SIZE if dtype == np.float32 else every.sum(0) // SIZE
        got = backend.all_reduce(group, cupy.asarray(mine), cupy.empty((n, 4), dtype), "avg").wait()
        check.equal(got, want.astype(dtype), f"all_reduce avg {np.dtype(dtype)}", exact=False)
        buf = cupy.asarray(mine)  # in place (send is out: replicate's packed buckets)
        got = backend.all_reduce(group, buf, buf, "sum").wait()
        check.true(got is buf, f"all_reduce in place returns its buffer {np.dtype(dtype)}")
        check.equal(buf, every.sum(0).astype(dtype), f"all_reduce in place {np.dtype(dtype)}")
        part = cupy.empty((sizes[RANK], 4), dtype)
        got = backend.reduce_scatter(group, cupy.asarray(mine), part, 0, sizes, "avg").wait()
        check.equal(got, want[off : off + sizes[RANK]].astype(dtype), f"reduce_scatter avg {np.dtype(dtype)}",
                    exact=False)
    rep = dt.distribute_tensor(cupy.asarray(full), mesh, [dt.Replicate()])  # a broadcast from rank 0
    check.equal(rep.to_local(), full, "distribute_tensor Replicate")
    MPI.COMM_WORLD.Barrier()
    mesh.free()
    check.done()


@needs_device
@pytest.mark.parametrize("task", ["regression", "classification"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("plan", ["dp", "tp"])
def test_training_and_checkpoint_on_the_device(plan: str, optimizer: str, task: str, shared_dir: str) -> None:
    """examples/train_mlp.py's model, plans and optimizers on a cuda mesh (autograd, the losses,
    reduce_gradients, the optimizers' device arrays) equal its NumPy reference to 1e-9; the
    state saved from the device loads onto a cpu mesh and back onto the device unchanged."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import train_mlp as T

    from dtorch_mpi.nn import functional as F

    def host(t: dt.DTensor) -> np.ndarray:
        return to_numpy(t.to_torch())

    mesh = dt.init_device_mesh("cuda", (SIZE,))
    dt.manual_seed(0)
    model = T.MLP(T.OUT[task], mesh)
    initial = {k: host(p) for k, p in model.named_parameters()}
    T.apply_plan(model, plan)
    params = list(model.named_parameters())
    cls, kwargs = T.OPTIMIZERS[optimizer]
    opt = cls(params, **kwargs)
    x_full, y_full = T.dataset(task)
    x = dt.distribute_tensor(cupy.asarray(x_full), mesh, T.PLANS[plan]["batch"])
    losses = []
    for _ in range(3):
        opt.zero_grad()
        out = model(x)
        if task == "regression":
            loss = F.mse_loss(out, dt.distribute_tensor(cupy.asarray(y_full), mesh, out.placements))
        else:
            loss = F.cross_entropy(out, cupy.asarray(y_full))
        loss.backward()
        dt.nn.utils.reduce_gradients([p for _, p in params])
        opt.step()
        losses.append(float(loss.to_torch()))
    want_losses, want_final = T.reference(initial, optimizer, task, steps=3)
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-9)
    final = {k: host(p) for k, p in params}
    for name, value in want_final.items():
        np.testing.assert_allclose(final[name], value, rtol=0, atol=1e-9, err_msg=name)
    path = os.path.join(shared_dir, "device.h5")
    dt.save(model.state_dict(), path)
    cpu_mesh = dt.init_device_mesh("cpu", (SIZE,))
    for target_mesh in (cpu_mesh, mesh):
        again = T.MLP(T.OUT[task], target_mesh)
        dt.load(path, again)
        for name, p in again.named_parameters():
            assert np.array_equal(host(p), final[name]), f"{name} reloaded on {target_mesh.device_type}"
    cpu_mesh.free()
    mesh.free()
