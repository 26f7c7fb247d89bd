"""How the prompt decides whether SmolLM2-135M-Instruct searches and answers: notebook 05's prompt and its variants.

    PYTHONPATH=. .venv/bin/python bench/search_prompts.py [--questions 12] [--samples 4] [--seed 1]
        [--json bench/results/search_prompts.json]

Before any training, on the CPU profile of `configs/search_agent.yaml` (capital questions, at most 3 turns of 24
tokens, the embedded server and a BM25 retrieval server over the Factbook), the library's `SearchAgentWorkflow`
plays each prompt: `--questions` training questions x `--samples` episodes at temperature 1.0, and one greedy
episode for each of the 16 held-out questions. Per prompt: the share of sampled episodes that searched, that
answered (`<answer>...</answer>`), their mean F1 reward, and the greedy held-out F1.

Design decisions
- Notebook 05's own prompt is the baseline: its `SYSTEM` instructions are read from its source (the notebooks' own
  parser), its worked example rebuilt as its cell builds it, from the real retrieval server's passages.
- The variants change one thing each: no worked example; 3 passages per search; shorter instructions; a second
  worked example (Japan); two examples without the newline between `</information>` and `<answer>`. Questions
  about France and Japan are left out of the data: they are the examples.
- The server's sampling seed is `--seed`: a rerun plays the same episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from areal_lite import (  # noqa: E402
    SearchAgentWorkflow,
    concat_padded_tensors,
    launch_rag_server,
    launch_server,
    load_dataset_from_config,
    load_tokenizer,
    resolve_model_path,
)
from areal_lite.api.cli_args import GRPOConfig, load_expr_config  # noqa: E402
from areal_lite.dataset.factbook import build_factbook_corpus  # noqa: E402
from areal_lite.engine.sglang_remote import RemoteSGLangEngine  # noqa: E402
from areal_lite.utils.search_tool import call_search_tool, format_search_results  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tools"))
from _machine import write_results  # noqa: E402
from build_notebooks import source_literal  # noqa: E402

NOTEBOOK = os.path.join(ROOT, "notebooks", "src", "05_search_agent.nb.md")


@dataclass
class AgentRLConfig(GRPOConfig):  # notebook 05's: the config file sets `max_turns`
    max_turns: int = field(default=8, metadata={"help": "maximum number of generations (turns) per episode"})


SHORT = "Search with <search> query </search>, then answer with <answer> answer </answer>."
EXAMPLES = (("France", "Paris"), ("Japan", "Tokyo"))
# (label, instructions, worked examples, passages per search, newline before <answer>)
VARIANTS = (
    ("instructions only, no worked example, 1 passage", "notebook", 0, 1, True),
    ("instructions + one worked example, 3 passages per search", "notebook", 1, 3, True),
    ("instructions + one worked example, 1 passage", "notebook", 1, 1, True),
    ("shorter instructions + one worked example, 1 passage", "short", 1, 1, True),
    ("shorter instructions + two worked examples, 1 passage", "short", 2, 1, True),
    ("two worked examples without the newline between `</information>` and `<answer>`", "short", 2, 1, False),
)


async def prompt(tokenizer, rag_addr: str, system: str, n_examples: int, topk: int, newline: bool) -> str:
    """The chat prompt as notebook 05 builds it: instructions, worked examples as earlier turns, `{question}`."""
    messages = [{"role": "system", "content": system}]
    for country, capital in EXAMPLES[:n_examples]:
        docs = (await call_search_tool([f"capital of {country}"], topk=topk, addr=rag_addr))[0]
        info = format_search_results(docs) + ("\n" if newline else "")
        messages += [
            {"role": "user", "content": f"What is the capital of {country}?"},
            {
                "role": "assistant",
                "content": f"<search> capital of {country} </search>{info}<answer> {capital} </answer>",
            },
        ]
    messages.append({"role": "user", "content": "{question}"})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def play(engine, rows: list, gconfig, workflow_kwargs: dict, group_size: int = 1):
    """`group_size` episodes of each row with the library's `SearchAgentWorkflow`, as one padded batch."""
    workflow = SearchAgentWorkflow(gconfig=gconfig.new(n_samples=1), **workflow_kwargs)
    return concat_padded_tensors(engine.rollout_batch(rows, workflow=workflow, group_size=group_size))


def tally(batch, tokenizer) -> dict:
    """Searched / answered shares and the mean reward of a batch of episodes (generated tokens only)."""
    searched = answered = 0
    n = batch["input_ids"].shape[0]
    for i in range(n):
        text = tokenizer.decode(batch["input_ids"][i][batch["loss_mask"][i].bool()])
        searched += "<search>" in text
        answered += "<answer>" in text and "</answer>" in text
    return {"episodes": n, "searched": searched, "answered": answered, "reward": float(batch["rewards"].mean())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=12, help="training questions played with --samples episodes")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "search_prompts.json"), help="'' for none")
    args = ap.parse_args()
    overrides = ["profile=cpu", f"seed={args.seed}", f"fileroot={tempfile.mkdtemp(prefix='search-prompts-')}"]
    path = os.path.join(ROOT, "configs/search_agent.yaml")
    config, _ = load_expr_config(["--config", path, *overrides], AgentRLConfig)

    def wanted(row):
        return row["id"].startswith("capital") and not any(c in row["question"] for c, _ in EXAMPLES)

    train = [r for r in load_dataset_from_config(config.train_dataset) if wanted(r)][: args.questions]
    held_out = [r for r in load_dataset_from_config(config.valid_dataset) if wanted(r)][: config.evaluator.size]
    tokenizer = load_tokenizer(resolve_model_path(config.tokenizer_path))
    system = {"notebook": source_literal(NOTEBOOK, "SYSTEM"), "short": SHORT}
    server, rag = launch_server(config), launch_rag_server(build_factbook_corpus(), retriever="bm25")
    engine, rows = None, []
    try:
        server.wait_ready(timeout=600)
        rag.wait_ready(timeout=300)
        engine = RemoteSGLangEngine(config.rollout)
        engine.initialize(addr=server.address)
        for label, instructions, n_examples, topk, newline in VARIANTS:
            t0 = time.time()
            template = asyncio.run(prompt(tokenizer, rag.address, system[instructions], n_examples, topk, newline))
            wf = {"tokenizer": tokenizer, "rag_addr": rag.address, "max_turns": config.max_turns, "topk": topk,
                  "prompt_template": template}  # fmt: skip
            sampled = tally(play(engine, train, config.gconfig, wf, args.samples), tokenizer)
            greedy = tally(play(engine, held_out, config.gconfig.new(greedy=True), wf), tokenizer)
            row = {"prompt": label, "prompt_tokens": len(tokenizer(template)["input_ids"]), "sampled": sampled,
                   "greedy": greedy, "seconds": time.time() - t0}  # fmt: skip
            rows.append(row)
            print(f"{label[:60]:60s} searched {sampled['searched']}/{sampled['episodes']} "
                  f"answered {sampled['answered']} F1 {sampled['reward']:.2f} | greedy F1 {greedy['reward']:.2f} "
                  f"(n={greedy['episodes']}) | {row['prompt_tokens']} prompt tokens, {row['seconds']:.0f} s",
                  flush=True)  # fmt: skip
    finally:
        if engine is not None:
            engine.destroy()
        rag.stop()
        server.stop()
    if args.json:
        write_results(args.json, "search_prompts", args, ROOT, system=system, rows=rows)
        print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
