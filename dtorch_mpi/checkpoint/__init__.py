"""Checkpoints: parallel HDF5, resharding on load, atomic saves (blocking or asynchronous)."""

from .hdf5 import SaveHandle, has_parallel_hdf5, load, save

__all__ = ["SaveHandle", "has_parallel_hdf5", "load", "save"]
