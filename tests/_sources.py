"""The notebooks' bilingual sources (`notebooks/src/*.nb.md`) as the build tool reads them, for the tests that take
cells from them: one parser, `tools/build_notebooks.py`'s, never a second one here."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "tools") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "tools"))

import build_notebooks  # noqa: E402


def code_cells(name: str) -> list[str]:
    """The code cells of notebook `name`'s source, in order."""
    cells = build_notebooks.parse_source(os.path.join(ROOT, "notebooks", "src", name + ".nb.md"))
    return [c["source"] for c in cells if c["kind"] == "code"]
