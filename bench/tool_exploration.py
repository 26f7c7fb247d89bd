"""Tool exploration before training: how often SmolLM2-135M-Instruct calls a calculator it is offered.

    PYTHONPATH=. .venv/bin/python bench/tool_exploration.py [--problems 16] [--samples 4] [--temperature 1.0]
        [--seed 1] [--max-tokens 24,40] [--json bench/results/tool_exploration.json]

The workload is `load_products("test", size=--problems)` ("What is 37 * 48?"), `--samples` completions per problem
(one chat request with `n=--samples`) of each `--max-tokens` budget, through the kit's OpenAI endpoint (`ChatServer`
in front of the embedded server of `configs/arith_grpo_demo.yaml`). Rows: each tool syntax (Hermes
`<tool_call>{json}</tool_call>`, compact `<calculator>12 * 34</calculator>`) with 0, 1 or 2 worked examples, plus
"unaided" (no tools, no examples). Per row: episodes that called the tool, calls with the right arguments ("a * b"
or "b * a"), tool parse failures (the server's `stats()`), the unaided answers' accuracy, seconds.

Design decisions
- Notebook 09's own `TOOLS` and worked example (read from its source, `notebooks/src/09_openai_agent.nb.md`): the
  table in the notebook is this bench's, so the model must see what the notebook's agent shows it. A second example
  is the same conversation for 56 * 78.
- Only the first turn is generated: whether the model calls the tool is decided there.
- At 24 tokens a Hermes call (34 tokens for "37 * 48") is cut and counted as a parse failure; 40 separates the
  syntax from the budget. The server's sampling seed is `--seed` (a rerun gives the same table).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import openai  # noqa: E402

from areal_lite import launch_server, load_products, load_tokenizer, resolve_model_path  # noqa: E402
from areal_lite.api.cli_args import GRPOConfig, load_expr_config  # noqa: E402
from areal_lite.engine.sglang_remote import RemoteSGLangEngine  # noqa: E402
from areal_lite.experimental.openai.proxy.server import ChatServer  # noqa: E402
from areal_lite.reward.arithmetic import arithmetic_reward_fn  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tools"))
from _machine import write_results  # noqa: E402
from build_notebooks import source_literal  # noqa: E402

EXAMPLE_FACTORS = [(12, 34), (56, 78)]  # the notebook's worked example, then a second one like it
ROW = "{:<8} {:>8} {:>8} {:>10} {:>10} {:>8} {:>6}"
NOTEBOOK = os.path.join(ROOT, "notebooks", "src", "09_openai_agent.nb.md")


def examples(k: int) -> list[dict]:
    """The first `k` worked examples as OpenAI chat turns, the notebook's `WORKED_EXAMPLE` first."""
    out = []
    for i, (a, b) in enumerate(EXAMPLE_FACTORS[:k]):
        call_id = "call_example" if i == 0 else f"call_example{i}"
        args = json.dumps({"expression": f"{a} * {b}"})
        call = {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": args}}
        out += [
            {"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ]
    return out


def right_call(call, a: int, b: int) -> bool:
    try:
        expr = str(json.loads(call.function.arguments).get("expression", ""))
    except (ValueError, AttributeError):
        return False
    return call.function.name == "calculator" and expr.replace(" ", "") in (f"{a}*{b}", f"{b}*{a}")


def run_row(chat: ChatServer, problems: list[dict], n_examples, max_tokens: int, tools: list, args) -> dict:
    """One row: every problem once with `n=args.samples`; None examples means unaided (no tools)."""
    session, before, t0 = chat.open_session(), chat.stats(), time.time()
    client = openai.OpenAI(base_url=chat.base_url, api_key=session.api_key, max_retries=0, timeout=1800)
    offered = {} if n_examples is None else {"tools": tools}
    prefix = [] if n_examples is None else examples(n_examples)

    def ask(p):
        msgs = prefix + [{"role": "user", "content": p["question"]}]
        return client.chat.completions.create(
            model="m", messages=msgs, n=args.samples, temperature=args.temperature, max_tokens=max_tokens, **offered
        )

    with concurrent.futures.ThreadPoolExecutor(len(problems)) as pool:
        replies = list(pool.map(ask, problems))
    row = {"episodes": 0, "calls": 0, "right": 0, "correct": 0}
    for p, reply in zip(problems, replies):
        a, b = map(int, re.findall(r"\d+", p["question"])[:2])
        for choice in reply.choices:
            calls = choice.message.tool_calls or []
            row["episodes"] += 1
            row["calls"] += bool(calls)
            row["right"] += any(right_call(c, a, b) for c in calls)
            text = choice.message.content or ""
            row["correct"] += arithmetic_reward_fn(p["question"], text, None, None, answer=p["answer"]) > 0
    row["failures"] = chat.stats()["tool_parse_failures"] - before["tool_parse_failures"]
    row["seconds"] = time.time() - t0
    chat.close_session(session.api_key)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", default="24,40", help="comma-separated token budgets, a table each")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "tool_exploration.json"),
                    help="'' for none")  # fmt: skip
    args = ap.parse_args()
    budgets = [int(b) for b in args.max_tokens.split(",")]
    overrides = [f"seed={args.seed}", f"fileroot={tempfile.mkdtemp(prefix='tool-exploration-')}"]
    config, _ = load_expr_config(
        ["--config", os.path.join(ROOT, "configs/arith_grpo_demo.yaml"), *overrides], GRPOConfig
    )
    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    problems = list(load_products("test", size=args.problems))
    tools = source_literal(NOTEBOOK, "TOOLS")
    server = launch_server(config)
    engine = chats = None
    tables = {}
    try:
        server.wait_ready(timeout=600)
        engine = RemoteSGLangEngine(config.rollout)
        engine.initialize(addr=server.address)
        chats = {s: ChatServer(engine, tokenizer, config.gconfig, tool_syntax=s).start() for s in ("hermes", "compact")}
        plan = [("unaided", None)] + [(s, k) for s in chats for k in (0, 1, 2)]
        for budget in budgets:
            print(f"== {budget} tokens")
            print(ROW.format("syntax", "examples", "calls", "right args", "parse fail", "accuracy", "s"))
            rows = tables[str(budget)] = []
            for syntax, k in plan:
                r = run_row(chats["hermes" if k is None else syntax], problems, k, budget, tools, args)
                rows.append({"syntax": syntax, "examples": k, **r})
                acc = f"{r['correct'] / r['episodes']:.2f}" if k is None else "-"
                calls, label = f"{r['calls']}/{r['episodes']}", "-" if k is None else str(k)
                print(
                    ROW.format(syntax, label, calls, r["right"], r["failures"], acc, f"{r['seconds']:.1f}"), flush=True
                )
    finally:
        for chat in (chats or {}).values():
            chat.stop()
        if engine is not None:
            engine.destroy()
        server.stop()
    if args.json:
        write_results(args.json, "tool_exploration", args, ROOT, tools=tools, tables=tables)
        print(f"results: {args.json}")


if __name__ == "__main__":
    main()
