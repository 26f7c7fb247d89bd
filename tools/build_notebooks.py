"""Build the English and Chinese notebooks from one bilingual source per notebook.

Why a source format: the two languages must share their code cells exactly. Writing each notebook once, every
markdown cell in both languages side by side, makes that true by construction (a test still checks it).

Source: `notebooks/src/NN_name.nb.md`. Cells start with a line `%% KIND [options]`:
- `%% md` then `%% zh`  — a markdown cell in English, followed by the same cell in Chinese (both required).
- `%% code`             — a code cell: its reference-run output is committed, never compared (timings vary).
- `%% code check`       — a code cell whose output is deterministic: nbval compares it after the sanitizer
  (`# NBVAL_CHECK_OUTPUT`, the marker nbval's lax mode looks for, is added as its first line).
- `%% code headline`    — a cell whose output is what the notebook is about: a test fails if it has no output
  (and no image where it plots).
Inside code, `# BEGIN SOLUTION hint: ...` / `# END SOLUTION` mark what the exercise versions replace by a TODO.

Committed outputs are only ever written by `--execute`, never by hand. The executed notebook records a fingerprint
of its code cells (`metadata.areal_lite.code_sha256`); rebuilding without `--execute` keeps the outputs only while
the fingerprint still matches, and a test fails when it does not (the outputs could not have come from this code).

Usage: .venv/bin/python tools/build_notebooks.py [--execute] [NAME ...]; `--execute` runs each English notebook (a
fresh kernel in its folder) and gives its outputs to both languages, whose code cells are identical.
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import html
import os
import re
import sys
import time
from datetime import datetime

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "notebooks", "src")
LANGS = ("en", "zh")
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
# Output types a reader can see without a live kernel; a widget (a tqdm bar) is kept as text of its final state.
KEPT_MIME = ("text/plain", "text/html", "image/png", "text/markdown", "text/latex")
KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}


def parse_source(path: str) -> list[dict]:
    """Cells as dicts: {"kind": "md", "en", "zh"} or {"kind": "code", "source", "check", "headline"} (and "line")."""
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
            unknown = set(opts) - {"check", "headline"}
            if unknown:
                raise SystemExit(f"{path}:{line_no}: unknown code cell option(s) {sorted(unknown)}")
            cells.append(
                {
                    "kind": "code",
                    "source": text,
                    "check": "check" in opts,
                    "headline": "headline" in opts,
                    "line": line_no,
                }
            )
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


def source_literal(path: str, name: str):
    """The Python literal that a code cell of source `path` assigns to `name` (`NAME = [...]`), for a script that
    must use what the notebook uses (bench/tool_exploration.py, bench/search_prompts.py). Cells may hold top-level
    `await`. Raises LookupError when no code cell assigns it."""
    flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    for cell in parse_source(path):
        if cell["kind"] != "code":
            continue
        for node in compile(cell["source"], path, "exec", flags=flags).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
                return ast.literal_eval(node.value)
    raise LookupError(f"{path} assigns no {name}")


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
            if cell["headline"]:
                nb.cells[-1].metadata["tags"] = ["headline"]
    for i, c in enumerate(nb.cells):
        c["id"] = f"c{i:02d}"  # stable ids keep diffs small
    return nb


def code_fingerprint(nb: nbformat.NotebookNode) -> str:
    """sha256 of the code cells in order: what the committed outputs were produced from."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode("utf-8") + b"\0")
    return h.hexdigest()


def _scrub(text: str) -> str:
    """Machine-specific prefixes out of committed text: the checkout and the home folder."""
    return text.replace(ROOT, "<repo>").replace(os.path.expanduser("~"), "~")


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# Python's default repr (`<areal_lite.engine.sglang_remote.RemoteSGLangEngine at 0x7f...>`, the value of
# `engine.initialize(...)`; `<IPython.core.display.HTML object>` beside rendered HTML): a class name and an address,
# nothing a reader learns from.
BARE_REPR = re.compile(r"^<[\w.]+( object)?( at 0x[0-9a-f]+)?>$")


def _widget_text(model_id: str, state: dict) -> str:
    """The final look of a widget as text: a tqdm bar is an HBox of (HTML label, progress, HTML counts).

    A widget's own text/plain is captured when it is first displayed (a bar at 0%); its final state lives only in
    the notebook's widget state, which GitHub and nbconvert do not render.
    """
    model = state.get(model_id, {}).get("state", {})
    if "children" in model:
        return "|".join(_widget_text(c.removeprefix("IPY_MODEL_"), state) for c in model["children"])
    if "max" in model and "value" in model:
        filled = round(10 * float(model["value"]) / max(float(model["max"]), 1e-9))
        return "█" * filled + " " * (10 - filled)
    text = html.unescape(re.sub(r"<[^>]+>", "", str(model.get("value", ""))))
    return text.replace("\u2007", " ").replace("\xa0", " ").strip()  # tqdm pads with figure and no-break spaces


def _clean_output(out: nbformat.NotebookNode, count: int, widgets: dict):
    """The readable part of one output, or None when nothing readable is left."""
    if out.output_type == "stream":
        out.text = _scrub(out.text)
        return out
    if out.output_type not in ("display_data", "execute_result"):
        return None  # errors never get here: nbclient stops the build at the failing cell
    view = out.data.get(WIDGET_VIEW)
    if view and view.get("model_id") in widgets:
        out.data = {"text/plain": _widget_text(view["model_id"], widgets)}
    data = {k: v for k, v in out.data.items() if k in KEPT_MIME}
    if BARE_REPR.match(data.get("text/plain", "")):
        del data["text/plain"]
    if not data:
        return None
    out.data = {k: (_scrub(v) if isinstance(v, str) and k != "image/png" else v) for k, v in data.items()}
    out.metadata = {}
    if out.output_type == "execute_result":
        out.execution_count = count
    return out


def _cell_seconds(cell: nbformat.NotebookNode) -> float | None:
    """How long a cell ran, from the timestamps nbclient records in its metadata."""
    t = cell.metadata.get("execution", {})
    start, end = t.get("iopub.execute_input"), t.get("shell.execute_reply")
    if not (start and end):
        return None
    return (_timestamp(end) - _timestamp(start)).total_seconds()


def _timestamp(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def finalize(nb: nbformat.NotebookNode, executed: bool) -> None:
    """Number code cells by position and keep their readable outputs; drop cell metadata but the headline tag.

    Execution counts are positions among the code cells (nbval refuses a stored output without one, and positions
    never change unless the notebook does), so rebuilding gives identical files.
    """
    widgets = nb.metadata.pop("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    n = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        n += 1
        readable = [o for o in (_clean_output(o, n, widgets) for o in cell.outputs) if o is not None]
        cell.outputs = _merge_streams(readable)
        cell.execution_count = n if cell.outputs or executed else None
        tags = cell.metadata.get("tags", [])
        cell.metadata = {"tags": tags} if tags else {}


def _merge_streams(outputs: list) -> list:
    """Adjacent pieces of one stream as one output: a print can arrive in two messages, and the split is noise."""
    merged = []
    for out in outputs:
        last = merged[-1] if merged else None
        if last is not None and out.output_type == last.output_type == "stream" and out.name == last.name:
            last.text += out.text
        else:
            merged.append(out)
    return merged


def _machine() -> dict:
    """The CPU a reference run's times belong to (model, cores, vector ISA, and the family/model numbers that name its
    generation: VMs of different generations share one model name): times differ between CPUs."""
    if ROOT not in sys.path:  # once, not once per notebook executed
        sys.path.insert(0, ROOT)
    from areal_lite.utils.machine import cpu_id, describe

    m = describe()
    return {"cpu_model": m["cpu_model"], "cpu_count": m["cores"], "vector_isa": m["vector_isa"], "cpu_id": cpu_id()}


def execute(nb: nbformat.NotebookNode, cwd: str, timeout: int = 900) -> nbformat.NotebookNode:
    """Run in a fresh kernel in the notebook's own folder (configs are found by relative path, as for a learner)."""
    from nbclient import NotebookClient

    # CI sets MPLBACKEND=Agg; the kernel must keep Jupyter's inline backend, or no plot would reach the outputs.
    # `make test` sets AREAL_LITE_SMOKE (tiny budgets); a reference run is always the full notebook.
    unset = {key: os.environ.pop(key) for key in ("MPLBACKEND", "AREAL_LITE_SMOKE") if key in os.environ}
    try:
        tik = time.perf_counter()
        NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": cwd}}).execute()
        wall = time.perf_counter() - tik
    finally:
        os.environ.update(unset)
    nb.metadata["language_info"] = {"name": "python"}  # the kernel's own names its Python version: not ours to commit
    slow = {c.id: round(s, 1) for c in nb.cells if c.cell_type == "code" and (s := _cell_seconds(c) or 0) >= 5}
    nb.metadata["areal_lite"] = {
        "code_sha256": code_fingerprint(nb),
        "reference_run": {"wall_seconds": round(wall, 1), **_machine(), "slow_cells_seconds": slow},
    }
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
                    print(f"  {nb.metadata['areal_lite']['reference_run']['wall_seconds']} s", flush=True)
                else:
                    # same code, same outputs: copy the English run instead of running twice
                    for c_zh, c_en in zip(nb.cells, executed_en.cells):
                        if c_zh.cell_type == "code":
                            c_zh.outputs = c_en.outputs
                    nb.metadata["areal_lite"] = executed_en.metadata["areal_lite"]
            kept = not run and os.path.exists(out) and _keep_outputs(out, nb)
            finalize(nb, executed=run or kept)
            nbformat.write(nb, out)
            written.append(out)
    return written


def _keep_outputs(old_path: str, nb: nbformat.NotebookNode) -> bool:
    """Rebuilding without --execute keeps the reference run's outputs while the code is what produced them; returns
    whether it kept the run whole (then the rebuild is finalized as executed: a cell that printed nothing keeps its
    execution count, so a prose edit changes nothing else in the file).

    Once the code changed, only outputs of unchanged check cells stay (nbval compares those against a fresh run);
    the fingerprint goes, and tests/test_notebooks.py asks for `--execute`.
    """
    old = nbformat.read(old_path, as_version=4)
    meta = old.metadata.get("areal_lite", {})
    if meta.get("code_sha256") == code_fingerprint(nb):
        old_code = [c for c in old.cells if c.cell_type == "code"]
        for cell, old_cell in zip((c for c in nb.cells if c.cell_type == "code"), old_code):
            cell.outputs = old_cell.outputs
        nb.metadata["areal_lite"] = meta
        return True
    by_source = {c.source: c.outputs for c in old.cells if c.cell_type == "code" and c.source.startswith(CHECK_MARK)}
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source in by_source:
            cell.outputs = by_source[cell.source]
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="only notebooks whose name contains one of these")
    ap.add_argument(
        "--execute", action="store_true", help="execute the English notebook and commit its outputs to both languages"
    )
    args = ap.parse_args(argv)
    for path in build(args.names, args.execute):
        print("wrote", os.path.relpath(path, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
