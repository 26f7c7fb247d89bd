"""Tool exploration before training: how often SmolLM2-135M-Instruct calls a calculator it is offered.

    PYTHONPATH=. .venv/bin/python bench/tool_exploration.py [--problems 16] [--samples 4] [--temperature 1.0]
        [--seed 1] [--max-tokens 24]

The workload is `load_products("test", size=--problems)` ("What is 37 * 48?"), `--samples` completions per
problem (one chat request with `n=--samples`), `--max-tokens` tokens each, through the kit's real OpenAI endpoint
(`ChatServer` in front of the embedded server of `configs/arith_grpo_demo.yaml`). Rows: each tool syntax
("hermes": `<tool_call>{json}</tool_call>`, "compact": `<calculator>12 * 34</calculator>`) with 0, 1 or 2 worked
examples given as OpenAI chat turns before the question, plus "unaided" (no tools, no examples). Printed per row:
episodes that called the tool / episodes, calls with the right arguments ("a * b" or "b * a", spaces ignored),
tool parse failures (the server's `stats()` difference), accuracy of the unaided answers, and seconds.

Design decisions
- Only the first turn is generated: whether the model calls the tool is decided there, so tool results are never
  sent back and no calculator runs.
- An example is four messages: the question, an assistant message with an empty content and one `calculator`
  tool call, a `role="tool"` message with the product, and the product as the assistant's answer. The server
  renders them in its syntax, so both syntaxes see the same conversation.
- The default 24 tokens is shorter than a well-formed Hermes call of SmolLM2's tokenizer (34 tokens for the
  `calculator` call of "37 * 48" with its JSON between `<tool_call>` lines; the compact call is 14): at 24 a Hermes
  call that starts is cut and counted as a parse failure. `--max-tokens 40` separates the syntax from the budget.
- One `ChatServer` per syntax over one engine; all problems of a row are sent at once (the embedded server batches
  them), one session per row. The server's sampling seed is `--seed`, so reruns are close, not identical
  (batching order varies).
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
from areal_lite.reward.gsm8k import gsm8k_reward_fn  # noqa: E402

EXAMPLE_FACTORS = [(12, 34), (56, 78)]
ROW = "{:<8} {:>8} {:>8} {:>10} {:>10} {:>8} {:>6}"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def examples(k: int) -> list[dict]:
    """The first `k` worked examples as OpenAI chat turns (see the module docstring)."""
    out = []
    for i, (a, b) in enumerate(EXAMPLE_FACTORS[:k]):
        args = json.dumps({"expression": f"{a} * {b}"})
        call = {"id": f"call_ex{i}", "type": "function", "function": {"name": "calculator", "arguments": args}}
        out += [
            {"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_ex{i}", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ]
    return out


def right_call(call, a: int, b: int) -> bool:
    try:
        expr = str(json.loads(call.function.arguments).get("expression", ""))
    except (ValueError, AttributeError):
        return False
    return call.function.name == "calculator" and expr.replace(" ", "") in (f"{a}*{b}", f"{b}*{a}")


def run_row(chat: ChatServer, problems: list[dict], n_examples, args) -> dict:
    """One row: every problem once with `n=args.samples`; None examples means unaided (no tools)."""
    session, before, t0 = chat.open_session(), chat.stats(), time.time()
    client = openai.OpenAI(base_url=chat.base_url, api_key=session.api_key, max_retries=0, timeout=1800)
    tools = {} if n_examples is None else {"tools": TOOLS}
    prefix = [] if n_examples is None else examples(n_examples)

    def ask(p):
        msgs = prefix + [{"role": "user", "content": p["question"]}]
        return client.chat.completions.create(
            model="m", messages=msgs, n=args.samples, temperature=args.temperature, max_tokens=args.max_tokens, **tools
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
            row["correct"] += gsm8k_reward_fn(p["question"], text, None, None, answer=p["answer"]) > 0
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
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    overrides = [f"seed={args.seed}", f"fileroot={tempfile.mkdtemp(prefix='tool-exploration-')}"]
    config, _ = load_expr_config(
        ["--config", os.path.join(ROOT, "configs/arith_grpo_demo.yaml"), *overrides], GRPOConfig
    )
    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    problems = list(load_products("test", size=args.problems))
    server = launch_server(config)
    engine = chats = None
    try:
        server.wait_ready(timeout=600)
        engine = RemoteSGLangEngine(config.rollout)
        engine.initialize(addr=server.address)
        chats = {s: ChatServer(engine, tokenizer, config.gconfig, tool_syntax=s).start() for s in ("hermes", "compact")}
        rows = [("unaided", "-", None)] + [(s, str(k), k) for s in chats for k in (0, 1, 2)]
        print(ROW.format("syntax", "examples", "calls", "right args", "parse fail", "accuracy", "s"))
        for syntax, label, k in rows:
            r = run_row(chats["hermes" if k is None else syntax], problems, k, args)
            acc = f"{r['correct'] / r['episodes']:.2f}" if k is None else "-"
            calls = f"{r['calls']}/{r['episodes']}"
            print(ROW.format(syntax, label, calls, r["right"], r["failures"], acc, f"{r['seconds']:.1f}"), flush=True)
    finally:
        for chat in (chats or {}).values():
            chat.stop()
        if engine is not None:
            engine.destroy()
        server.stop()


if __name__ == "__main__":
    main()
