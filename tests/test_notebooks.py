"""Notebooks are code: parity between languages, committed outputs from the current code, exercises not stale,
sources in sync, and every `areal_lite` name a notebook uses exists and accepts the keywords passed to it.

(The notebooks themselves are executed by nbval: `make test` runs `pytest notebooks/en --nbval-lax`; the Chinese
notebooks share every code cell with the English ones, checked here, and `make test-zh` executes them.)
"""

from __future__ import annotations

import ast
import glob
import importlib
import inspect
import os
import re
import subprocess
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EN = sorted(glob.glob(os.path.join(ROOT, "notebooks", "en", "*.ipynb")))
ZH = sorted(glob.glob(os.path.join(ROOT, "notebooks", "zh", "*.ipynb")))
ALL = EN + ZH
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
EXPECTED = [
    "01_setup",
    "02_rewards_and_tools",
    "03_gsm8k_agent",
    "04_gsm8k_training",
    "05_search_agent",
    "06_multiturn_feedback",
    "07_async_vs_sync",
    "08_to_areal",
    "09_openai_agent",
    "10_lora",
    "11_environment",
    "12_judge",
]


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


def _build_tool():
    import _sources

    return _sources.build_notebooks


@pytest.mark.parametrize("path", ALL, ids=lambda p: os.path.relpath(p, ROOT))
def test_committed_outputs_come_from_this_code(path):
    """Outputs are the reference run of exactly these code cells (tools/build_notebooks.py --execute wrote them)."""
    nb = nbformat.read(path, as_version=4)
    name = os.path.basename(path)[:-6]
    recorded = nb.metadata.get("areal_lite", {}).get("code_sha256")
    assert recorded == _build_tool().code_fingerprint(nb), (
        f"the committed outputs of {name} were not produced by its current code: "
        f"run python tools/build_notebooks.py --execute {name}"
    )


@pytest.mark.parametrize("path", ALL, ids=lambda p: os.path.relpath(p, ROOT))
def test_headline_cells_show_results(path):
    nb = nbformat.read(path, as_version=4)
    headlines = [(i, c) for i, c in enumerate(nb.cells) if "headline" in c.metadata.get("tags", [])]
    trains = os.path.basename(path).startswith(("04_", "05_", "06_", "07_"))
    assert headlines or not trains, "a training notebook marks no headline cell"
    for i, cell in headlines:
        assert cell.outputs, f"cell {i} is a headline cell and has no committed output"
        if "plot_" in cell.source or "plt." in cell.source:
            assert any("image/png" in o.get("data", {}) for o in cell.outputs), f"cell {i} plots but has no image"


@pytest.mark.parametrize("path", ALL, ids=lambda p: os.path.relpath(p, ROOT))
def test_committed_outputs_are_readable(path):
    """What a reader sees on GitHub or in JupyterLab before running: text, HTML and PNG, no machine paths."""
    tool = _build_tool()
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.source.startswith(CHECK_MARK):
            assert cell.outputs, f"cell {i}: checked cell has no stored output to compare against"
        for out in cell.outputs:
            assert out.output_type in ("stream", "execute_result", "display_data"), f"cell {i}: {out.output_type}"
            assert set(out.get("data", {})) <= set(tool.KEPT_MIME), f"cell {i}: {sorted(out.get('data', {}))}"
            text = out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
            assert ROOT not in text, f"cell {i}: the checkout's path is committed"
            # Noise a learner should not have to read past: terminal colours, tracebacks, loading bars.
            for noise in ("\x1b[", "Traceback", "Loading weights"):
                assert noise not in text, f"cell {i}: {noise!r} in a committed output"
    assert "widgets" not in nb.metadata, "widget state committed (its text form is kept instead)"


def test_notebooks_match_their_sources():
    """The committed notebooks are exactly what tools/build_notebooks.py writes from notebooks/src."""
    build_notebooks = _build_tool()
    for src in sorted(glob.glob(os.path.join(ROOT, "notebooks", "src", "*.nb.md"))):
        name = os.path.basename(src)[: -len(".nb.md")]
        cells = build_notebooks.parse_source(src)
        for lang in ("en", "zh"):
            built = build_notebooks.to_notebook(cells, lang)
            committed = nbformat.read(os.path.join(ROOT, "notebooks", lang, name + ".ipynb"), as_version=4)
            assert [(c.source, c.metadata.get("tags")) for c in built.cells] == [
                (c.source, c.metadata.get("tags")) for c in committed.cells
            ], f"{lang}/{name}.ipynb is stale: run python tools/build_notebooks.py {name}"


def test_exercises_not_stale():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "make_exercises.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exercises = glob.glob(os.path.join(ROOT, "notebooks", "exercises", "*", "*.ipynb"))
    assert len(exercises) >= 2
    for path in exercises:
        text = "\n".join(code_cells(path))
        assert "BEGIN SOLUTION" not in text
        assert CHECK_MARK not in text, f"{os.path.relpath(path, ROOT)}: an exercise cell carries an nbval marker"
        # its header points back to the solved notebook (the reference run the text describes), not to itself
        lang, name = path.split(os.sep)[-2], os.path.basename(path)
        header = nbformat.read(path, as_version=4).cells[0].source
        assert f"](../../{lang}/{name})" in header and "notebooks/exercises/" not in header, f"{lang}/{name}: {header}"
        if "run_cells_defining(" in text:  # trains what another exercise wrote: copied whole, nothing to fill in
            continue
        assert "NotImplementedError" in text and "# CHECK" in text


def test_exercises_keep_every_line_of_their_hints():
    """A hint written over several comment lines reaches the learner whole, and the solution below it does not."""
    import _sources  # noqa: F401  (it puts tools/ on the path)
    from make_exercises import exercise_source

    source = "\n".join([
        "class Box:",
        "    # BEGIN SOLUTION hint: put(x) stores x;",
        "    # get() returns it",
        "    def put(self, x):",
        "        # the solution's own comment",
        "        self.x = x",
        "    # END SOLUTION",
        "def f():",
        "    # BEGIN SOLUTION",
        "    # a solution that opens with a comment",
        "    return 1",
        "    # END SOLUTION",
    ])  # fmt: skip
    exercise, changed = exercise_source(source, "en")
    assert changed and exercise.split("\n") == [
        "class Box:",
        "    # TODO: put(x) stores x;",
        "    # get() returns it",
        '    raise NotImplementedError("exercise: fill in the TODO above")',
        "def f():",
        "    # TODO",
        '    raise NotImplementedError("exercise: fill in the TODO above")',
    ]


@pytest.mark.parametrize(
    "path",
    ALL + sorted(glob.glob(os.path.join(ROOT, "notebooks", "exercises", "*", "*.ipynb"))),
    ids=lambda p: os.path.relpath(p, ROOT),
)
def test_relative_paths_resolve(path):
    """Config files and linked documents exist where the notebook's own folder says (exercises sit a level deeper)."""
    folder = os.path.dirname(path)
    for cell in nbformat.read(path, as_version=4).cells:
        pattern = r'"(\.\./[^"]*?\.(?:yaml|md))"' if cell.cell_type == "code" else r"\]\((\.\./[^)#]+)"
        for rel in re.findall(pattern, cell.source):
            where = os.path.relpath(folder, ROOT)
            assert os.path.exists(os.path.join(folder, rel)), f"{rel} does not exist from {where}"


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
    for dotted in imported.values():
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


# ---- the build tool: committed outputs follow the code ---------------------------------------------------------------


def _tiny_notebook(tool, code):
    cells = [{"kind": "md", "en": "# t", "zh": "# 题", "line": 1}]
    cells += [{"kind": "code", "source": c, "check": False, "headline": i == 0, "line": 2} for i, c in enumerate(code)]
    return tool.to_notebook(cells, "en")


def _executed(tool, nb):
    """What --execute leaves: outputs on every code cell, the fingerprint in the metadata."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"ran {cell.source}\n")]
    nb.metadata["areal_lite"] = {"code_sha256": tool.code_fingerprint(nb)}
    tool.finalize(nb, executed=True)
    return nb


def test_rebuilding_unchanged_code_writes_the_reference_run_again(tmp_path):
    """A prose edit rebuilds without --execute: the file keeps the reference run as it was, execution counts included
    (a code cell that printed nothing keeps its count), so the rebuild's diff is the prose alone."""
    tool = _build_tool()
    path = tmp_path / "n.ipynb"
    ran = _tiny_notebook(tool, ["a = 1", "print(a)"])
    ran.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]  # "a = 1" printed nothing
    ran.metadata["areal_lite"] = {"code_sha256": tool.code_fingerprint(ran)}
    tool.finalize(ran, executed=True)
    nbformat.write(ran, path)

    rebuilt = _tiny_notebook(tool, ["a = 1", "print(a)"])
    assert tool._keep_outputs(str(path), rebuilt)
    tool.finalize(rebuilt, executed=True)
    assert nbformat.writes(rebuilt) == nbformat.writes(nbformat.read(path, as_version=4))
    assert [c.execution_count for c in rebuilt.cells if c.cell_type == "code"] == [1, 2]
    assert not tool._keep_outputs(str(path), _tiny_notebook(tool, ["a = 2", "print(a)"]))


def test_rebuild_keeps_outputs_only_while_the_code_is_unchanged(tmp_path):
    tool = _build_tool()
    path = tmp_path / "n.ipynb"
    nbformat.write(_executed(tool, _tiny_notebook(tool, ["a = 1", "print(a)"])), path)

    same = _tiny_notebook(tool, ["a = 1", "print(a)"])
    tool._keep_outputs(str(path), same)
    assert [c.outputs[0].text for c in same.cells[1:]] == ["ran a = 1\n", "ran print(a)\n"]
    assert same.metadata["areal_lite"]["code_sha256"] == tool.code_fingerprint(same)
    assert same.cells[1].metadata["tags"] == ["headline"]

    edited = _tiny_notebook(tool, ["a = 2", "print(a)"])
    tool._keep_outputs(str(path), edited)
    assert all(c.outputs == [] for c in edited.cells[1:]), "outputs of other code survived an edit"
    assert "areal_lite" not in edited.metadata


def test_finalize_keeps_readable_outputs_and_the_final_state_of_progress_bars():
    tool = _build_tool()
    nb = _tiny_notebook(tool, ["for _ in trange(3): pass", "fig", "engine.initialize()"])
    bar, label, counts = "m-bar", "m-label", "m-counts"
    nb.metadata["widgets"] = {
        "application/vnd.jupyter.widget-state+json": {
            "state": {
                "m-box": {"state": {"children": [f"IPY_MODEL_{label}", f"IPY_MODEL_{bar}", f"IPY_MODEL_{counts}"]}},
                label: {"state": {"value": "train: 100%"}},
                bar: {"state": {"value": 3, "max": 3}},
                counts: {"state": {"value": "\u20073/3\u2007[00:04&lt;00:00]"}},
            }
        }
    }
    nb.cells[1].outputs = [
        nbformat.v4.new_output(
            "display_data",
            data={
                "application/vnd.jupyter.widget-view+json": {"model_id": "m-box"},
                "text/plain": "train:   0%| | 0/3",
            },
        )
    ]
    nb.cells[2].outputs = [
        nbformat.v4.new_output("display_data", data={"image/png": "iVBOR", "text/plain": "<Figure>"}),
        nbformat.v4.new_output("stream", name="stdout", text="saved"),  # one print, split over two messages
        nbformat.v4.new_output("stream", name="stdout", text=f" to {ROOT}/runs/x\n"),
    ]
    nb.cells[3].outputs = [
        nbformat.v4.new_output("execute_result", data={"text/plain": "<a.b.Engine at 0x7f0a>"}),
        nbformat.v4.new_output("display_data", data={"text/html": "<b>x</b>", "text/plain": "<a.HTML object>"}),
    ]
    tool.finalize(nb, executed=True)
    assert [o.data for o in nb.cells[3].outputs] == [{"text/html": "<b>x</b>"}], "a bare default repr was kept"
    assert nb.cells[1].outputs[0].data == {"text/plain": "train: 100%|██████████|3/3 [00:04<00:00]"}
    assert nb.cells[2].outputs[0].data["image/png"] == "iVBOR"
    assert len(nb.cells[2].outputs) == 2 and nb.cells[2].outputs[1].text == "saved to <repo>/runs/x\n"
    assert "widgets" not in nb.metadata
    assert [c.execution_count for c in nb.cells if c.cell_type == "code"] == [1, 2, 3]


def test_a_reference_run_is_never_a_smoke_run(tmp_path, monkeypatch):
    """`make test` sets AREAL_LITE_SMOKE (notebooks train a step or two); the committed outputs must be full runs
    even when the variable is set in the shell that runs the build tool, and the shell keeps it afterwards."""
    tool = _build_tool()
    monkeypatch.setenv("AREAL_LITE_SMOKE", "1")
    nb = tool.execute(_tiny_notebook(tool, ['import os; print(os.environ.get("AREAL_LITE_SMOKE"))']), str(tmp_path))
    assert nb.cells[1].outputs[0].text == "None\n"
    assert os.environ["AREAL_LITE_SMOKE"] == "1"


def test_unknown_code_cell_option_is_an_error(tmp_path):
    src = tmp_path / "x.nb.md"
    src.write_text("%% code headlin\nprint(1)\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="unknown code cell option"):
        _build_tool().parse_source(str(src))


def test_nbval_kernel_starts_while_the_tcp_port_jupyter_picks_is_taken(monkeypatch):
    """notebooks/conftest.py puts nbval's kernels on ipc sockets. jupyter_client picks a TCP port by binding port 0
    and closing it; a process that binds it before the kernel does kills the kernel at start-up (seen once in CI
    under two workers). Here that port is always taken: the kernel must still start and run a cell."""
    import socket

    import nbval.kernel
    from jupyter_client.connect import LocalPortCache

    spec = importlib.util.spec_from_file_location("notebooks_conftest", os.path.join(ROOT, "notebooks", "conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    monkeypatch.setattr(nbval.kernel, "KernelManager", conftest.IpcKernelManager)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        monkeypatch.setattr(LocalPortCache, "find_available_port", lambda self, ip: taken.getsockname()[1])
        kernel = nbval.kernel.RunningKernel("python3", cwd=ROOT)
        try:
            msg_id = kernel.execute_cell_input("print(6 * 7)", allow_stdin=False)
            kernel.await_reply(msg_id, timeout=30)
            outputs = []
            while not outputs:
                msg = kernel.get_message(stream="iopub", timeout=30)
                if msg["msg_type"] == "stream":
                    outputs.append(msg["content"]["text"])
        finally:
            kernel.stop()
    assert outputs == ["42\n"]
