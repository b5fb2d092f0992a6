"""Route selection: which MPI call realises a collective (pure, unit-tested).

MPI requires every rank of a group to make the same call with matching counts, and some MPIs
(Intel MPI, Open MPI 4.1) hang otherwise. So every choice here is a function of facts the whole
group shares (the comm path, the split/concat sizes of every rank, the dims other than the
moving ones) and never of this rank's own counts. The backends, ``record`` (CommCounter's
``padded`` flag) and SPMD debug mode all use the same decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from math import prod


class Route(Enum):
    """A collective's MPI-level realisation; the value starts with the MPI collective it makes
    (always started in its nonblocking ``I`` form, comm/deadline.py)."""

    NOTHING = "nothing moves"
    GATHER_EQUAL = "Allgather"
    GATHER_PADDED_COMPACT = "Allgather padded, compacted in place"
    GATHER_PADDED_STRIDED = "Allgather padded, strided"
    GATHER_V = "Allgatherv"
    GATHER_W = "Alltoallw"
    A2A_EQUAL = "Alltoall"
    A2A_PADDED = "Alltoall padded"
    A2A_V = "Alltoallv"

    @property
    def padded(self) -> bool:
        return "padded" in self.value


def gather_route(path: str, sizes: Sequence[int], outer: int, out_nbytes: int) -> Route:
    """All-gather of blocks ``sizes`` long along an axis with ``outer`` rows above it into an
    output of ``out_nbytes`` (the same on every rank). Unequal contiguous blocks take
    ``Allgatherv`` unless padded: started nonblocking and polled, as every library collective
    is, it is as fast as a padded ``Allgather`` at 1-64 MB on 2-4 ranks and 1.0-1.6x faster than
    the ``Alltoallw`` with the own block kept out (MPICH 5; MPICH's *blocking* ``Allgatherv`` is
    2-3.5x slower, the measurement an earlier size threshold here was based on)."""
    if out_nbytes == 0:
        return Route.NOTHING
    even = len(set(sizes)) == 1
    if even:
        return Route.GATHER_EQUAL if outer == 1 else Route.GATHER_W
    if path == "padded":
        return Route.GATHER_PADDED_COMPACT if outer == 1 else Route.GATHER_PADDED_STRIDED
    return Route.GATHER_V if outer == 1 else Route.GATHER_W


def all_to_all_route(
    path: str, send_shape: Sequence[int], split_axis: int, split_sizes: Sequence[int],
    concat_axis: int, concat_sizes: Sequence[int], itemsize: int, variable_from: int,
) -> Route:
    """All-to-all splitting ``split_axis`` by ``split_sizes`` and concatenating received blocks
    along ``concat_axis`` by ``concat_sizes``. Blocks are all equal exactly when both size
    lists are uniform, a fact of the whole group (a rank whose own counts happen to be equal,
    e.g. all zero, must not pick ``Alltoall`` while the others call ``Alltoallv``). From
    ``variable_from`` bytes of the whole tensor (a shared fact too) ``Alltoallv`` is taken even
    for equal blocks, so the own block can stay out of the call."""
    total = all_to_all_bytes(send_shape, split_axis, split_sizes, concat_axis, concat_sizes, itemsize)
    if total == 0:
        return Route.NOTHING
    if path == "padded":
        return Route.A2A_PADDED
    if len(set(split_sizes)) == 1 and len(set(concat_sizes)) == 1 and total < variable_from:
        return Route.A2A_EQUAL  # MPICH's Alltoall is 1.3-2x faster than its Alltoallv on small blocks
    return Route.A2A_V


def all_to_all_bytes(send_shape: Sequence[int], split_axis: int, split_sizes: Sequence[int], concat_axis: int,
                     concat_sizes: Sequence[int], itemsize: int) -> int:
    """The bytes of the whole tensor an all-to-all moves (every rank's piece), a group-wide fact."""
    others = prod(n for i, n in enumerate(send_shape) if i not in (split_axis, concat_axis))
    return others * sum(split_sizes) * sum(concat_sizes) * itemsize
