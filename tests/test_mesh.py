"""DeviceMesh: coordinates, per-dim groups, sub-meshes, ranks outside the mesh, errors."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import RANK, SIZE
from mpi4py import MPI

import dtorch_mpi as dt

# mesh construction, groups and the settings agreement: no collective of the backend
pytestmark = pytest.mark.path_independent


def test_1d_mesh_members(mesh1d: dt.DeviceMesh) -> None:
    assert mesh1d.shape == (SIZE,) and mesh1d.ndim == 1 and mesh1d.size() == SIZE
    assert mesh1d.get_coordinate() == (RANK,)
    assert mesh1d.get_local_rank(0) == RANK
    group = mesh1d.get_group(0)
    assert group.Get_size() == SIZE and group.Get_rank() == RANK
    assert group != MPI.COMM_WORLD  # the library never talks on the user's communicator


def test_2d_mesh_groups_and_names(mesh2d: dt.DeviceMesh) -> None:
    m0, m1 = mesh2d.shape
    c0, c1 = np.unravel_index(RANK, mesh2d.shape)
    assert mesh2d.get_coordinate() == (c0, c1)
    assert mesh2d.mesh_dim_names == ("dp", "tp")
    assert mesh2d.size("tp") == m1 and mesh2d.size() == m0 * m1
    assert mesh2d.get_local_rank("dp") == c0
    tp = mesh2d.get_group("tp")
    assert tp.Get_size() == m1 and tp.Get_rank() == c1
    members = tp.allgather(RANK)
    assert members == mesh2d.mesh[c0, :].tolist()
    dp = mesh2d.get_group(0)
    assert dp.allgather(RANK) == mesh2d.mesh[:, c1].tolist()
    sub = mesh2d["tp"]
    assert sub.shape == (m1,) and sub.mesh.tolist() == mesh2d.mesh[c0, :].tolist()
    assert sub.get_coordinate() == (c1,) and sub.mesh_dim_names == ("tp",)
    assert sub.get_group(0) is tp
    with pytest.raises(KeyError, match="no dim named 'pp'"):
        mesh2d["pp"]


def test_explicit_rank_list_and_permutation() -> None:
    ranks = list(reversed(range(SIZE)))
    with dt.DeviceMesh("cpu", ranks) as mesh:
        assert mesh.get_coordinate() == (SIZE - 1 - RANK,)
        assert mesh.get_group(0).Get_rank() == SIZE - 1 - RANK


@pytest.mark.mpi(min_size=2)
def test_rank_outside_the_mesh_holds_empty_pieces() -> None:
    with dt.DeviceMesh("cpu", [0]) as mesh:
        x = dt.ones(5, 3, device_mesh=mesh, placements=[dt.Shard(0)])
        if RANK == 0:
            assert mesh.get_coordinate() == (0,)
            assert x.to_local().shape == (5, 3)
            assert np.array_equal(x.to_torch(), np.ones((5, 3), np.float32))
        else:
            assert mesh.get_coordinate() is None and mesh.get_group(0) == MPI.COMM_NULL
            assert x.to_local().size == 0 and x.shape == (5, 3)
            assert x.to_torch() is None


def test_bad_meshes_raise_on_every_rank() -> None:
    with pytest.raises(ValueError, match="names a rank twice"):
        dt.DeviceMesh("cpu", [0, 0])
    with pytest.raises(ValueError, match=f"world size is {SIZE}"):
        dt.DeviceMesh("cpu", [SIZE])
    with pytest.raises(ValueError, match="use 'cpu' or 'cuda'"):
        dt.DeviceMesh("tpu", [0])
    with pytest.raises(ValueError, match="must name each"):
        dt.init_device_mesh("cpu", (SIZE,), mesh_dim_names=("a", "b"))


@pytest.mark.mpi(min_size=2)
def test_ranks_passing_different_meshes_all_raise() -> None:
    with pytest.raises(dt.MeshMismatchError, match="different meshes"):
        dt.DeviceMesh("cpu", [0] if RANK == 0 else [1])


def test_free_is_explicit_and_idempotent() -> None:
    mesh = dt.init_device_mesh("cpu", (SIZE,))
    mesh.free()
    mesh.free()
    with pytest.raises(dt.MeshMismatchError, match="has been freed"):
        mesh.get_group(0)


def test_meshes_compare_by_value(mesh1d: dt.DeviceMesh) -> None:
    with dt.init_device_mesh("cpu", (SIZE,)) as other:
        assert other == mesh1d and hash(other) == hash(mesh1d)
    assert "DeviceMesh('cpu'" in repr(mesh1d)


# --- lifetimes tied to the mesh (issue 14 §3) ---------------------------------------------------
def test_a_new_mesh_never_gets_a_freed_meshs_communicator_or_plan() -> None:
    """MPICH hands a new communicator the handle of a freed one; neither the compiled plans
    nor the per-communicator resources (NCCL communicators: the backend's own cache, with a
    stand-in for ``ncclCommInitRank`` so it runs on CPU) may follow the handle."""
    from dtorch_mpi.comm import Group
    from dtorch_mpi.comm.gpu import NCCLBackend
    from dtorch_mpi.redistribute import compile_plan

    made: list[tuple[str, int]] = []
    destroyed: list[tuple[str, int]] = []

    class StandIn:
        def __init__(self, name: str) -> None:
            self.id = (name, len(made))
            made.append(self.id)

        def destroy(self) -> None:
            destroyed.append(self.id)

    nccl = NCCLBackend()
    nccl._create = lambda group: StandIn("old")  # type: ignore[method-assign]
    old = dt.init_device_mesh("cpu", (SIZE,))
    x = dt.distribute_tensor(np.arange(7.0), old, [dt.Shard(0)])
    target = (dt.Replicate(),)
    old_plan = compile_plan(x.spec, target)
    np.testing.assert_array_equal(x.redistribute(placements=target).to_local(), np.arange(7.0))
    (x + x).sum()  # operator plans for the old mesh
    old_handle = MPI.Comm.py2f(old.get_group(0))
    old_nccl = nccl._nccl(Group(old.get_group(0), 0))
    assert nccl._nccl(Group(old.get_group(0), 0)) is old_nccl  # cached for the communicator's life
    assert old._plans.cache_info().currsize > 0 and old._op_plans.cache_info().currsize > 0
    other = dt.init_device_mesh("cpu", (SIZE,))  # a live mesh keeps its plans when another is freed
    z = dt.distribute_tensor(np.arange(7.0), other, [dt.Shard(0)])
    (z + z).redistribute(placements=target)
    kept = (other._plans.cache_info().currsize, other._op_plans.cache_info().currsize)

    old.free()
    assert destroyed == [old_nccl.id]  # released by free(), not by the garbage collector
    assert old._plans.cache_info().currsize == 0 and old._op_plans.cache_info().currsize == 0
    assert (other._plans.cache_info().currsize, other._op_plans.cache_info().currsize) == kept and min(kept) > 0
    other.free()

    new = dt.init_device_mesh("cpu", (SIZE,))
    assert new == old  # equal by value: same ranks, shape and names
    nccl._create = lambda group: StandIn("new")  # type: ignore[method-assign]
    new_nccl = nccl._nccl(Group(new.get_group(0), 0))
    assert new_nccl is not old_nccl and new_nccl.id[0] == "new", (
        f"handles old={old_handle} new={MPI.Comm.py2f(new.get_group(0))}")
    y = dt.distribute_tensor(np.arange(7.0), new, [dt.Shard(0)])
    new_plan = compile_plan(y.spec, target)
    assert new_plan is not old_plan
    assert all(s.group is None or s.group.comm is new.get_group(0) for s in new_plan.steps)
    np.testing.assert_array_equal(y.redistribute(placements=target).to_local(), np.arange(7.0))
    new.free()
    assert destroyed == [old_nccl.id, new_nccl.id]


def test_a_freed_mesh_raises_mesh_mismatch_on_every_use() -> None:
    """Redistribute (with a cached plan), to_torch, operators (with cached plans), factories,
    from_local (trusted and checked) and distribute_tensor on a freed mesh all raise
    MeshMismatchError saying it was freed, on every rank (free() is collective)."""
    mesh = dt.init_device_mesh("cpu", (SIZE,))
    sub = dt.init_device_mesh("cpu", (1, SIZE), mesh_dim_names=("a", "b"))
    tp = sub["b"]
    x = dt.distribute_tensor(np.arange(5.0), mesh, [dt.Shard(0)])
    p = dt.distribute_tensor(np.arange(5.0), mesh, [dt.Partial()])
    z = dt.distribute_tensor(np.arange(5.0), tp, [dt.Shard(0)])
    for t in (x, p, z):  # warm every cache
        t.redistribute(placements=[dt.Replicate()])
        t.redistribute(placements=list(t.placements))  # a memoised plan with no steps
        t.to_torch()
        (t * 2).sum()
    async_pending = x.redistribute(placements=[dt.Replicate()], async_op=True).to_local()
    assert async_pending is not None
    mesh.free()
    sub.free()
    piece = np.zeros(1)
    uses = {
        "redistribute": lambda: x.redistribute(placements=[dt.Replicate()]),
        "redistribute P->R": lambda: p.redistribute(placements=[dt.Replicate()]),
        "redistribute to the same placements": lambda: x.redistribute(placements=[dt.Shard(0)]),
        "redistribute on a sub-mesh": lambda: z.redistribute(placements=[dt.Replicate()]),
        "async redistribute": lambda: x.redistribute(placements=[dt.Replicate()], async_op=True).to_local(),
        "to_torch": lambda: x.to_torch(),
        "to_torch_async": lambda: x.to_torch_async().wait(),
        "operator": lambda: x * 2,
        "reduction": lambda: p.sum(),
        "sub-mesh operator": lambda: z + z,
        "zeros": lambda: dt.zeros(4, device_mesh=mesh, placements=[dt.Shard(0)]),
        "randn": lambda: dt.randn(4, device_mesh=tp, placements=[dt.Replicate()]),
        "from_local": lambda: dt.DTensor.from_local(piece, mesh, [dt.Shard(0)], shape=(SIZE,)),
        "from_local checked": lambda: dt.DTensor.from_local(piece, mesh, [dt.Shard(0)], run_check=True),
        "distribute_tensor": lambda: dt.distribute_tensor(np.arange(5.0), mesh, [dt.Shard(0)]),
    }
    for what, use in uses.items():
        with pytest.raises(dt.MeshMismatchError, match="has been freed"):
            use()
            pytest.fail(f"{what} on a freed mesh did not raise")


def test_ranks_with_different_settings_raise_at_mesh_construction() -> None:
    if SIZE < 2:
        pytest.skip("needs two ranks")
    before = dt.comm.config.comm_path()
    dt.set_comm_path("padded" if RANK == 0 else "variable")
    try:
        with pytest.raises(dt.SPMDDivergenceError, match="DTORCH_COMM_PATH"):
            dt.init_device_mesh("cpu", (SIZE,))
    finally:
        dt.set_comm_path(before)
