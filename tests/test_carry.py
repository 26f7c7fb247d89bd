"""`run_cells_defining`: a notebook runs the cells of another saved notebook that define the names it asks for."""

from __future__ import annotations

import nbformat
import pytest

from areal_lite import run_cells_defining


def _notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# the learner's notebook")]
    nb.cells += [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, str(path))
    return str(path)


def test_runs_the_defining_cells_whole_in_order_and_quietly(tmp_path, capsys):
    path = _notebook(
        tmp_path / "03.ipynb",
        "SCALE = 2\nprint('noise')",  # 1: defines SCALE
        "rows = next(data)",  # 2: defines nothing asked for, and would fail here
        "def double(x):\n    return SCALE * x\nHELPER = 'came along'",  # 3: double, with a neighbour
        "await something()",  # 4: top-level await: not Python a module can compile, skipped
        "%time double(1)",  # 5: a magic, skipped
    )
    namespace = {}
    ran = run_cells_defining(path, ["double", "SCALE"], namespace)
    assert ran == {"code cell 1": ["SCALE"], "code cell 3": ["double"]}
    assert namespace["double"](3) == 6 and namespace["HELPER"] == "came along" and "rows" not in namespace
    assert "noise" not in capsys.readouterr().out  # the cell printed in its own notebook already


def test_the_learners_version_is_what_runs(tmp_path):
    """What the saved notebook holds runs, not a copy: edit the cell, save, run again, get the edit."""
    path = tmp_path / "03.ipynb"
    namespace = {}
    run_cells_defining(_notebook(path, "def loss(x):\n    return x"), ["loss"], namespace)
    assert namespace["loss"](2) == 2
    run_cells_defining(_notebook(path, "def loss(x):\n    return -x"), ["loss"], namespace)
    assert namespace["loss"](2) == -2


def test_each_cell_is_named_with_the_section_a_reader_finds_it_in(tmp_path):
    """A notebook that has not run shows no In [N]: the key also names the numbered heading above the cell, the same
    in every language; an unnumbered heading ends the section, a deeper heading does not."""
    nb = nbformat.v4.new_notebook()
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    nb.cells = [
        md("# 03 · The notebook"),
        code("A = 1"),
        md("## 1. Single-turn RLVR\n\ntext"),
        code("B = 2"),
        md("### Why it works"),
        code("C = 3"),
        md("## 4. 损失函数：由你来写"),
        code("D = 4"),
        md("## What notebook 04 takes from here"),
        code("E = 5"),
    ]
    path = str(tmp_path / "03.ipynb")
    nbformat.write(nb, path)
    ran = run_cells_defining(path, list("ABCDE"), {})
    assert ran == {
        "code cell 1": ["A"],
        "code cell 2 (section 1)": ["B"],
        "code cell 3 (section 1)": ["C"],
        "code cell 4 (section 4)": ["D"],
        "code cell 5": ["E"],
    }


def test_a_missing_name_or_notebook_says_what_to_do(tmp_path):
    path = _notebook(tmp_path / "03.ipynb", "def loss(x):\n    return x")
    with pytest.raises(NameError, match=r"defines no \['my_ppo_loss'\]: write them there, save it"):
        run_cells_defining(path, ["loss", "my_ppo_loss"], {})
    with pytest.raises(FileNotFoundError, match="run this notebook from its own folder"):
        run_cells_defining(str(tmp_path / "absent.ipynb"), ["loss"], {})
