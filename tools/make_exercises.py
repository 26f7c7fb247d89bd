"""Generate the workshop exercise notebooks from the solution notebooks.

In a solution notebook a code cell may hold regions

    # BEGIN SOLUTION hint: compute the precision from the common tokens
    precision = common / len(pred_tokens)
    # END SOLUTION

The exercise copy replaces each region by a `# TODO` with the hint and a line that fails loudly if left alone, keeping
the indentation. Right after each such cell the exercise gets a check cell that runs the notebook's own assertions
for that cell: the solution notebooks already hold it, as a code cell starting with `# CHECK` right after the cell it
checks (it runs there too, so the checks themselves are tested). A test fails if the committed exercises differ from
what this script writes, so they never go stale. The exercises carry no nbval markers (`# NBVAL_CHECK_OUTPUT`): they
are not run under nbval, and a learner should not see test plumbing in a cell. A notebook that trains what another
notebook's exercise wrote (it calls `run_cells_defining`) is copied too, so that it reads the learner's notebook.

Usage: python tools/make_exercises.py [--check]
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import re
import sys

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LANGS = ("en", "zh")
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?:\s+hint:\s*(?P<hint>.*))?$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
NBVAL = "# NBVAL_"  # nbval's cell markers, e.g. `# NBVAL_CHECK_OUTPUT`

CHECK_TEXT = {
    "en": "**Check your work** — run the cell below; it tells you whether your code above is right.",
    "zh": "**检查你的答案** —— 运行下面的单元格，它会告诉你上面的代码是否正确。",
}
TODO_TEXT = {"en": "TODO", "zh": "TODO（练习）"}
# The solved notebook's header names its exercise copy; in the copy that line points back to the solved notebook,
# whose outputs (the reference run) are what the text describes.
EXERCISE_LINE = {
    "en": re.compile(r"> \*\*Exercise\*\*: a version [^`]* is in `notebooks/exercises/en/(?P<nb>[\w.]+)`\."),
    "zh": re.compile(r"> \*\*练习\*\*：[^`]*练习版在 `notebooks/exercises/zh/(?P<nb>[\w.]+)`。"),
}
SOLVED_LINE = {
    "en": "> **Exercise version**: the solutions, and the reference run's outputs that the text describes, are in "
    "[the solved notebook](../../en/{nb}); your own run's numbers will differ.",
    "zh": "> **练习版**：答案，以及正文所描述的参考运行的输出，都在[完整的 notebook](../../zh/{nb}) 中；"
    "你自己运行得到的数字会有所不同。",
}
# A copy with no exercise of its own (it trains what another exercise wrote) has no solutions to point to.
TRAINS_LINE = {
    "en": "> **Exercise version**: it trains your exercise copies' code; the reference run's outputs that the text "
    "describes are in [the solved notebook](../../en/{nb}); your own run's numbers will differ.",
    "zh": "> **练习版**：它训练的是你在练习版中写的代码；正文所描述的参考运行的输出在"
    "[完整的 notebook](../../zh/{nb}) 中；你自己运行得到的数字会有所不同。",
}


def exercise_source(source: str, lang: str) -> tuple[str, bool]:
    """Replace solution regions; returns (new source, whether anything was replaced).

    A hint may go on over the comment lines right below `# BEGIN SOLUTION hint:`, at its indent: they stay in the
    exercise, under the TODO line."""
    out, inside, changed = [], False, False
    hint_prefix, raise_line = None, None  # the current region's continuation prefix; its line still to write
    for line in source.split("\n"):
        m = BEGIN.match(line)
        if m and not inside:
            inside, changed = True, True
            indent, hint = m.group("indent"), (m.group("hint") or "").strip()
            out.append(f"{indent}# {TODO_TEXT[lang]}: {hint}" if hint else f"{indent}# {TODO_TEXT[lang]}")
            hint_prefix = f"{indent}# " if hint else None
            raise_line = f'{indent}raise NotImplementedError("exercise: fill in the TODO above")'
            continue
        if inside:
            if hint_prefix and line.startswith(hint_prefix) and not END.match(line):
                out.append(line)  # the hint goes on
                continue
            if raise_line is not None:
                out.append(raise_line)
                hint_prefix, raise_line = None, None
            if END.match(line):
                inside = False
            continue
        out.append(line)
    if inside:
        raise ValueError("a `# BEGIN SOLUTION` region has no `# END SOLUTION`")
    return "\n".join(out), changed


def strip_markers(source: str) -> str:
    return "\n".join(l for l in source.split("\n") if not BEGIN.match(l) and not END.match(l))


def strip_nbval(source: str) -> str:
    return "\n".join(line for line in source.split("\n") if not line.startswith(NBVAL))


def one_level_deeper(source: str, kind: str) -> str:
    """Relative paths of a solution notebook (`notebooks/LANG/`) as seen from `notebooks/exercises/LANG/`."""
    if kind == "code":
        return source.replace('"../../', '"../../../')  # configs, runs: string literals from the repository root
    return source.replace("](../", "](../../")  # markdown links to notebooks/README.md, GLOSSARY.md


def make_exercise(nb: nbformat.NotebookNode, lang: str, has_exercise: bool = True) -> nbformat.NotebookNode:
    """Blank the solution regions; the `# CHECK` cell after each one gets a short instruction above it; the header's
    line naming the exercise copy (required) points back to the solved notebook instead."""
    ex = copy.deepcopy(nb)
    ex.metadata.pop("areal_lite", None)  # no reference run: the exercise has no outputs
    cells, header = [], False
    for i, cell in enumerate(ex.cells):
        cell.source = one_level_deeper(cell.source, cell.cell_type)
        if cell.cell_type == "markdown" and EXERCISE_LINE[lang].search(cell.source):
            line = (SOLVED_LINE if has_exercise else TRAINS_LINE)[lang]
            cell.source = EXERCISE_LINE[lang].sub(lambda m, line=line: line.format(nb=m.group("nb")), cell.source)
            header = True
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata = {}
            cell.source = strip_nbval(cell.source)
            new_source, changed = exercise_source(cell.source, lang)
            if changed:
                nxt = ex.cells[i + 1] if i + 1 < len(ex.cells) else None
                if nxt is None or nxt.cell_type != "code" or not _is_check(nxt.source):
                    raise ValueError(f"cell {i}: a solution cell must be followed by a `# CHECK` code cell")
                cell.source = new_source
        if cell.cell_type == "code" and _is_check(cell.source):
            cells.append(nbformat.v4.new_markdown_cell(CHECK_TEXT[lang]))
        cells.append(cell)
    if not header:
        raise ValueError("the notebook's header has no line naming its exercise copy (EXERCISE_LINE)")
    ex.cells = cells
    for j, c in enumerate(ex.cells):
        c["id"] = f"e{j:02d}"
    return ex


def _is_check(source: str) -> bool:
    lines = strip_nbval(source).split("\n")
    return bool(lines) and lines[0].startswith("# CHECK")


def outputs() -> dict[str, nbformat.NotebookNode]:
    result = {}
    for lang in LANGS:
        for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", lang, "*.ipynb"))):
            nb = nbformat.read(path, as_version=4)
            codes = [c.source for c in nb.cells if c.cell_type == "code"]
            has_exercise = any(BEGIN.match(line) for source in codes for line in source.split("\n"))
            # A notebook that trains what an exercise wrote (`run_cells_defining`) goes beside it in the exercise
            # folder, so that it reads the learner's notebook, not the solution.
            if not has_exercise and not any("run_cells_defining(" in source for source in codes):
                continue
            out = os.path.join(ROOT, "notebooks", "exercises", lang, os.path.basename(path))
            result[out] = make_exercise(nb, lang, has_exercise)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed exercises are stale")
    args = ap.parse_args(argv)
    stale = []
    for path, nb in outputs().items():
        text = nbformat.writes(nb) + "\n"
        if args.check:
            if not os.path.exists(path) or open(path, encoding="utf-8").read() != text:
                stale.append(os.path.relpath(path, ROOT))
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        print("wrote", os.path.relpath(path, ROOT))
    if stale:
        print("stale exercises (run `make exercises`):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
