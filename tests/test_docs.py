"""Generated documentation stays in step with the code."""

from __future__ import annotations

import os
import sys

import pytest
from mpi4py import MPI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="checked once, in the 1-process pass")
def test_signature_doc_is_current() -> None:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from gen_signatures import render
    finally:
        sys.path.pop(0)
    with open(os.path.join(ROOT, "docs", "signatures.md")) as fh:
        assert fh.read() == render(), "docs/signatures.md is stale: run scripts/gen_signatures.py"
