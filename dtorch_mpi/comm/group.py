"""A mesh dim's communicator with its label, as the backends see it."""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI


@dataclass(frozen=True)
class Group:
    comm: MPI.Intracomm
    mesh_dim: int | None

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()
