"""What people read is a user's document: short, current, with no history of our runs in it.

README.md, docs/, the notebooks' sources and guides, and the package's docstrings say what a thing is, how to use it
and why it is built so. A measured figure lives in bench/results/*.json and the generated bench/RESULTS.md, the only
place a commit hash belongs. These tests hold the caps the project sets itself.
"""

from __future__ import annotations

import ast
import glob
import math
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A commit hash as people paste it: 7 to 40 hex digits with at least one letter and one digit (not 2026 or "deadbeef"
# alone, which are words or numbers).
COMMIT = re.compile(r"(?<![0-9A-Za-z_/.#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
README_MAX_LINES = 150
DOCSTRING_MAX_LINES = 20


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


USER_DOCS = sorted(
    [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CONTRIBUTING.md")]
    + glob.glob(os.path.join(ROOT, "docs", "*.md"))
    + glob.glob(os.path.join(ROOT, "notebooks", "*.md"))
    + glob.glob(os.path.join(ROOT, "notebooks", "src", "*.nb.md"))
)
PACKAGE = sorted(glob.glob(os.path.join(ROOT, "areal_lite", "**", "*.py"), recursive=True))


def _docstrings(path: str):
    """(where, text) of the module's docstring and of every class's and function's."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):  # the module itself first
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield getattr(node, "name", "module"), text


def test_the_commit_pattern_finds_hashes_and_nothing_else():
    found = COMMIT.findall("at 4f99358 and a766d2f6de051ccca905484c0de0a975f0ea6843; not 2026, 1e-5, deadbeef, x86_64")
    assert found == ["4f99358", "a766d2f6de051ccca905484c0de0a975f0ea6843"]
    assert COMMIT.findall("#ff00aa1, path/abc1234, x=1e5a") == []


@pytest.mark.parametrize("path", USER_DOCS, ids=_rel)
def test_no_commit_hash_in_user_documents(path):
    text = open(path, encoding="utf-8").read()
    hits = [(text.count("\n", 0, m.start()) + 1, m.group()) for m in COMMIT.finditer(text)]
    assert not hits, f"{_rel(path)}: commit hashes (line, hash) {hits}; figures with commits go to bench/results"


def test_no_commit_hash_in_package_docstrings():
    hits = [
        f"{_rel(path)}:{where}: {m.group()}"
        for path in PACKAGE
        for where, text in _docstrings(path)
        for m in COMMIT.finditer(text)
    ]
    assert not hits, "commit hashes in docstrings:\n" + "\n".join(hits)


def test_module_docstrings_are_at_most_20_lines():
    """The package's, and the scripts' a user runs or reads (bench/, tools/, tests/): a longer account of a bench
    belongs in docs/benchmarks.md, of a tool in the doc that names it."""
    scripts = [p for d in ("bench", "tools", "tests") for p in glob.glob(os.path.join(ROOT, d, "*.py"))]
    long = {}
    for path in PACKAGE + sorted(scripts):
        text = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read()), clean=False)
        if text and len(text.strip("\n").splitlines()) > DOCSTRING_MAX_LINES:
            long[_rel(path)] = len(text.strip("\n").splitlines())
    assert not long, f"module docstrings over {DOCSTRING_MAX_LINES} lines (name the bench, keep the why): {long}"


def test_readme_reads_in_five_minutes():
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("path", [p for p in USER_DOCS if not p.endswith(".nb.md")], ids=_rel)
def test_relative_links_point_at_files_that_exist(path):
    text = open(path, encoding="utf-8").read()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), target))):
            missing.append(target)
    assert not missing, f"{_rel(path)} links to files that do not exist: {missing}"


def test_docs_cover_the_optional_routes():
    """The README stays short because each optional route has its own page."""
    pages = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))}
    assert {"gpu.md", "vllm.md", "trl.md", "reliability.md", "areal-run.md", "benchmarks.md"} <= pages
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    for page in sorted(pages):
        assert f"docs/{page}" in readme, f"README.md does not link docs/{page}"


NOTEBOOK_TIMES = os.path.join(ROOT, "bench", "results", "notebook_times.json")


def _avx2_seconds(times: str = NOTEBOOK_TIMES) -> dict:
    """{"01": seconds} of the notebooks bench/notebook_times.py timed on an AVX2-only CPU (not a forced-AVX2 proxy, not
    an AVX-512 CPU); empty without such a results file."""
    import json

    if not os.path.exists(times):
        return {}
    record = json.load(open(times, encoding="utf-8"))
    if not record["vector_isa"].startswith("AVX2") or record.get("forced_isa"):
        return {}
    return {name[:2]: r["seconds"] for name, r in record["notebooks"].items()}


def _up_one_decimal(x: float) -> str:
    """`x` rounded up to one decimal, as the READMEs quote minutes and GiB (a learner needs at least that much)."""
    return f"{math.ceil(round(x * 10, 6)) / 10:.1f}"


def _reference_runs() -> list:
    """(notebook number "01", its committed reference run's metadata) of every English notebook."""
    import json

    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "en", "[01]*.ipynb"))):
        run = json.load(open(path, encoding="utf-8"))["metadata"]["areal_lite"]["reference_run"]
        out.append((os.path.basename(path)[:2], run))
    return out


def _reference_minutes(times: str = NOTEBOOK_TIMES) -> dict:
    """{"01": (Xeon minutes, AVX2 minutes)} as the READMEs must state them: the committed reference run's wall time in
    minutes to one decimal; then an AVX2-only CPU's time (`_avx2_seconds`) rounded up to one decimal, else the
    reference time scaled by 2.2, rounded up. A reference run made on an AVX2-only CPU gives no Xeon figure (None),
    and the AVX2 figure is the slower of it and `_avx2_seconds`."""
    avx2 = _avx2_seconds(times)
    up = _up_one_decimal
    out = {}
    for n, run in _reference_runs():
        seconds = run["wall_seconds"]
        if run["vector_isa"] == "AVX2":
            out[n] = (None, up(max(seconds, avx2.get(n, 0)) / 60))
        else:
            out[n] = (f"{seconds / 60:.1f}", up(avx2[n] / 60) if n in avx2 else up(seconds / 60 * 2.2))
    return out


def test_notebook_minutes_are_the_reference_runs():
    """The CPU minutes a teacher plans with (README's table, the workshop guide's table and timing plan) are measured
    wall times (`_reference_minutes`), not typed guesses that drift as the notebooks change."""
    expected = _reference_minutes()
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    guide = open(os.path.join(ROOT, "notebooks", "README.md"), encoding="utf-8").read()
    found = {  # "0.9–1.3", or "1.3" alone where the reference run was on the AVX2-only CPU
        "README.md": {
            n: (a or None, b)
            for n, a, b in re.findall(r"^\| `(\d\d)_\w+` \|.*\| (?:([\d.]+)–)?([\d.]+) \|$", readme, re.M)
        },
        "notebooks/README.md": {
            n: (a or None, b)
            for n, a, b in re.findall(r"^\| \[(\d\d)_\w+\]\(en/.*?\| (?:([\d.]+)–)?([\d.]+) min \|", guide, re.M)
        },
    }
    plan = {}
    for block, slow in re.findall(r"^\| \d:\d\d \| ([^|]*) \| ~([\d.]+) min \|", guide, re.M):
        plan[re.search(r"\b(\d\d)\b", block).group(1)] = slow
    assert found["README.md"].keys() == found["notebooks/README.md"].keys() == plan.keys() == expected.keys()
    for doc, table in found.items():
        wrong = {n: (table[n], expected[n]) for n in expected if table[n] != expected[n]}
        assert not wrong, f"{doc}: (stated, reference run) minutes differ: {wrong}"
    wrong = {n: (plan[n], expected[n][1]) for n in expected if plan[n] != expected[n][1]}
    assert not wrong, f"notebooks/README.md timing plan: (stated, AVX2 figure) minutes differ: {wrong}"


ARROW = re.compile(r"(\d+(?:\.\d+)?) → (\d+(?:\.\d+)?)")


def test_the_guide_and_the_readme_quote_the_same_results():
    """Both READMEs quote each notebook's results ("before → after"): where they quote a change from the same
    starting figure, they give the same end figure (a notebook re-executed, one of the two not updated)."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    guide = open(os.path.join(ROOT, "notebooks", "README.md"), encoding="utf-8").read()
    rows = {n: ARROW.findall(row) for n, row in re.findall(r"^\| `(\d\d)_\w+` \|(.*)$", readme, re.M)}
    results = " ".join(guide[guide.index("What the committed CPU runs show") :].split("\n\n")[0].split())
    parts = re.split(r"(?:^|[;:] )(\d\d) ", results)  # "...; 09 the OpenAI-client agent ...; 10 full ..."
    segments = dict(zip(parts[1::2], parts[2::2]))
    assert {"04", "05", "11", "12"} <= segments.keys(), f"the guide's results paragraph: {sorted(segments)}"
    differ = []
    for n, text in segments.items():
        ends = {}
        for start, end in rows.get(n, []):
            ends.setdefault(start, set()).add(end)
        differ += [(n, f"{a} → {b}", sorted(ends[a])) for a, b in ARROW.findall(text) if a in ends and b not in ends[a]]
    assert not differ, f"notebooks/README.md quotes other results than README.md: {differ}"


HEADER_TIMES = {  # each notebook's first cell, in the source of both languages: (reference minutes, AVX2 minutes)
    "en": r"\*\*Time\*\* ~([\d.]+) min on a 2-core AVX-512 CPU, an estimated ([\d.]+) on an AVX2-only one",
    "zh": r"\*\*耗时\*\* 2 核 AVX-512 CPU 上约 ([\d.]+) 分钟，仅支持 AVX2 的 CPU 上估计约 ([\d.]+) 分钟",
}
HEADER_TIMES_MEASURED = {  # the same, once an AVX2-only CPU has timed the notebook: no longer an estimate
    "en": r"\*\*Time\*\* ~([\d.]+) min on a 2-core AVX-512 CPU, ([\d.]+) on a 2-core AVX2-only one",
    "zh": r"\*\*耗时\*\* 2 核 AVX-512 CPU 上约 ([\d.]+) 分钟，2 核仅支持 AVX2 的 CPU 上约 ([\d.]+) 分钟",
}
HEADER_TIMES_AVX2_RUN = {  # a reference run made on the AVX2-only CPU: its figure alone
    "en": r"\*\*Time\*\* ~()([\d.]+) min on a 2-core AVX2-only CPU \(less on an AVX-512 one\)",
    "zh": r"\*\*耗时\*\* 2 核仅支持 AVX2 的 CPU 上约 ()([\d.]+) 分钟（AVX-512 CPU 上更短）",
}


def test_each_notebooks_header_gives_the_same_minutes_as_the_readmes():
    """A learner reads the time in the notebook's own header: it must be the READMEs' figure (`_reference_minutes`),
    in English and in Chinese, not the time of an earlier run, and call the AVX2 figure an estimate exactly when it
    is one."""
    expected, timed = _reference_minutes(), _avx2_seconds()
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "src", "[01]*.nb.md"))):
        n, text = os.path.basename(path)[:2], open(path, encoding="utf-8").read()
        for lang in HEADER_TIMES:
            if expected[n][0] is None:
                pattern = HEADER_TIMES_AVX2_RUN
            else:
                pattern = HEADER_TIMES_MEASURED if n in timed else HEADER_TIMES
            found = [(a or None, b) for a, b in re.findall(pattern[lang], text)]
            name = os.path.basename(path)
            assert found == [expected[n]], f"{name} ({lang}): the header says {found}, the READMEs {expected[n]}"


def test_an_avx2_only_cpus_notebook_times_replace_the_estimate(tmp_path):
    """Once bench/notebook_times.py has timed a notebook on an AVX2-only CPU, the READMEs must give that time; a run
    with torch's AVX2 kernels forced on an AVX-512 CPU (a proxy) or from an AVX-512 CPU changes nothing."""
    import json

    estimate = _reference_minutes(str(tmp_path / "none.json"))
    record = {"vector_isa": "AVX2", "forced_isa": "", "notebooks": {"01_setup": {"seconds": 130.0}}}
    path = tmp_path / "times.json"
    path.write_text(json.dumps(record))
    measured = _reference_minutes(str(path))
    assert measured["01"] == (estimate["01"][0], "2.2") != estimate["01"]  # 130 s = 2.17 min, rounded up
    assert {n: m for n, m in measured.items() if n != "01"} == {n: m for n, m in estimate.items() if n != "01"}
    for other in ({"forced_isa": "avx2"}, {"vector_isa": "AVX512 + AMX"}):
        path.write_text(json.dumps({**record, **other}))
        assert _reference_minutes(str(path)) == estimate


def _record(bench: str) -> dict:
    """bench/results/BENCH.json, the record a page quotes."""
    import json

    with open(os.path.join(ROOT, "bench", "results", f"{bench}.json"), encoding="utf-8") as f:
        return json.load(f)


def _record_if_any(bench: str) -> dict | None:
    """`_record(bench)`, or None where that bench has no results file (an AVX2-only CPU's records, until one ran)."""
    return _record(bench) if os.path.exists(os.path.join(ROOT, "bench", "results", f"{bench}.json")) else None


def _other_cpus(bench: str) -> list:
    """The results files' names of `bench` on the CPUs beside the AVX-512 reference one: AVX2-only CPUs ("vs_trl_avx2",
    "vs_trl_avx2_zen2") and a second AVX-512 CPU ("vs_trl_avx512_xeon"), not the AVX2 proxy's."""
    paths = glob.glob(os.path.join(ROOT, "bench", "results", f"{bench}_avx*.json"))
    names = sorted(os.path.basename(p)[: -len(".json")] for p in paths)
    return [n for n in names if not n.endswith("_proxy")]


def _folded(*parts: str) -> str:
    """The file ROOT/PARTS with its line breaks and runs of spaces folded into single spaces (a quote may wrap
    anywhere)."""
    return " ".join(open(os.path.join(ROOT, *parts), encoding="utf-8").read().split())


def _page_text(page: str) -> str:
    """docs/PAGE, folded (`_folded`)."""
    return _folded("docs", page)


def _training_minutes(after_n_steps_line: str) -> float:
    """The minutes of training before the last evaluation, from the demo's "greedy accuracy after N steps" line."""
    return float(re.findall(r"\(([\d.]+)\)", after_n_steps_line)[-1])


def _quoted_training_minutes(record: dict) -> str:
    """A demo record's minutes of training over its runs, as README quotes them: "lowest–highest" or one figure."""
    minutes = sorted(_training_minutes(r["lines"][2]) for r in record["runs"])
    return f"{minutes[0]:.1f}–{minutes[-1]:.1f}" if minutes[0] != minutes[-1] else f"{minutes[0]:.1f}"


def test_readmes_demo_output_is_a_recorded_run():
    """README.md's `make demo` block is what the demo printed in bench/demo.py's latest record, line for line, and
    the minutes of training it quotes are that record's runs (lowest-highest), not typed by hand."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"```text\n(.*?)\n```", readme, re.S)
    assert block, "README.md has no ```text block with the demo's output"
    shown = [line for line in block.group(1).splitlines() if line != "..."]
    record = _record("demo")
    assert shown == record["runs"][0]["lines"], "README.md's demo block is not bench/results/demo.json's first run"
    quoted = _quoted_training_minutes(record)
    # a space before the figure: "2.3 min" must not pass inside a stale "2.2–2.3 min"
    assert f" {quoted} min of training" in readme, f"README.md should quote {quoted} min of training (the record's)"
    if avx2 := _record_if_any("demo_avx2"):  # and an AVX2-only CPU's, if timed
        quoted = f" {_quoted_training_minutes(avx2)} min of training on a 2-core AVX2-only {avx2['cpu_model']}"
        assert quoted in " ".join(readme.split()), f"README.md should say {quoted!r} (bench/results/demo_avx2.json)"


def test_readmes_test_time_is_the_recorded_ci_run():
    """README.md's `make test` minutes are bench/results/ci_time.json's (`bench/cpu_evidence.py --ci`: `.ci/run` on a
    clean clone, timed), with that record's CPU, and the run it quotes was green."""
    record = _record("ci_time")
    assert record["returncode"] == 0, "the recorded .ci/run failed: record a green one"
    readme = _folded("README.md")
    minutes, cpu = record["seconds"] / 60, record["cpu_model"]
    quoted = f"`make test` took {minutes:.0f} min from a clean clone on the 2-core AVX-512 {cpu}"
    assert quoted in readme, f"README.md should say {quoted!r} (bench/results/ci_time.json)"
    assert record["vector_isa"].startswith("AVX512") and record["cores"] == 2
    if avx2 := _record_if_any("ci_time_avx2"):  # and an AVX2-only CPU's, if timed
        assert avx2["returncode"] == 0 and avx2["vector_isa"] == "AVX2" and not avx2["forced_isa"]
        assert f"and {avx2['seconds'] / 60:.0f} min on the 2-core AVX2-only {avx2['cpu_model']}" in readme


def test_the_memory_the_readmes_ask_for_is_the_recorded_peak():
    """README.md and the workshop guide say how much free memory the kit needs: `make demo`'s peak and the largest
    notebook's, as bench/memory.py recorded them (rounded up), not typed by hand; every notebook was measured."""
    up, runs = _up_one_decimal, _record("memory")["runs"]
    notebooks = {name: r["peak_gib"] for name, r in runs.items() if name != "demo"}
    expected = {
        os.path.basename(p)[: -len(".ipynb")] for p in glob.glob(os.path.join(ROOT, "notebooks", "en", "*.ipynb"))
    }
    assert set(notebooks) == expected, "bench/results/memory.json must measure every notebook (`make memory`)"
    largest = max(notebooks, key=notebooks.get)
    readme = _folded("README.md")
    quoted = f"`make demo` peaks at {up(runs['demo']['peak_gib'])} GiB and the largest notebook, {largest[:2]}, at "
    quoted += f"{up(notebooks[largest])} GiB"
    assert quoted in readme, f"README.md should say {quoted!r} (bench/results/memory.json)"
    guide = _folded("notebooks", "README.md")
    low = min(notebooks, key=notebooks.get)
    quoted = f"from {up(notebooks[low])} GiB ({low[:2]}) to {up(notebooks[largest])} GiB ({largest[:2]})"
    quoted += f" of memory, and `make demo` {up(runs['demo']['peak_gib'])} GiB"
    assert quoted in guide, f"notebooks/README.md should say {quoted!r} (bench/results/memory.json)"


def test_reliability_quotes_the_recorded_soak():
    """docs/reliability.md's soak figures are bench/results/soak.json's (`make soak` writes it), not typed by hand."""
    c = _record("soak")["counts"]
    assert c["passed"], "the recorded soak run failed"
    text = _page_text("reliability.md")
    quoted = (f"{c['sent']:,} requests sent, {c['answered']:,} answered, {c['hung_up']:,} hung up by their own "
              f"clients, {c['lost']} lost, {c['server_errors']} 5xx, {c['orphans']} orphans, {c['shm_bytes_left']} "
              f"bytes left")  # fmt: skip
    assert quoted in text, f"docs/reliability.md should quote the recorded soak: {quoted!r}"


def _lo_hi(lowest: float, highest: float, fmt: str = "{:.0f}") -> str:
    """A range as the pages print it: "lo-hi", or one figure where both ends print alike."""
    lo, hi = fmt.format(lowest), fmt.format(highest)
    return lo if lo == hi else f"{lo}-{hi}"


def test_trl_page_quotes_both_recorded_runs():
    """docs/trl.md's ratios, times and accuracies are bench/results/vs_trl.json's and vs_trl_bf16.json's, and each
    other CPU's (vs_trl_avx2.json, vs_trl_avx2_zen2.json, vs_trl_avx512_xeon.json, vs_trl_bf16_avx512_xeon.json: not
    the proxy's) where one was made."""
    text = _page_text("trl.md")
    others = [*_other_cpus("vs_trl"), *_other_cpus("vs_trl_bf16")]
    records = {bench: _record(bench) for bench in ("vs_trl", "vs_trl_bf16", *others)}
    for bench, d in records.items():
        s, base = d["summary"], d["base_accuracy"]
        lo, hi = min(s["trl_over_kit_train_time"]), max(s["trl_over_kit_train_time"])
        trl, kit = s["trl"], s["kit"]
        spread = _lo_hi(lo, hi, "{:.1f}")
        by_repeat = f"{spread} in every repeat" if spread == f"{lo:.1f}" else f"{spread} by repeat"  # one figure
        trl_s, kit_s = _lo_hi(trl["train_s_min"], trl["train_s_max"]), _lo_hi(kit["train_s_min"], kit["train_s_max"])
        quoted = (f"TRL takes {s['trl_over_kit_median']:.1f}x as long as the kit ({by_repeat}; TRL {trl_s} s, the kit "
                  f"{kit_s} s); held-out accuracy {base:.2f} -> "
                  f"{trl['accuracy_after_median']:.2f} for TRL, {base:.2f} -> {kit['accuracy_after_median']:.2f} for "
                  "the kit")  # fmt: skip
        assert quoted in text, f"docs/trl.md should quote {bench}.json: {quoted!r}"
    if "vs_trl_avx2" in records:  # the two CPUs' matmul speeds it compares are their update benches' own
        peaks = [
            _record(b)["rows"]["float32 (default)"]["limit"]["peak_gflops"]
            for b in ("update_speed_avx2", "update_speed")
        ]
        quoted = "a large float32 `torch.mm` runs at {:.0f} GFLOP/s there against {:.0f} on the first CPU".format(
            *peaks
        )
        assert quoted in " ".join(text.split()), f"docs/trl.md should say {quoted!r} (the update_speed records)"


def test_trl_page_quotes_the_kits_phases_of_its_median_repeat():
    """docs/trl.md's phase times for the kit (generate, update, weight sync) are each float32 record's median repeat's
    (the kit run of median train time); for a CPU after the first of its class (a Zen 2, a second AVX-512 CPU), also
    TRL's update and generation over the kit's in that repeat, and the host's matmul speed before the kit's runs
    (`host_mm_gflops`)."""
    import statistics

    text = _page_text("trl.md")
    for bench in ("vs_trl", *_other_cpus("vs_trl")):
        d = _record(bench)
        kits = [r for r in d["runs"] if r["system"] == "kit"]
        middle = statistics.median_low(r["train_s"] for r in kits)
        kit = next(r for r in kits if r["train_s"] == middle)
        p = kit["phase_s"]
        quoted = f"generate {p['generate']:.0f} s, update {p['update']:.0f} s, weight sync {p['weight_sync']:.0f} s"
        assert f"(its median repeat): {quoted}" in text, f"docs/trl.md should quote {bench}.json's {quoted!r}"
        if bench in ("vs_trl", "vs_trl_avx2"):
            continue
        trl = next(r["phase_s"] for r in d["runs"] if r["system"] == "trl" and r["repeat"] == kit["repeat"])
        quoted = (f"TRL's update took {trl['update'] / p['update']:.1f} times the kit's, its generation "
                  f"{trl['generate'] / p['generate']:.1f} times")  # fmt: skip
        assert quoted in text, f"docs/trl.md should say {quoted!r} ({bench}.json)"
        speeds = [r["host_mm_gflops"] for r in kits]
        assert f"({min(speeds):.0f}-{max(speeds):.0f} GFLOP/s before the kit's runs)" in text, bench


def test_the_cpu_generations_the_docs_name_are_their_records():
    """Where README.md, the workshop guide and docs/trl.md name a CPU's generation ("AMD EPYC (Zen 3)"), it is the one
    the record they quote ran on (`cpu_generation` of the record's `cpu_id`): VMs of different generations share
    one model name, and their speeds differ two- to threefold."""
    from areal_lite.utils.machine import cpu_generation

    def named(bench: str, isa: str) -> str:  # "AVX2-only AMD EPYC (Zen 3"
        d = _record(bench)
        assert (generation := cpu_generation(d["cpu_id"])), f"{bench}.json: no generation known for {d['cpu_id']!r}"
        return f"{isa} {d['cpu_model']} ({generation}"

    readme, guide, trl = _folded("README.md"), _folded("notebooks", "README.md"), _page_text("trl.md")
    assert named("demo", "2-core AVX-512") + ")" in readme
    if _record_if_any("demo_avx2"):  # an AVX2-only CPU's demo, where one was timed
        assert named("demo_avx2", "2-core AVX2-only") + ")" in readme
    for n, run in _reference_runs():  # the reference runs' CPU
        if "cpu_id" in run and run["vector_isa"] != "AVX2":  # recorded by the build tool since it names the numbers
            assert f"AVX-512 {run['cpu_model']} ({cpu_generation(run['cpu_id'])};" in readme, n
    times = _record("notebook_times")
    if times["vector_isa"] == "AVX2" and not times.get("forced_isa"):  # the README's second notebook figure
        assert named("notebook_times", "AVX2-only") + ") by `make notebook-times`" in readme
        assert f"a 2-core {times['cpu_model']}, {cpu_generation(times['cpu_id'])}," in guide
    for bench in ("vs_trl", *_other_cpus("vs_trl")):
        d = _record(bench)
        family, model = d["cpu_id"].split()[1:4:2]
        isa, generation = "AVX2 only" if d["vector_isa"] == "AVX2" else "AVX-512", cpu_generation(d["cpu_id"])
        assert f"{d['cpu_model']} VM ({generation + ', ' if generation else ''}{isa}" in trl, bench
        assert f"family {family} model {model}" in trl, bench


def test_areal_run_quotes_its_record():
    """docs/areal-run.md's recorded seconds are bench/results/areal_run.json's, a run that passed."""
    d = _record("areal_run")
    first, resumed = d["runs"]
    steps = [v["step_s"] for r in d["runs"] for v in r["steps"].values()]
    assert d["exit"] == 0
    text = _page_text("areal-run.md")
    quoted = (f"the first run {first['seconds']:.0f} s, the resumed one {resumed['seconds']:.0f} s, steps of "
              f"{min(steps):.0f}-{max(steps):.0f} s")  # fmt: skip
    assert quoted in text, f"docs/areal-run.md should quote its record: {quoted!r}"
