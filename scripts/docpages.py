"""Writing a generated page under docs/ (scripts/gen_signatures.py, gen_settings.py; run as
`python scripts/NAME.py`, so importable). tests/test_docs.py checks each page is current."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_page(page: str, text: str) -> int:
    """Write ``text`` as docs/``page`` and say so; 0, the generating script's exit status."""
    path = os.path.join(ROOT, "docs", page)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)
    print(f"wrote {path}")
    return 0
