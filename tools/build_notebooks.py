"""Build the English and Chinese notebooks from one bilingual source per notebook.

Why a source format: the two languages must share their code cells exactly (same code, same order). Writing each
notebook once, with every markdown cell in both languages next to each other, makes that true by construction; a test
still checks the built notebooks.

Source: `notebooks/src/NN_name.nb.md`. Cells start with a line `%% KIND [options]`:
- `%% md` then `%% zh`  — a markdown cell in English, followed by the same cell in Chinese (both required).
- `%% code`             — a code cell; its output is volatile and never committed.
- `%% code check`       — a code cell whose output is deterministic: it is stored and nbval compares it.
  (`# NBVAL_CHECK_OUTPUT` is added as the first line, the marker nbval's lax mode looks for.)
Inside code, `# BEGIN SOLUTION hint: ...` / `# END SOLUTION` mark what the exercise versions replace by a TODO.

Usage: python tools/build_notebooks.py [--execute] [NAME ...]
  --execute runs each built notebook (nbclient) and keeps outputs of `check` cells only.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "notebooks", "src")
LANGS = ("en", "zh")
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}


def parse_source(path: str) -> list[dict]:
    """Return cells as dicts: {"kind": "md", "en":..., "zh":...} or {"kind": "code", "source":..., "check": bool}."""
    cells: list[dict] = []
    kind, opts, buf = None, [], []

    def flush():
        if kind is None:
            return
        text = "\n".join(buf).strip("\n")
        if kind == "md":
            cells.append({"kind": "md", "en": text, "zh": None, "line": line_no})
        elif kind == "zh":
            if not cells or cells[-1]["kind"] != "md" or cells[-1]["zh"] is not None:
                raise SystemExit(f"{path}:{line_no}: a `%% zh` cell must follow a `%% md` cell")
            cells[-1]["zh"] = text
        elif kind == "code":
            cells.append({"kind": "code", "source": text, "check": "check" in opts, "line": line_no})
        else:
            raise SystemExit(f"{path}:{line_no}: unknown cell kind {kind!r}")

    line_no = 0
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh.read().split("\n"), start=1):
            if line.startswith("%% "):
                flush()
                parts = line[3:].split()
                kind, opts, buf, line_no = parts[0], parts[1:], [], i
            else:
                buf.append(line)
    flush()
    for cell in cells:
        if cell["kind"] == "md" and cell["zh"] is None:
            raise SystemExit(f"{path}:{cell['line']}: markdown cell has no Chinese twin (`%% zh`)")
    return cells


def to_notebook(cells: list[dict], lang: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNEL
    nb.metadata["language_info"] = {"name": "python"}
    for cell in cells:
        if cell["kind"] == "md":
            nb.cells.append(nbformat.v4.new_markdown_cell(cell[lang]))
        else:
            source = cell["source"]
            if cell["check"]:
                source = CHECK_MARK + "\n" + source
            nb.cells.append(nbformat.v4.new_code_cell(source))
    for i, c in enumerate(nb.cells):
        c["id"] = f"c{i:02d}"  # stable ids keep diffs small
    return nb


def strip_volatile(nb: nbformat.NotebookNode) -> None:
    """Keep outputs only where nbval checks them; everything else (ports, timings, plots) is not committed.

    nbval refuses a stored output without an execution count, so checked cells get a stable one: their position
    among the code cells (rebuilding never changes it unless the notebook does).
    """
    n = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        n += 1
        if cell.source.startswith(CHECK_MARK):
            # text only: figures and widgets are volatile even in a checked cell
            cell.outputs = [o for o in cell.outputs if o.get("output_type") in ("stream", "execute_result")]
            for o in cell.outputs:
                if o.get("output_type") == "execute_result":
                    o["execution_count"] = n
                    o["data"] = {k: v for k, v in o["data"].items() if k == "text/plain"}
            cell.execution_count = n
        else:
            cell.outputs = []
            cell.execution_count = None
        cell.metadata = {}


def execute(nb: nbformat.NotebookNode, cwd: str, timeout: int = 900) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": cwd}}).execute()
    return nb


def build(name_filter: list[str], run: bool) -> list[str]:
    written = []
    for src in sorted(glob.glob(os.path.join(SRC, "*.nb.md"))):
        name = os.path.basename(src)[: -len(".nb.md")]
        if name_filter and not any(f in name for f in name_filter):
            continue
        cells = parse_source(src)
        executed_en = None
        for lang in LANGS:
            out_dir = os.path.join(ROOT, "notebooks", lang)
            os.makedirs(out_dir, exist_ok=True)
            out = os.path.join(out_dir, name + ".ipynb")
            nb = to_notebook(cells, lang)
            if run:
                if lang == "en":
                    print(f"executing {name} ...", flush=True)
                    executed_en = execute(nb, out_dir)
                    nb = executed_en
                else:
                    # same code, same outputs: copy the English outputs instead of running twice
                    for c_zh, c_en in zip(nb.cells, executed_en.cells):
                        if c_zh.cell_type == "code":
                            c_zh.outputs = c_en.outputs
            elif os.path.exists(out):
                _keep_checked_outputs(out, nb)
            strip_volatile(nb)
            nbformat.write(nb, out)
            written.append(out)
    return written


def _keep_checked_outputs(old_path: str, nb: nbformat.NotebookNode) -> None:
    """Rebuilding without --execute keeps stored outputs of check cells whose code did not change."""
    old = nbformat.read(old_path, as_version=4)
    by_source = {c.source: c.outputs for c in old.cells if c.cell_type == "code" and c.source.startswith(CHECK_MARK)}
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source in by_source:
            cell.outputs = by_source[cell.source]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="only notebooks whose name contains one of these")
    ap.add_argument("--execute", action="store_true", help="execute and store the outputs of check cells")
    args = ap.parse_args(argv)
    for path in build(args.names, args.execute):
        print("wrote", os.path.relpath(path, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
