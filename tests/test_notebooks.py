"""Notebooks are code: parity between languages, no volatile outputs committed, exercises not stale, sources in sync,
and every `areal_lite` name a notebook uses exists and accepts the keywords passed to it.

(The notebooks themselves are executed by nbval: `make test` runs `pytest notebooks/en --nbval-lax`; the Chinese
notebooks share every code cell with the English ones, checked here, and `make test-zh` executes them.)
"""

from __future__ import annotations

import ast
import glob
import importlib
import inspect
import os
import subprocess
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EN = sorted(glob.glob(os.path.join(ROOT, "notebooks", "en", "*.ipynb")))
ZH = sorted(glob.glob(os.path.join(ROOT, "notebooks", "zh", "*.ipynb")))
ALL = EN + ZH
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
EXPECTED = ["01_setup", "02_rewards_and_tools", "03_gsm8k_reflection", "04_search_agent",
            "05_multiturn_feedback", "06_async_vs_sync", "07_to_areal"]


def code_cells(path):
    nb = nbformat.read(path, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_every_notebook_exists_in_both_languages():
    names_en = [os.path.basename(p)[:-6] for p in EN]
    names_zh = [os.path.basename(p)[:-6] for p in ZH]
    assert names_en == EXPECTED
    assert names_zh == EXPECTED


@pytest.mark.parametrize("en", EN, ids=os.path.basename)
def test_en_zh_parity(en):
    zh = en.replace(os.sep + "en" + os.sep, os.sep + "zh" + os.sep)
    assert code_cells(en) == code_cells(zh), "en and zh notebooks must have the same code cells in the same order"
    md_en = [c for c in nbformat.read(en, as_version=4).cells if c.cell_type == "markdown"]
    md_zh = [c for c in nbformat.read(zh, as_version=4).cells if c.cell_type == "markdown"]
    assert len(md_en) == len(md_zh)
    assert any(any("\u4e00" <= ch <= "\u9fff" for ch in c.source) for c in md_zh), "zh notebook has no Chinese"


@pytest.mark.parametrize("path", ALL, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_volatile_outputs_committed(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if not cell.source.startswith(CHECK_MARK):
            assert cell.execution_count is None, f"cell {i}: execution count committed"
            assert cell.outputs == [], f"cell {i}: output of an unchecked (volatile) cell committed"
        else:
            assert cell.outputs, f"cell {i}: checked cell has no stored output to compare against"
            for out in cell.outputs:
                assert out.output_type in ("stream", "execute_result"), f"cell {i}: {out.output_type} committed"


def test_notebooks_match_their_sources():
    """The committed notebooks are exactly what tools/build_notebooks.py writes from notebooks/src."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import build_notebooks

    for src in sorted(glob.glob(os.path.join(ROOT, "notebooks", "src", "*.nb.md"))):
        name = os.path.basename(src)[: -len(".nb.md")]
        cells = build_notebooks.parse_source(src)
        for lang in ("en", "zh"):
            built = build_notebooks.to_notebook(cells, lang)
            committed = nbformat.read(os.path.join(ROOT, "notebooks", lang, name + ".ipynb"), as_version=4)
            assert [c.source for c in built.cells] == [c.source for c in committed.cells], (
                f"{lang}/{name}.ipynb is stale: run python tools/build_notebooks.py {name}"
            )


def test_exercises_not_stale():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_exercises.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exercises = glob.glob(os.path.join(ROOT, "notebooks", "exercises", "*", "*.ipynb"))
    assert len(exercises) >= 2
    for path in exercises:
        text = "\n".join(code_cells(path))
        assert "BEGIN SOLUTION" not in text and "NotImplementedError" in text and "# CHECK" in text


# ---- static check: names and keywords used from areal_lite exist -------------------------------------------------


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """Map local name → 'module.attr' for `from areal_lite[.x] import a as b`."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "areal_lite":
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _resolve(dotted: str):
    module, attr = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), attr)


def _notebook_tree(path):
    src = []
    for cell in code_cells(path):
        # IPython syntax (magics, shell escapes) is not Python: blank those lines
        src.append("\n".join("" if l.lstrip().startswith(("%", "!")) else l for l in cell.split("\n")))
    return ast.parse("\n\n".join(src))


@pytest.mark.parametrize("path", EN, ids=os.path.basename)
def test_areal_lite_names_and_keywords_exist(path):
    tree = _notebook_tree(path)
    imported = _imported_names(tree)
    assert imported, "notebook imports nothing from areal_lite"
    for local, dotted in imported.items():
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as e:
            pytest.fail(f"{os.path.basename(path)}: `{dotted}` does not exist: {e}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        if node.func.id not in imported or not node.keywords:
            continue
        obj = _resolve(imported[node.func.id])
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            continue
        for kw in node.keywords:
            if kw.arg is not None:
                assert kw.arg in sig.parameters, (
                    f"{os.path.basename(path)} line {node.lineno}: {node.func.id}() has no keyword '{kw.arg}'"
                )
