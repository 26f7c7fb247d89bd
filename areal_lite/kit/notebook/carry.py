"""Carry what the learner wrote in one notebook into the next: `run_cells_defining`.

Why: notebook 03 is where the learner writes the agent and the loss; notebook 04 trains them. Copying the code into
04 would train our copy, not theirs. So 04 reads the *saved* notebook 03 (the one the learner edited: the exercise
folder's in a workshop) and runs, in its own namespace, each code cell that defines one of the names it needs. A
cell runs whole and in notebook order, so what the learner wrote next to a definition comes along with it (what it
prints is not repeated); a name that no cell defines is an error that says which notebook to finish first.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
from typing import Optional

import nbformat

__all__ = ["run_cells_defining"]


def _section(markdown: str, current: Optional[str]) -> Optional[str]:
    """The section a markdown cell leaves the notebook in: the number of its last title or section heading ("#" or
    "##": "## 4. The loss" -> "4"), None after an unnumbered one ("## Setup"), `current` if it has neither (deeper
    headings are parts of a section). The number rather than the title: it is the same in every language."""
    headings = re.findall(r"^#{1,2}\s+(.*)$", markdown, re.M)
    if not headings:
        return current
    number = re.match(r"(\d+)\.\s", headings[-1])
    return number.group(1) if number else None


def _defined_names(tree: ast.Module) -> set[str]:
    """Top-level names a cell binds: functions, classes and plain assignments."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def run_cells_defining(notebook: str, names: list[str], namespace: dict) -> dict[str, list[str]]:
    """Run, in `namespace`, every code cell of the saved `notebook` that defines one of `names`.

    Args:
        notebook: path of the .ipynb file (relative paths from the current folder, as a notebook's own).
        names: the top-level names wanted (functions, classes, variables).
        namespace: where the cells run, usually the calling notebook's `globals()`.

    Returns: {"code cell N (section S)": [names it defined]} for the cells run, in order. N counts code cells from 1
    (a fresh run's In [N]); S is the number of the heading above the cell ("## 4. The loss" gives 4), the part a
    reader finds in a notebook that has not run; without a numbered heading above, the key is "code cell N".

    Example:
        >>> run_cells_defining("03_gsm8k_agent.ipynb", ["my_ppo_loss"], globals())  # doctest: +SKIP
        {'code cell 23 (section 4)': ['my_grpo_advantages', 'my_ppo_loss']}
    """
    if not os.path.exists(notebook):
        raise FileNotFoundError(f"{notebook} not found in {os.getcwd()}: run this notebook from its own folder")
    nb = nbformat.read(notebook, as_version=4)
    wanted, ran = set(names), {}
    index, section = 0, None
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            section = _section(cell.source, section)
            continue
        if cell.cell_type != "code":
            continue
        index += 1  # numbered as a fresh run numbers them: In [1], In [2], ...
        if cell.source.lstrip().startswith(("%", "!")):
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:  # top-level await, or a cell being edited: it defines nothing we take
            continue
        defined = _defined_names(tree) & wanted
        if not defined:
            continue
        with contextlib.redirect_stdout(io.StringIO()):  # what the cell printed was read in its own notebook
            exec(compile(tree, f"{notebook}, code cell {index}", "exec"), namespace)  # noqa: S102 - the learner's code
        ran[f"code cell {index}" + (f" (section {section})" if section else "")] = sorted(defined)
    missing = wanted - {n for found in ran.values() for n in found}
    if missing:
        raise NameError(f"{notebook} defines no {sorted(missing)}: write them there, save it, rerun this cell")
    return ran
