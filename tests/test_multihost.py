"""Facts that only several hosts can show: the multi-host tier (scripts/test_multihost.sh) runs
this file across fake hosts (network namespaces, ../shared/tools/fakehosts) with
``DTORCH_TEST_MULTIHOST=1``; elsewhere it is skipped. ``DTORCH_TEST_PRIVATE_TMP=1`` says that
each host has its own ``/tmp`` (as on clusters)."""

from __future__ import annotations

import os
import socket
import tempfile
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import dtorch_mpi as dt
from dtorch_mpi._mpi import node_facts
from dtorch_mpi.comm.deadline import allgather_bytes

pytestmark = pytest.mark.skipif(os.environ.get("DTORCH_TEST_MULTIHOST") != "1",
                                reason="runs in the multi-host tier (scripts/test_multihost.sh)")

WORLD = MPI.COMM_WORLD


def hostnames() -> list[str]:
    return [h.decode() for h in allgather_bytes(WORLD, socket.gethostname().encode())]


def test_the_job_spans_several_hosts() -> None:
    assert len(set(hostnames())) >= 2, f"the multi-host tier ran on one host: {hostnames()}"


def test_node_local_rank_is_the_index_among_the_ranks_of_each_host() -> None:
    """The GPU a "cuda" mesh takes is ``node_local_rank % visible GPUs`` (mesh._prepare_cuda):
    the node-local rank must count the ranks of this host only, in world-rank order."""
    hosts = hostnames()
    mine = hosts[WORLD.Get_rank()]
    on_my_host = [r for r, h in enumerate(hosts) if h == mine]
    local, count = node_facts()
    assert (local, count) == (on_my_host.index(WORLD.Get_rank()), len(on_my_host))


def test_a_mesh_whose_inner_dim_crosses_hosts_warns() -> None:
    """Block placement keeps the inner (tp) dim of a (size/2, 2) mesh on one host; round robin
    puts it across hosts, and the mesh says so (on the tp group's first rank)."""
    size = WORLD.Get_size()
    if size % 2:
        pytest.skip("needs an even number of ranks")
    hosts = hostnames()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = dt.init_device_mesh("cpu", (size // 2, 2), mesh_dim_names=("dp", "tp"))
    partner = WORLD.Get_rank() ^ 1
    crosses = hosts[WORLD.Get_rank()] != hosts[partner]
    per_host = min(hosts.count(h) for h in set(hosts))
    expect = crosses and per_host >= 2 and mesh.get_local_rank("tp") == 0
    said = [w for w in caught if "spans several hosts" in str(w.message)]
    assert len(said) == int(expect), (hosts, [str(w.message) for w in caught])
    if said:
        assert "block placement" in str(said[0].message) and "'tp'" in str(said[0].message)
    mesh.free()


def test_a_checkpoint_on_a_shared_directory_round_trips(shared_dir: str) -> None:
    mesh = dt.init_device_mesh("cpu", (WORLD.Get_size(),))
    x = dt.distribute_tensor(np.arange(7 * 3, dtype=np.float64).reshape(7, 3), mesh, [dt.Shard(0)])
    path = os.path.join(shared_dir, "ckpt.h5")
    dt.save({"x": x}, path)
    y = dt.zeros(7, 3, dtype=np.float64, device_mesh=mesh, placements=[dt.Replicate()])
    dt.load(path, {"x": y})
    np.testing.assert_array_equal(y.to_local(), np.arange(7 * 3, dtype=np.float64).reshape(7, 3))


@pytest.mark.skipif(os.environ.get("DTORCH_TEST_PRIVATE_TMP") != "1", reason="hosts share /tmp")
def test_a_node_local_path_fails_clearly_on_every_rank() -> None:
    """Rank 0's temporary directory is on rank 0's host only: the save raises on every rank,
    naming the ranks that cannot see the directory, and leaves nothing behind."""
    mesh = dt.init_device_mesh("cpu", (WORLD.Get_size(),))
    local_dir = tempfile.mkdtemp(prefix="dtorch-node-local-", dir="/tmp") if WORLD.Get_rank() == 0 else ""
    local_dir = allgather_bytes(WORLD, local_dir.encode())[0].decode()
    x = dt.ones(4, device_mesh=mesh, placements=[dt.Shard(0)])
    with pytest.raises(dt.CheckpointError) as info:
        dt.save({"x": x}, os.path.join(local_dir, "ckpt.h5"))
    hosts = hostnames()
    elsewhere = [r for r, h in enumerate(hosts) if h != hosts[0]]
    assert str(elsewhere[0]) in str(info.value), str(info.value)
    if WORLD.Get_rank() == 0:
        assert os.listdir(local_dir) == []
        os.rmdir(local_dir)


def test_the_divergence_check_takes_the_board_exactly_within_a_host() -> None:
    """A group whose ranks share a host compares fingerprints on its shared-memory board; a group
    across hosts with the all-reduce (comm/divergence.py)."""
    from dtorch_mpi.comm import divergence

    size = WORLD.Get_size()
    mesh = dt.init_device_mesh("cpu", (size // 2, 2) if size % 2 == 0 else (size, 1), mesh_dim_names=("dp", "tp"))
    hosts = hostnames()
    for comm in (mesh.get_comm(), mesh.get_group("dp"), mesh.get_group("tp")):
        twin = divergence.twin_of(comm)
        if comm.Get_size() == 1:
            assert twin is None
            continue
        members = [hosts[r] for r in allgather_ranks(comm)]
        assert twin is not None and (twin.board is not None) == (len(set(members)) == 1), members
    x = dt.distribute_tensor(np.ones((4 * size, 2048)), mesh, [dt.Shard(0), dt.Shard(1)])  # checked: 64 KiB+
    np.testing.assert_array_equal(x.redistribute(placements=[dt.Replicate(), dt.Replicate()]).to_local(),
                                  np.ones((4 * size, 2048)))
    mesh.free()


def allgather_ranks(comm: MPI.Intracomm) -> list[int]:
    """The world ranks of ``comm``'s members, in its rank order."""
    return [int(r) for r in comm.allgather(WORLD.Get_rank())]
