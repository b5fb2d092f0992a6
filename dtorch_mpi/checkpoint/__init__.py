"""Checkpoints: parallel HDF5, resharding on load, atomic saves."""

from .hdf5 import has_parallel_hdf5, load, save

__all__ = ["has_parallel_hdf5", "load", "save"]
