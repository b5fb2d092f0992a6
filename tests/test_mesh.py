"""DeviceMesh: coordinates, per-dim groups, sub-meshes, ranks outside the mesh, errors."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import RANK, SIZE
from mpi4py import MPI

import dtorch_mpi as dt


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
