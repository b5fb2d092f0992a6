"""GPU path. The pure parts (backend selection, NCCL dtype mapping, unique-id forms, the
padding plan) and the host-staging backend (with a NumPy stand-in for the device) run
everywhere; the CuPy tests run one body over every available array backend and skip cleanly
without a GPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import ARRAY_BACKENDS, RANK, SIZE, Checker, on_mesh, to_numpy

import dtorch_mpi as dt
from dtorch_mpi.comm import Group, gpu
from dtorch_mpi.comm.prologue import Prologued


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
