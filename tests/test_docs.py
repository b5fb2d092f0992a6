"""Generated documentation stays in step with the code."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
from conftest import RUN_ONCE

pytestmark = RUN_ONCE  # reads files and imports modules: no communication

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("page, script", [("signatures.md", "gen_signatures"), ("settings.md", "gen_settings")])
def test_generated_doc_is_current(page: str, script: str) -> None:
    """A generated page equals what its script renders now (the rule tables, the settings)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        render = importlib.import_module(script).render
    finally:
        sys.path.pop(0)
    with open(os.path.join(ROOT, "docs", page)) as fh:
        assert fh.read() == render(), f"docs/{page} is stale: run scripts/{script}.py"


def test_api_page_names_real_public_modules() -> None:
    """docs/api.md's module tables: each module imports and exports exactly what its
    ``__all__`` names (so the page's boundary is the one the code has)."""
    import re

    with open(os.path.join(ROOT, "docs", "api.md")) as fh:
        modules = re.findall(r"^\| `(dtorch_mpi[\w.]*)` \|", fh.read(), flags=re.M)
    assert "dtorch_mpi" in modules and "dtorch_mpi.comm" in modules, modules
    for name in modules:
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert exported, f"{name} is listed as API in docs/api.md but has no __all__"
        missing = [n for n in exported if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ names what it lacks: {missing}"

