"""Run the seed notebooks' own code cells under the kit, in one kernel per seed, and count what runs.

    python tools/seed_cells.py --seeds ../shared/seeds [--fix-defects] [--json F] [--save DIR]

Each seed's code cells run in order, as a learner runs them, with `areal.` -> `areal_lite.` in the imports and the
edits in EDITS, each with its kind and reason:
- `areal-1.0.4`: the seeds predate AReaL 1.0.4; the line as AReaL 1.0.4 writes it (a moved or removed name).
- `cpu`: the documented CPU swaps: the kit's config path, `launch_server` for the SGLang subprocess, packaged data
  for the hub download, the kit's RAG server for the one on port 5001, the disk weight hand-off for the GPU
  broadcast, no CUDA synchronize.
- `size`: numbers sized for a GPU (512 new tokens, 32 turns) take the CPU profile's values from the config.
- `defect` (only with --fix-defects): the seeds' own bugs, fixed as the kit's notebooks fix them.
Every edit must match its cell exactly once, so the table cannot drift from the seeds. Run as written, the cells
that meet a seed defect must be refused with the kit's message (EXPECTED_REFUSALS); any other failure, or a defect
that goes through, fails the run.
The seeds are not part of this repository; pass their folder.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SEED_FILES = {"000": "000_*.txt", "002": "002_*.txt"}


@dataclass(frozen=True)
class Edit:
    seed: str
    cell: int
    old: str
    new: str
    kind: str
    why: str


_LAUNCH = (
    "from areal_lite import launch_server\n\n"
    "sglang_process = launch_server(config, host=SGLANG_HOST, port=SGLANG_PORT).wait_ready(timeout=600)"
)
_POPEN_000 = """sglang_cmd = SGLangConfig.build_cmd(
    config.sglang,
    tp_size=1,
    base_gpu_id=1,
    host=SGLANG_HOST,
    port=SGLANG_PORT,
)
sglang_process = subprocess.Popen(
    sglang_cmd,
    stdout=sys.stdout,
    stderr=sys.stderr,
)"""
_POPEN_002 = _POPEN_000.replace("    sglang_cmd,\n", "    sglang_cmd,\n    shell=True,\n")
_DISK = (
    "WeightUpdateMeta.from_disk(config.experiment_name, config.trial_name, config.cluster.fileroot)\n"
    "actor.connect_engine(rollout, weight_update_meta)"
)
_LAUNCH_WHY = "CPU: launch_server starts the configured server (the embedded one) in place of SGLang's subprocess"
_SIZE_WHY = "size: the CPU profile's max_new_tokens in place of 512"
_TEMPLATE_WHY = (
    "AReaL 1.0.4 needs transformers 5, whose tokenizer.apply_chat_template returns a dict; AReaL's "
    "hf_utils.apply_chat_template returns the ids"
)
_LIST_WHY = (
    "AReaL 1.0.4's rollout_batch/prepare_batch return a list of trajectories; concat_padded_tensors joins them into "
    "the one batch the seed indexes"
)
_IMPORT_WHY = "AReaL 1.0.4: FSDPPPOActor is in areal.engine; AllocationMode was removed"

# fmt: off
EDITS = [
    # ---- seed 000: the search agent
    Edit("000", 0, "examples/search-agent/local_1.5b_example.yaml", "configs/search_agent.yaml", "cpu",
         "CPU: the kit's config (its CPU profile is chosen when there is no GPU)"),
    Edit("000", 2, _POPEN_000, _LAUNCH, "cpu", _LAUNCH_WHY),
    Edit("000", 3, "data_files=config.train_dataset.path", "data_files=build_factbook_qa_splits()['train']", "cpu",
         "CPU: packaged data: the factbook QA set the kit builds offline, read by the seed's own load_dataset('json')"),
    Edit("000", 3, "from datasets import load_dataset\n",
         "from datasets import load_dataset\n\nfrom areal_lite.dataset.factbook import build_factbook_qa_splits\n",
         "cpu", "CPU: packaged data (the import)"),
    Edit("000", 4, "    AllocationMode,\n", "", "areal-1.0.4", _IMPORT_WHY),
    Edit("000", 4, "from areal_lite.engine.ppo.actor import", "from areal_lite.engine import", "areal-1.0.4",
         _IMPORT_WHY),
    Edit("000", 6, 'TOOL_SERVER_ADDR = "localhost:5001"',
         "from areal_lite import build_factbook_corpus, launch_rag_server\n\n"
         'rag = launch_rag_server(build_factbook_corpus(), retriever="bm25").wait_ready(timeout=600)\n'
         "TOOL_SERVER_ADDR = rag.address", "cpu", "CPU: the kit's RAG server (same wire format) on a free port"),
    *(Edit("000", c, "max_new_tokens=512", "max_new_tokens=config.gconfig.max_new_tokens", "size", _SIZE_WHY)
      for c in (9, 16, 18, 19)),
    *(Edit("000", c, "max_turns=32", "max_turns=config.max_turns", "size",
           "size: the config's own max_turns (the seed's extra field) in place of 32") for c in (16, 18, 19)),
    Edit("000", 16, "for i in range(4)]", "for i in range(len(sample_data))]", "size",
         "size: the CPU profile's batch holds 2 questions, the seed's loop assumes 4"),
    Edit("000", 16, "for i in range(4):", "for i in range(len(sample_data)):", "size",
         "size: the CPU profile's batch holds 2 questions, the seed's loop assumes 4"),
    Edit("000", 19, 'WeightUpdateMeta.from_fsdp_xccl(\n    AllocationMode.from_str("sglang:d1p1t1+d1p1t1")\n)',
         _DISK, "cpu", "CPU: weights go to the server through disk (no NCCL); AReaL 1.0.4 connects the engine"),
    Edit("000", 19, "batch = rollout.rollout_batch(next(data_generator), workflow=workflow)",
         "batch = concat_padded_tensors(rollout.rollout_batch(next(data_generator), workflow=workflow))",
         "areal-1.0.4", _LIST_WHY),
    Edit("000", 15, "            input_ids += resp.output_tokens\n            input_ids += resp.output_tokens\n",
         "            input_ids += resp.output_tokens\n", "defect", "the seed appends the output tokens twice"),
    # ---- seed 002: the GSM8K agent that reflects
    Edit("002", 0, "!bash examples/env/scripts/setup-pip-deps.sh", "# the kit's install (`make install`)", "cpu",
         "CPU: the kit's install in place of AReaL's GPU dependency script"),
    Edit("002", 1, "examples/lite/configs/gsm8k_grpo.yaml", "configs/gsm8k_grpo.yaml", "cpu",
         "CPU: the kit's config (its CPU profile is chosen when there is no GPU)"),
    Edit("002", 3, _POPEN_002, _LAUNCH, "cpu", _LAUNCH_WHY),
    Edit("002", 4, 'load_dataset(path="openai/gsm8k", name="main", split="train")',
         "load_dataset_from_config(config.train_dataset)", "cpu",
         "CPU: packaged data: the config's dataset (GSM8K-style arithmetic on the CPU profile) without the hub"),
    Edit("002", 4, "from datasets import load_dataset\n",
         "from datasets import load_dataset\n\nfrom areal_lite import load_dataset_from_config\n", "cpu",
         "CPU: packaged data (the import)"),
    Edit("002", 5, "import colorama\n", "", "areal-1.0.4", "an import nothing uses (colorama is no kit dependency)"),
    Edit("002", 5, "from tensordict import TensorDict\n", "", "areal-1.0.4",
         "AReaL 1.0.4's workflows return plain dicts of tensors, not TensorDict"),
    Edit("002", 5, "    AllocationMode,\n", "", "areal-1.0.4", _IMPORT_WHY),
    Edit("002", 5, "    LLMRequest,\n", "    ModelRequest,\n", "areal-1.0.4", "AReaL 1.0.4 renamed LLMRequest"),
    Edit("002", 5, "from areal_lite.engine.ppo.actor import", "from areal_lite.engine import", "areal-1.0.4",
         _IMPORT_WHY),
    Edit("002", 5, "from areal_lite.utils.device import log_gpu_stats\n", "", "areal-1.0.4",
         "AReaL 1.0.4 has no areal.utils.device (and the seed never calls it)"),
    Edit("002", 8, "from realhf.impl.dataset.math_parser import", "from areal_lite.reward.math_answer import",
         "areal-1.0.4", "AReaL 1.0.4 dropped realhf; the kit's parser takes the seed's calls"),
    Edit("002", 9, "LLMRequest(", "ModelRequest(", "areal-1.0.4", "AReaL 1.0.4 renamed LLMRequest"),
    Edit("002", 9, "return TensorDict(res, batch_size=[1])", "return res", "areal-1.0.4",
         "AReaL 1.0.4's workflows return plain dicts of tensors"),
    Edit("002", 9, "async def arun_episode(self, engine, data) -> TensorDict:",
         "async def arun_episode(self, engine, data):",
         "areal-1.0.4", "AReaL 1.0.4's workflows return plain dicts of tensors"),
    Edit("002", 5, "from areal_lite.utils.data import concat_padded_tensors\n",
         "from areal_lite.utils.data import concat_padded_tensors\n"
         "from areal_lite.utils.hf_utils import apply_chat_template\n",
         "areal-1.0.4", _TEMPLATE_WHY),
    Edit("002", 9, "tokenizer.apply_chat_template(\n            data",
         "apply_chat_template(\n            tokenizer,\n            data",
         "areal-1.0.4", _TEMPLATE_WHY),
    Edit("002", 11, "s1 = tokenizer.apply_chat_template(", "s1 = apply_chat_template(tokenizer, ", "areal-1.0.4",
         _TEMPLATE_WHY),
    Edit("002", 11, "s2 = tokenizer.apply_chat_template(", "s2 = apply_chat_template(tokenizer, ", "areal-1.0.4",
         _TEMPLATE_WHY),
    Edit("002", 12, "tokenizer.apply_chat_template(\n            messages",
         "apply_chat_template(\n            tokenizer,\n            messages",
         "areal-1.0.4", _TEMPLATE_WHY),
    Edit("002", 12, "return TensorDict(res, batch_size=[1])", "return res", "areal-1.0.4",
         "AReaL 1.0.4's workflows return plain dicts of tensors"),
    *(Edit("002", c, "max_new_tokens=512", "max_new_tokens=config.gconfig.max_new_tokens", "size", _SIZE_WHY)
      for c in (10, 13, 15, 16, 17)),
    *(Edit("002", c, 'WeightUpdateMeta.from_fsdp_nccl(\n    AllocationMode.from_str("sglang.d1p1t1+d1p1t1"), actor\n)',
           "WeightUpdateMeta.from_disk(config.experiment_name, config.trial_name, config.cluster.fileroot)", "cpu",
           "CPU: weights go to the server through disk (no NCCL)") for c in (16, 17)),
    *(Edit("002", c, "batch = batch.to(actor.device)",
           "from areal_lite.utils.data import tensor_container_to\n\n"
           "    batch = tensor_container_to(batch, actor.device)",
           "areal-1.0.4", "AReaL 1.0.4's batches are dicts: tensor_container_to moves them") for c in (16, 17)),
    *(Edit("002", c, "    torch.cuda.synchronize()\n", "", "cpu", "CPU: no CUDA stream to wait for")
      for c in (16, 17)),
    Edit("002", 16, "batch = rollout.rollout_batch(next(data_generator), workflow=workflow)",
         "batch = concat_padded_tensors(rollout.rollout_batch(next(data_generator), workflow=workflow))",
         "areal-1.0.4", _LIST_WHY),
    Edit("002", 17, "batch = rollout.prepare_batch(dataloader, workflow=workflow)",
         "batch = concat_padded_tensors(rollout.prepare_batch(dataloader, workflow=workflow))", "areal-1.0.4",
         _LIST_WHY),
    *(Edit("002", c, "GenerationHyperparameters(n_samples=3,",
           "GenerationHyperparameters(n_samples=config.gconfig.n_samples,",
           "defect", "the group size is given twice (the config's 4, the workflow's 3) and they disagree")
      for c in (16, 17)),
    Edit("002", 9, "            reward=torch.tensor(reward),", "            rewards=torch.tensor(reward),", "defect",
         "the first workflow names the key `reward`, the others `rewards`"),
    Edit("002", 9, "            apply_chat_template=True,", "            add_generation_prompt=True,", "defect",
         "a meaningless keyword in place of add_generation_prompt=True"),
]
# fmt: on


# Run as written, these cells must fail, each with the kit's refusal of a seed defect (the `defect` edits fix them).
EXPECTED_REFUSALS = {
    ("000", 18): "disagree in length",  # the double append, refused by rollout_batch where the episode is made
    ("000", 19): "disagree in length",
    ("002", 16): "multiple of group_size",  # the workflow's 3 samples against the config's group size of 4
    ("002", 17): "multiple of group_size",
}


def read_cells(path: Path) -> list[str]:
    """The code cells of a seed: a notebook's JSON, or a text export whose cells follow `In [None]:` lines (a cell
    ends at a blank line followed by a markdown line: a `##` heading, an image, or prose in Chinese)."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        nb = json.loads(text)
        return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    cells: list[list[str]] = []
    current: list[str] | None = None
    prev_blank = False
    for line in text.splitlines():
        if line.startswith("In [") and line.rstrip().endswith("]:"):
            current = []
            cells.append(current)
        elif current is not None:
            if prev_blank and re.match(r"(##|!\[|[\u4e00-\u9fff])", line):
                current = None
            else:
                current.append(line)
        prev_blank = not line.strip()
    return ["\n".join(c).strip() + "\n" for c in cells]


def port(source: str) -> str:
    """The import prefix change, and nothing else: `areal.` -> `areal_lite.` in import lines."""
    return re.sub(r"^(\s*)(from|import) areal\.", r"\1\2 areal_lite.", source, flags=re.M)


def apply_edits(seed: str, cells: list[str], fix_defects: bool) -> tuple[list[str], dict[int, list[Edit]]]:
    cells = [port(c) for c in cells]
    applied: dict[int, list[Edit]] = {}
    for e in EDITS:
        if e.seed != seed or (e.kind == "defect" and not fix_defects):
            continue
        found = cells[e.cell].count(e.old)
        if found != 1:
            raise SystemExit(f"seed {seed} cell {e.cell}: edit ({e.why}) matches {found} times, expected once")
        cells[e.cell] = cells[e.cell].replace(e.old, e.new)
        applied.setdefault(e.cell, []).append(e)
    for i, src in enumerate(cells):  # a seed cell that no longer parses would fail for a reason of ours
        if not src.lstrip().startswith("!"):
            compile(src, f"<seed {seed} cell {i}>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    return cells, applied


def run_cells(cells: list[str], timeout: int) -> tuple[list[dict], nbformat.NotebookNode]:
    """Execute the cells in one fresh kernel (cwd: the repository), each cell's outcome and wall time."""
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(ROOT)}})  # fmt: skip
    results = []
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            tik = time.perf_counter()
            client.execute_cell(cell, i)
            errors = [o for o in cell.outputs if o.output_type == "error"]
            error = f"{errors[0].ename}: {errors[0].evalue}" if errors else None
            results.append({"cell": i, "ok": error is None, "error": error, "s": round(time.perf_counter() - tik, 1)})
    return results, nb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", required=True, help="the folder holding the seed files")
    ap.add_argument("--only", choices=sorted(SEED_FILES), help="one seed")
    ap.add_argument("--fix-defects", action="store_true", help="also fix the seeds' own bugs (kind 'defect')")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds one cell may run")
    ap.add_argument("--json", help="write the per-cell outcomes here")
    ap.add_argument("--save", help="write each executed notebook into this folder")
    args = ap.parse_args(argv)
    report = {}
    for seed, pattern in SEED_FILES.items():
        if args.only and seed != args.only:
            continue
        (path,) = Path(args.seeds).glob(pattern)
        cells, applied = apply_edits(seed, read_cells(path), args.fix_defects)
        results, nb = run_cells(cells, args.timeout)
        for r in results:
            r["edits"] = [f"{e.kind}: {e.why}" for e in applied.get(r["cell"], [])]
            want = None if args.fix_defects else EXPECTED_REFUSALS.get((seed, r["cell"]))
            r["expected"] = bool(r["error"] and want and want in r["error"]) if want else r["ok"]
        report[seed] = results
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, str(Path(args.save) / f"seed_{seed}.ipynb"))
        print_seed(seed, path.name, results)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if all(r["expected"] for rs in report.values() for r in rs) else 1


def print_seed(seed: str, name: str, results: list[dict]) -> None:
    ok = sum(r["ok"] for r in results)
    as_written = sum(r["ok"] and not r["edits"] for r in results)
    refused = sum(r["expected"] and not r["ok"] for r in results)
    print(
        f"\nseed {seed} ({name}): {ok}/{len(results)} cells ran ({as_written} with the import prefix change only), "
        f"{refused} refused for the seed's own defect, {len(results) - ok - refused} failed"
    )
    for r in results:
        kinds = sorted({e.split(":")[0] for e in r["edits"]})
        status = "ok  " if r["ok"] else "refused" if r["expected"] else "FAIL"
        print(f"  cell {r['cell']:2d} {status:7s} {r['s']:7.1f} s  {','.join(kinds) or 'as written':22s}"
              f"{'  ' + r['error'][:200] if r['error'] else ''}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
