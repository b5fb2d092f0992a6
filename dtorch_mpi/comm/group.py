"""A mesh dim's communicator with its label, as the backends see it."""

from __future__ import annotations

from dataclasses import dataclass, field

from mpi4py import MPI


@dataclass(frozen=True)
class Group:
    """``size`` and ``rank`` are read from the communicator once, at construction: the
    backends ask for them on every call."""

    comm: MPI.Intracomm
    mesh_dim: int | None
    size: int = field(init=False, compare=False)
    rank: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", self.comm.Get_size())
        object.__setattr__(self, "rank", self.comm.Get_rank())
