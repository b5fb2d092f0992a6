"""HDF5 checkpoints: one plain file, parallel writes, resharding loads, atomic saves.

Layout: one dataset per tensor with its global shape and dtype; dotted names are groups
(``layer.weight`` -> ``/layer/weight``). File attributes ``format = "dtorch_mpi"``,
``version`` and ``layout`` (a digest of every name, ``pytype``, dtype and shape: validate.py);
dataset attributes ``dtype`` (the exact dtype string), ``checksum`` (checksum.py,
computed collectively from the written pieces), ``pieces`` (each written piece's region and
xxh3, pieces.py: a load whose regions those pieces tile verifies with it), ``placements`` and ``mesh_shape``
(information only: any target layout can load it). No pickle anywhere; plain h5py reads it.

Loads treat the file as untrusted (validate.py): links, external storage, virtual datasets,
filters and oversized chunks are refused before a byte is read, and every dataset is verified
against its checksum before anything is installed in the target (reader.py).

Writes: with an MPI-enabled h5py the file is opened with ``driver="mpio"`` and every rank
writes its own hyperslab in one collective call per tensor (ranks with nothing to write still
take part, with an empty selection: h5py would skip a zero-size write and hang the others). A
``Replicate`` tensor is written by one replica; a ``Partial`` tensor is first reduce-scattered
so that each rank writes a slice of the reduced value. Without MPI in h5py (the pip wheel),
rank 0 creates the file and each node's lowest rank writes its node's pieces, the nodes in
turn (one warning; checkpoint/funnel.py). Every
write is agreed: an I/O error on one rank makes every rank raise, never leaves one in a collective.

Atomic: the file is written under a temporary name in the same directory, flushed and fsynced;
only when every rank has succeeded does rank 0 rename it over ``path`` (and fsync the
directory). A failure on any rank aborts the save on all ranks and removes the temporary file:
the previous checkpoint stays intact.
"""

from __future__ import annotations

from .h5lib import has_parallel_hdf5
from .loader import load
from .writer import SaveHandle, save, wait_pending

__all__ = ["SaveHandle", "has_parallel_hdf5", "load", "save", "wait_pending"]
