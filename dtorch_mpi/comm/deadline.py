"""Waiting for a started request."""

from __future__ import annotations

from mpi4py import MPI


def wait_request(request: MPI.Request, what: str) -> None:
    """Wait until ``request`` completes; ``what`` names it in errors."""
    request.Wait()
