"""`make soak`'s load + fault + crash cycle against the real servers, and what it counted.

Usage: python tools/soak.py [--seed 0] [--rounds 3] [--burst 96] [--chat-clients 24] [--keep] [--json FILE]
(`make soak` records its counts in bench/results/soak.json, with its seconds; docs/reliability.md says what runs)

Exit code 1 when a request was lost, a 5xx came back, a process outlived its parent, /dev/shm kept bytes, or a count
did not add up. Everything runs on 127.0.0.1, on free ports, started through the kit's public functions: bursts of
mixed requests, aborts, pauses and hang-ups against the embedded server, the RAG server and the chat endpoint, with
invalid bodies in each (every one must get a 4xx); then a training run SIGKILLed, as the OOM killer would, and resumed.

Design decisions
- Counting is exact: every request has a known number of answer rows, every answer is checked for shape, and each
  server's own counters must move by exactly what the clients were answered. "Lost" = sent - answered - hung up.
- Hang-ups are made countable: they are sent while the server is paused in place and hang up once the server holds
  all their rows, so it must abort exactly those rows.
- Chat completions run only in the burst without aborts or pauses: the engine re-sends a request the server
  aborted, so only there is one choice exactly one server row.
- Bounded and self-contained: a fixed seed picks every body; the tiny model, one torch thread per process; no code
  shared with tests/; every process, temp folder and /dev/shm folder it made is removed at the end (`--keep` keeps
  the temp folder with the logs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# The servers and the trainer must run this checkout's code too, installed or not (children inherit the variable).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
for _key, _value in {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
    os.environ.setdefault(_key, _value)  # nothing here may reach the network

import aiohttp  # noqa: E402
import openai  # noqa: E402
import psutil  # noqa: E402

from areal_lite import GenerationHyperparameters, InferenceEngineConfig, RemoteSGLangEngine  # noqa: E402
from areal_lite.api.cli_args import EmbeddedServerConfig  # noqa: E402
from areal_lite.dataset.factbook import build_factbook_corpus  # noqa: E402
from areal_lite.experimental.openai.proxy.server import ChatServer  # noqa: E402
from areal_lite.kit.rag import launch_rag_server  # noqa: E402
from areal_lite.kit.server.launch import launch_server  # noqa: E402
from areal_lite.kit.trainer.rundir import latest_checkpoint  # noqa: E402
from areal_lite.utils.model_store import build_tiny_model, load_tokenizer  # noqa: E402

# Where `default_weight_update_dir` puts a run's weight versions (the same rule: $USER, else the uid).
SHM_ROOT = os.path.join("/dev/shm", f"areal-lite-{os.environ.get('USER') or os.getuid()}")
GRACE_S = 10.0  # how long a dead parent's descendants get to go before they count as orphans
HEALTH_BUDGET_S = 2.0  # /health takes ~2 ms; seconds would mean work on the event loop (a loaded 2-core machine adds
# a few hundred ms at worst, when the OS gives the loop's thread no core for a while)
IDLE_BUDGET_S = 5.0  # from the last answer to nothing running, waiting or held (~0.1 s idle; margin for 2 busy cores)
HANG_UP_TOKENS = 2000  # a hung-up request cannot finish before its client hangs up
STOPS = ["\n", ".", "the", "ab", " a", "<|im_end|>"]
TEXTS = ["Count to ten:", "The capital of France is", "def add(a, b):", "Once upon a time"]
QUERIES = ["capital of Peru", "population of Japan", "largest city", "official language", "area in square km"]
USER = [{"role": "user", "content": "What is 2 + 2?"}]


# ------------------------------------------------------------------------------------------------ counting


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    hung_up: int = 0
    statuses: Counter = field(default_factory=Counter)
    problems: List[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.sent - self.answered - self.hung_up

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def answer(self, status: int, expect_ok: bool, what: str) -> bool:
        """Count one HTTP answer; a valid request must get 200, an invalid one a 4xx. True when it did."""
        self.answered += 1
        self.statuses[status] += 1
        ok = status == 200 if expect_ok else 400 <= status < 500
        if not ok:
            self.fail(f"{what}: HTTP {status}, expected {'200' if expect_ok else 'a 4xx'}")
        return ok

    def fail(self, message: str) -> None:
        self.problems.append(message)
        print(f"  FAILED: {message}", flush=True)


@dataclass
class Rows:
    """What the answers of some /generate requests carried: rows, generated tokens, rows ended by an abort."""

    rows: int = 0
    tokens: int = 0
    aborted: int = 0

    def __add__(self, other: "Rows") -> "Rows":
        return Rows(self.rows + other.rows, self.tokens + other.tokens, self.aborted + other.aborted)


def dump(value: Any) -> bytes:
    return json.dumps(value).encode()


def tree_bytes(path: str) -> int:
    """Bytes of the files under `path` (0 when it is gone)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:  # removed meanwhile
                pass
    return total


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE  # is_running also checks the start time
    except psutil.NoSuchProcess:
        return True


def survivors(procs: List[psutil.Process], grace: float = GRACE_S) -> Tuple[List[psutil.Process], float]:
    """The processes still alive after up to `grace` seconds, and how long the others took to go."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < grace and not all(gone(p) for p in procs):
        time.sleep(0.1)
    return [p for p in procs if not gone(p)], time.monotonic() - t0


# ------------------------------------------------------------------------------------------------ request bodies


def generate_body(rng: random.Random, vocab: int, rid: str, long: bool = False) -> Tuple[dict, int]:
    """A valid /generate body with varied sampling, and its number of answer rows (prompts x n)."""
    n = rng.choice([1, 1, 2, 3, 4])
    sp: dict = {"max_new_tokens": rng.randint(1, 64), "n": n, "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        sp.update(top_p=rng.choice([0.5, 0.9]), top_k=rng.choice([-1, 5, 40]))
    if rng.random() < 0.4:
        sp["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if long:
        sp.update(max_new_tokens=HANG_UP_TOKENS, ignore_eos=True, n=rng.choice([1, 2]))
    elif rng.random() < 0.3:
        sp["ignore_eos"] = True
    body: dict = {"sampling_params": sp, "return_logprob": rng.random() < 0.5}

    def prompt() -> List[int]:
        return [rng.randrange(10, vocab) for _ in range(rng.randint(2, 24))]

    pick = rng.random()
    if pick < 0.2 and not long:  # a batch: one request, prompts x n rows; the server names its rows (no rid)
        body["input_ids"] = [prompt() for _ in range(rng.randint(2, 3))]
        return body, len(body["input_ids"]) * sp["n"]
    body["rid"] = rid
    if pick < 0.35:
        body["text"] = rng.choice(TEXTS)
    else:
        body["input_ids"] = prompt()
    return body, sp["n"]


def invalid_requests(gen: str, chat: str, rag: str, key: str) -> List[Tuple[str, bytes, dict]]:
    """(url, body, headers) of requests each server must refuse with a 4xx: malformed JSON, nesting past the limit,
    wrong types and ranges, a context overflow, fields the endpoint cannot honour, a missing key."""
    deep = b"[" * 5000 + b"]" * 5000
    auth = {"Authorization": f"Bearer {key}"}
    chat_url = chat + "/v1/chat/completions"

    def chat_body(**kw) -> bytes:
        return dump({"model": "tiny", "messages": USER, **kw})

    return [
        (gen + "/generate", b"{", {}),
        (gen + "/generate", b'{"input_ids": ' + deep + b"}", {}),
        (gen + "/generate", dump({"input_ids": []}), {}),
        (gen + "/generate", dump({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}), {}),
        (gen + "/generate", dump({"input_ids": [1, 2], "sampling_params": {"n": 0}}), {}),
        (gen + "/generate", dump({"input_ids": [10**9]}), {}),
        (gen + "/generate", dump({"input_ids": [1], "sampling_params": {"frequency_penalty": 3}}), {}),
        (gen + "/pause_generation", dump({"mode": "sideways"}), {}),
        (gen + "/abort_request", dump({"rid": 5}), {}),
        (chat_url, chat_body(temperature=9), auth),
        (chat_url, chat_body(max_tokens=10**9), auth),
        (chat_url, chat_body(presence_penalty=0.5), auth),
        (chat_url, chat_body(chat_template_kwargs={"add_generation_prompt": False}), auth),
        (chat_url, b'{"messages": ' + deep + b"}", auth),
        (chat_url, chat_body(), {}),  # no session key: 401
        (rag + "/retrieve", dump({"queries": "capital of Peru"}), {}),
        (rag + "/retrieve", dump({"queries": ["x"], "topk": 0}), {}),
        (rag + "/retrieve", b"", {}),
        (rag + "/access", dump({"urls": [1]}), {}),
    ]


def check_answer(tally: Tally, body: dict, rows: int, answer: Any, what: str) -> Rows:
    """The rows of one /generate answer, each checked for shape."""
    out = answer if isinstance(answer, list) else [answer]
    if len(out) != rows:
        tally.fail(f"{what}: {len(out)} rows answered, {rows} expected")
    limit = body["sampling_params"]["max_new_tokens"]
    got = Rows(rows=len(out))
    for row in out:
        meta = row["meta_info"]
        k = meta["completion_tokens"]
        finish = (meta.get("finish_reason") or {}).get("type")
        shaped = len(row["output_ids"]) == k <= limit and finish in ("stop", "length", "abort")
        if body.get("return_logprob") and len(meta.get("output_token_logprobs") or []) != k:
            shaped = False
        if not shaped:
            tally.fail(f"{what}: a malformed row {json.dumps(row)[:300]}")
        got.tokens += k
        got.aborted += finish == "abort"
    return got


# ------------------------------------------------------------------------------------------------ load and faults

Pending = List[Tuple[asyncio.Task, int]]  # /generate requests in flight, with their number of rows


class Soak:
    """The four bursts against running servers (see the module docstring); all counts go to `tally`."""

    def __init__(self, tally: Tally, gen: str, chat: ChatServer, rag: str, args: argparse.Namespace):
        self.tally, self.gen, self.chat, self.rag, self.args = tally, gen, chat, rag, args
        self.rng = random.Random(args.seed)
        self.rids = 0
        self.idle_s: List[float] = []

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=180)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            self.http = http
            self.vocab = (await self.get(self.gen + "/model_info"))["vocab_size"]
            self.session = self.chat.open_session()  # the key of the invalid chat requests
            try:
                for round_ in range(1, self.args.rounds + 1):
                    print(f" round {round_} of {self.args.rounds}", flush=True)
                    for burst in (self.mixed, self.aborts, self.pauses, self.hang_ups):
                        await self.timed(burst)
            finally:
                self.chat.close_session(self.session.api_key)

    async def timed(self, burst: Callable) -> None:
        """Run one burst while /health is probed every 50 ms: the loop must stay free while the burst runs."""
        slowest = 0.0

        async def probe() -> None:
            nonlocal slowest
            while True:
                t0 = time.perf_counter()
                async with self.http.get(self.gen + "/health") as r:
                    if r.status != 200:
                        self.tally.fail(f"/health answered {r.status} during a burst")
                slowest = max(slowest, time.perf_counter() - t0)
                await asyncio.sleep(0.05)

        t0 = time.perf_counter()
        prober = asyncio.create_task(probe())
        try:
            await burst()
        finally:
            prober.cancel()
        if slowest > HEALTH_BUDGET_S:
            self.tally.fail(f"/health took {slowest:.2f} s during a burst")
        print(f"    {time.perf_counter() - t0:.1f} s; /health answered within {slowest * 1000:.0f} ms", flush=True)

    # -------------------------------------------------------------------------------------------- HTTP

    async def get(self, url: str) -> dict:
        async with self.http.get(url) as r:
            return await r.json()

    async def post(self, url: str, raw: bytes, expect_ok: bool, headers: Optional[dict] = None,
                   http: Optional[aiohttp.ClientSession] = None) -> Optional[Any]:  # fmt: skip
        """One counted POST; the JSON answer of a 200, else None. A cancelled call (a hang-up) is not answered."""
        self.tally.sent += 1
        what = f"POST {url.split('/', 3)[-1]} {raw[:80]!r}"
        try:
            async with (http or self.http).post(url, data=raw, headers={"Content-Type": "application/json",
                                                                       **(headers or {})}) as r:  # fmt: skip
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.tally.fail(f"{what}: no answer ({type(e).__name__}: {e})")
            return None
        if self.tally.answer(r.status, expect_ok, what) and expect_ok:
            return json.loads(text) if text.strip() else {}
        return None

    async def control(self, path: str, body: dict) -> None:
        await self.post(self.gen + path, dump(body), expect_ok=True)

    async def info(self) -> dict:
        return await self.get(self.gen + "/server_info")

    async def until(self, ready: Callable[[dict], bool], what: str, timeout: float = 60) -> dict:
        """Poll /server_info until `ready(info)`: the soak waits on the server's state, never on a guess."""
        deadline = time.monotonic() + timeout
        while True:
            info = await self.info()
            if ready(info):
                return info
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server never reached: {what} (last /server_info: {info})")
            await asyncio.sleep(0.01)

    # -------------------------------------------------------------------------------------------- requests

    def launch(self, k: int, long: bool = False, http: Optional[aiohttp.ClientSession] = None) -> Pending:
        """Start `k` /generate requests with varied bodies; each task returns the `Rows` of its answer."""
        pending = []
        for _ in range(k):
            self.rids += 1
            body, rows = generate_body(self.rng, self.vocab, f"soak-{self.rids}", long)
            pending.append((asyncio.create_task(self.generate(body, rows, http)), rows))
        return pending

    async def generate(self, body: dict, rows: int, http: Optional[aiohttp.ClientSession]) -> Rows:
        answer = await self.post(self.gen + "/generate", dump(body), expect_ok=True, http=http)
        return Rows() if answer is None else check_answer(self.tally, body, rows, answer, f"/generate {body}"[:200])

    def invalid(self) -> List[Tuple[str, bytes, dict]]:
        return invalid_requests(self.gen, self.chat.base_url[: -len("/v1")], self.rag, self.session.api_key)

    def sprinkle(self) -> List[asyncio.Task]:
        """Every invalid request of `invalid_requests`, in flight alongside the burst."""
        return [asyncio.create_task(self.post(url, raw, False, headers)) for url, raw, headers in self.invalid()]

    async def rag_retrieve(self) -> None:
        body = {"queries": self.rng.sample(QUERIES, self.rng.randint(1, 3)), "topk": self.rng.randint(1, 5)}
        answer = await self.post(self.rag + "/retrieve", dump(body), expect_ok=True)
        if answer is not None and len(answer.get("result", [])) != len(body["queries"]):
            self.tally.fail(f"/retrieve {body}: {answer!r:.200}")

    async def settle(self, name: str, before: dict, got: Rows, exact: bool = True) -> dict:
        """Wait until nothing runs, waits or is held; the server's counters must match what was answered."""
        t0 = time.perf_counter()
        idle = lambda i: i["num_running"] == i["num_waiting"] == i["num_held"] == 0 and not i["paused"]  # noqa: E731
        after = await self.until(idle, "idle", timeout=60)
        took = time.perf_counter() - t0
        self.idle_s.append(took)
        if took > IDLE_BUDGET_S:
            self.tally.fail(f"{name}: {took:.2f} s from the last answer until the server was idle")
        delta = {k: after[k] - before[k] for k in ("finished_requests", "aborted_requests", "generated_tokens")}
        ended, made = delta["finished_requests"] + delta["aborted_requests"], delta["generated_tokens"]
        problems = len(self.tally.problems)
        if ended != got.rows:
            self.tally.fail(f"{name}: the server ended {ended} rows, the clients account for {got.rows}")
        if made != got.tokens if exact else made < got.tokens:
            self.tally.fail(f"{name}: the server generated {made} tokens, the answers carry {got.tokens}")
        verdict = "counters add up" if len(self.tally.problems) == problems else "counters DO NOT add up"
        print(f"  {name}: {ended} rows ended on the server ({delta['aborted_requests']} aborted), {made} tokens: "
              f"{verdict}; idle {took:.2f} s after the last answer", flush=True)  # fmt: skip
        return delta

    # -------------------------------------------------------------------------------------------- bursts

    async def gather_rows(self, pending: Pending) -> Rows:
        return sum(await asyncio.gather(*(task for task, _ in pending)), Rows())

    async def mixed(self) -> None:
        """/generate, chat completions through the openai SDK and RAG queries at once, invalid bodies among them."""
        before, chat_before = await self.info(), self.chat.stats()
        served = (await self.get(self.rag + "/health"))["served"]["retrieve"]
        pending = self.launch(self.args.burst)
        chats = [asyncio.create_task(self.chat_client(i)) for i in range(self.args.chat_clients)]
        rags = [asyncio.create_task(self.rag_retrieve()) for _ in range(self.args.burst // 3)]
        bad = self.sprinkle()
        got = await self.gather_rows(pending)
        choices = await asyncio.gather(*chats)
        await asyncio.gather(*rags, *bad)
        chat_rows = Rows(rows=sum(c for c, _ in choices), tokens=sum(t for _, t in choices))
        await self.settle("mixed burst", before, got + chat_rows)
        chat_after = self.chat.stats()
        n_bad = sum("/v1/chat/" in url for url, _, _ in self.invalid())
        want = {"requests": 2 * len(chats) + n_bad, "completions": chat_rows.rows, "errors": n_bad}
        seen = {k: chat_after[k] - chat_before[k] for k in want}
        if seen != want:
            self.tally.fail(f"chat endpoint: its stats moved by {seen}, the clients account for {want}")
        now = (await self.get(self.rag + "/health"))["served"]["retrieve"]
        if now - served != len(rags):
            self.tally.fail(f"RAG server: served {now - served} /retrieve, {len(rags)} were answered")
        print(f"  mixed burst: {len(chats)} chat clients, {chat_rows.rows} choices, {seen['errors']} chat errors "
              f"(the invalid ones); {now - served} RAG queries served", flush=True)  # fmt: skip

    async def chat_client(self, index: int) -> Tuple[int, int]:
        """An agent-like client: its own session, two turns through the openai SDK; (choices, completion tokens)."""
        session = self.chat.open_session()
        client = openai.AsyncOpenAI(base_url=self.chat.base_url, api_key=session.api_key, max_retries=0, timeout=180)
        messages = [{"role": "user", "content": f"What is {index} + 1?"}]
        choices = tokens = 0
        try:
            for _ in range(2):
                rng = self.rng
                kw = dict(model="tiny", messages=messages, max_tokens=rng.randint(1, 16), n=rng.choice([1, 1, 2]),
                          temperature=rng.choice([0.0, 0.8]), logprobs=rng.random() < 0.3)  # fmt: skip
                if rng.random() < 0.3:
                    kw["stop"] = ["\n"]
                reply = await self.chat_turn(client, kw, stream=rng.random() < 0.3)
                if reply is None:
                    continue
                content, n, used = reply
                choices, tokens = choices + n, tokens + used
                messages = [*messages, {"role": "assistant", "content": content}, {"role": "user", "content": "Why?"}]
        finally:
            await client.close()
            self.chat.close_session(session.api_key)
        return choices, tokens

    async def chat_turn(self, client: openai.AsyncOpenAI, kw: dict, stream: bool) -> Optional[Tuple[str, int, int]]:
        """One counted completion: (first choice's text, choices, completion tokens), or None when refused."""
        self.tally.sent += 1
        what = f"chat completion {kw['n']=} {stream=}"
        try:
            if stream:
                texts: dict = {}
                usage = None
                events = await client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
                async for chunk in events:
                    for c in chunk.choices:
                        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                    usage = chunk.usage or usage
                content, n, used = texts.get(0, ""), len(texts), usage.completion_tokens if usage else -1
            else:
                out = await client.chat.completions.create(**kw)
                content, n, used = out.choices[0].message.content or "", len(out.choices), out.usage.completion_tokens
        except openai.APIStatusError as e:
            self.tally.answer(e.status_code, True, f"{what}: {e}")
            return None
        except openai.APIError as e:  # no answer: a connection error or a timeout
            self.tally.fail(f"{what}: no answer ({type(e).__name__}: {e})")
            return None
        self.tally.answer(200, True, what)
        if n != kw["n"] or used < 0:
            self.tally.fail(f"{what}: {n} choices, usage {used}")
        return content, n, used

    async def aborts(self) -> None:
        """Abort some requests by rid, then all, while the burst runs; a second wave follows. Every aborted request
        is answered, with finish_reason abort and the tokens made so far."""
        before = await self.info()
        bad = self.sprinkle()
        first = self.launch(self.args.burst)
        await self.until(lambda i: i["num_running"] >= 4 or all(t.done() for t, _ in first), "4 rows running")
        victims = [f"soak-{self.rids - k}" for k in range(0, len(first), 6)]  # a name of a batch request: a no-op
        await asyncio.gather(*(self.control("/abort_request", {"rid": rid}) for rid in victims))
        await asyncio.sleep(0.05)
        await self.control("/abort_request", {"abort_all": True})
        second = self.launch(self.args.burst // 2)
        got = await self.gather_rows(first + second)
        await asyncio.gather(*bad)
        await self.settle(f"abort burst ({len(victims)} by rid, then all)", before, got)
        if got.aborted == 0:
            self.tally.fail("abort burst: no request was aborted (the burst ended before the aborts)")

    async def pauses(self) -> None:
        """Pause in each mode while a wave runs, send more while paused (all must be held), continue."""
        before = await self.info()
        bad = self.sprinkle()
        pending: Pending = []
        for mode in ("abort", "retract", "in_place"):
            pending += await self.pause_once(mode)
        got = await self.gather_rows(pending)
        await asyncio.gather(*bad)
        await self.settle("pause burst (abort, retract, in_place)", before, got)

    async def pause_once(self, mode: str) -> Pending:
        wave = self.launch(self.args.burst // 3)
        await self.until(lambda i: i["num_running"] > 0 or all(t.done() for t, _ in wave), "a row running")
        await self.control("/pause_generation", {"mode": mode})
        held = (await self.info())["num_held"]
        late = self.launch(4)
        rows = sum(r for _, r in late)
        await self.until(lambda i: i["num_held"] >= held + rows, f"{rows} more rows held while paused ({mode})")
        await asyncio.sleep(0.1)  # paused a while: nothing may be lost meanwhile
        await self.control("/continue_generation", {})
        return wave + late

    async def hang_ups(self) -> None:
        """Clients that close their connection mid-request: the server must abort exactly their rows."""
        before = await self.info()
        bad = self.sprinkle()
        await self.control("/pause_generation", {"mode": "in_place"})
        # Their own connections, closed on cancellation: a hang-up must not be a pooled connection left open.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as quitters:
            kept = self.launch(self.args.burst // 2)
            hung = self.launch(self.args.burst // 4, long=True, http=quitters)
            rows = sum(r for _, r in kept + hung)
            await self.until(lambda i: i["num_held"] == rows, f"all {rows} rows held")
            await self.control("/continue_generation", {})
            await self.until(lambda i: i["num_running"] > 0, "rows running")
            await asyncio.sleep(0.2)
            for task, _ in hung:
                task.cancel()
            await asyncio.gather(*(task for task, _ in hung), return_exceptions=True)
        cancelled = [r for task, r in hung if task.cancelled()]
        self.tally.hung_up += len(cancelled)
        got = await self.gather_rows(kept)
        got = got + sum((task.result() for task, _ in hung if not task.cancelled()), Rows())
        await asyncio.gather(*bad)
        delta = await self.settle(f"hang-up burst ({len(cancelled)} clients hung up)", before,
                                  got + Rows(rows=sum(cancelled)), exact=False)  # fmt: skip
        if delta["aborted_requests"] != sum(cancelled) + got.aborted:
            self.tally.fail(f"hang-ups: the server aborted {delta['aborted_requests']} rows, "
                            f"{sum(cancelled)} were hung up")  # fmt: skip


def run_load(model: str, work: str, tally: Tally, args: argparse.Namespace) -> int:
    """Start the three servers, run the bursts, stop everything; the number of processes that outlived the stop."""
    me = psutil.Process()
    server = rag = engine = chat = None
    try:
        server = launch_server(EmbeddedServerConfig(model_path=model, threads=1), backend="embedded",
                               log_dir=os.path.join(work, "logs"))  # fmt: skip
        corpus = build_factbook_corpus(os.path.join(work, "factbook4.jsonl"), max_countries=4)
        rag = launch_rag_server(corpus, retriever="bm25")
        server.wait_ready(timeout=180)
        rag.wait_ready(timeout=180)
        cfg = InferenceEngineConfig(max_concurrent_rollouts=64, consumer_batch_size=2, max_head_offpolicyness=10_000)
        engine = RemoteSGLangEngine(cfg).initialize(addr=server.address)
        gconfig = GenerationHyperparameters(max_new_tokens=16)
        chat = ChatServer(engine, load_tokenizer(model), gconfig, model="tiny").start()
        rss = psutil.Process(server.pid).memory_info().rss
        asyncio.run(Soak(tally, server.url, chat, rag.url, args).run())
        grown = psutil.Process(server.pid).memory_info().rss - rss  # reported, not judged: allocator caches grow
        print(
            f"  inference server memory: {rss / 1e6:.0f} MB before the bursts, {grown / 1e6:+.0f} MB after", flush=True
        )
    finally:
        children = me.children(recursive=True)  # the servers and whatever they started
        for stop in (chat and chat.stop, engine and engine.destroy, rag and rag.stop, server and server.stop):
            if stop:
                stop()
        left, took = survivors(children)
        print(f"  servers stopped: {len(children)} child processes, {len(left)} left after {took:.1f} s", flush=True)
        for p in left:
            p.kill()
        if rag is not None and not args.keep:
            os.unlink(rag.log_path)  # its log is in the system's temp folder, not in `work`
    return len(left)


# ------------------------------------------------------------------------------------------------ the crash


def train_cmd(model: str, fileroot: str, experiment: str, steps: int) -> List[str]:
    """The demo config shrunk to the tiny model: 2 prompts x 2 samples x 4 tokens a step, a checkpoint each step."""
    overrides = {
        "actor.path": model, "tokenizer_path": model, "fileroot": fileroot, "experiment_name": experiment,
        "total_train_steps": steps, "valid_dataset": "null", "gconfig.max_new_tokens": 4, "gconfig.n_samples": 2,
        "train_dataset.batch_size": 2, "saver.freq_steps": 1, "actor.threads": 1, "embedded.threads": 1,
    }  # fmt: skip
    config = os.path.join(ROOT, "configs", "arith_grpo_demo.yaml")
    return [
        sys.executable,
        "-m",
        "areal_lite.kit.trainer.train",
        "--config",
        config,
        *(f"{k}={v}" for k, v in overrides.items()),
    ]


def crash_ready(proc: subprocess.Popen, run_dir: str, shm_dir: str) -> bool:
    """The trainer has a reward pool (a forkserver with workers), a checkpoint and a weight version in /dev/shm. Any
    checkpoint: the trainer keeps only the last few (`saver.keep_last`), so a step's may be gone before a poll."""
    if proc.poll() is not None:
        raise RuntimeError(f"the training run exited with {proc.returncode} before it could be killed")
    ckpts = os.path.join(run_dir, "checkpoints")
    if not (os.path.isdir(ckpts) and any(d.startswith("step_") for d in os.listdir(ckpts))):
        return False
    if not any("weight_update_v" in n for _, dirs, files in os.walk(shm_dir) for n in dirs + files):
        return False
    kids = psutil.Process(proc.pid).children(recursive=True)
    return any("forkserver" in " ".join(k.cmdline()) and k.children() for k in kids)


def last_checkpoint(run_dir: str) -> int:
    """The step `--resume` restores, by the kit's own rule (`latest_checkpoint`); read once the trainer is dead, since
    that lookup also recovers a step folder a crash left renamed aside."""
    return int(os.path.basename(latest_checkpoint(os.path.join(run_dir, "checkpoints")))[len("step_") :])


def crash_and_resume(model: str, work: str, tally: Tally) -> Tuple[int, int]:
    """SIGKILL a training run mid-way, count its orphans, resume it to the end: (orphans, /dev/shm bytes left)."""
    experiment = f"soak-{uuid.uuid4().hex[:8]}"  # its own /dev/shm folder: other runs on this machine are not ours
    run_dir = os.path.join(work, experiment, "run0")  # the demo config's trial name
    shm_dir = os.path.join(SHM_ROOT, experiment)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(os.path.join(work, "killed.log"), "w") as log:
        proc = subprocess.Popen(train_cmd(model, work, experiment, 500), env=env, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    descendants: List[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while not crash_ready(proc, run_dir, shm_dir):
            if time.monotonic() > deadline:
                raise RuntimeError("the training run had no checkpoint, weight version and reward pool after 300 s")
            time.sleep(0.2)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        at_kill = tree_bytes(shm_dir)
        proc.send_signal(signal.SIGKILL)  # no atexit, no finally, no finalizer runs in the trainer
        proc.wait(timeout=30)
        left, took = survivors(descendants)
        step = last_checkpoint(run_dir)
        print(f"  trainer SIGKILLed after checkpoint {step} with {len(descendants)} descendants and "
              f"{at_kill / 1e6:.1f} MB in {shm_dir}; {len(left)} alive after {took:.1f} s", flush=True)  # fmt: skip
        for p in left:
            tally.fail(f"orphan: pid {p.pid} {' '.join(p.cmdline())[:200]}")
        cmd = [*train_cmd(model, work, experiment, step + 2), "--resume"]
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        if out.returncode != 0 or f"at step {step}" not in out.stdout:
            tally.fail(f"--resume exited with {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        shm_left = tree_bytes(shm_dir)
        print(
            f"  --resume from step {step} ran to step {step + 2} (exit {out.returncode}); "
            f"{shm_left} bytes left in {shm_dir}{'' if os.path.exists(shm_dir) else ' (gone)'}",
            flush=True,
        )
        return len(left), shm_left
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in descendants:
            if not gone(p):
                p.kill()
        shutil.rmtree(shm_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ main


def report(tally: Tally, orphans: int, shm_left: int, elapsed: float) -> dict:
    """Prints the counts, one a line; returns them, with "passed" False when any is off."""
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items()))
    print(f"\nrequests sent {tally.sent} / answered {tally.answered} / hung up by the client {tally.hung_up} / "
          f"lost {tally.lost}   (HTTP status: {statuses})")  # fmt: skip
    print(f"5xx: {tally.server_errors}")
    print(f"orphans: {orphans}")
    print(f"/dev/shm bytes left: {shm_left}")
    print(f"checks failed: {len(tally.problems)}")
    for problem in tally.problems:
        print(f"  - {problem[:500]}")
    ok = tally.lost == tally.server_errors == orphans == shm_left == len(tally.problems) == 0
    print(f"soak {'passed' if ok else 'FAILED'} in {elapsed:.0f} s")
    return {"sent": tally.sent, "answered": tally.answered, "hung_up": tally.hung_up, "lost": tally.lost,
            "statuses": {str(k): n for k, n in sorted(tally.statuses.items())}, "server_errors": tally.server_errors,
            "orphans": orphans, "shm_bytes_left": shm_left, "checks_failed": len(tally.problems), "passed": ok,
            "seconds": round(elapsed, 1)}  # fmt: skip


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="picks every request body")
    p.add_argument("--rounds", type=int, default=3, help="times the four bursts run, each time with new bodies")
    p.add_argument("--burst", type=int, default=96, help="/generate requests in a burst's first wave")
    p.add_argument("--chat-clients", type=int, default=24, help="openai SDK clients in the mixed burst (2 turns each)")
    p.add_argument("--keep", action="store_true", help="keep the temp folder (logs, the run folder)")
    p.add_argument("--json", default="", help="write the counts there, with the date, commit and CPU (bench/_machine)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    tally = Tally()
    work = tempfile.mkdtemp(prefix="areal-lite-soak-")
    try:
        model = build_tiny_model(os.path.join(work, "tiny-qwen2"), seed=0)
        print("load + faults: embedded server, RAG server, chat endpoint", flush=True)
        orphans = run_load(model, work, tally, args)
        print("crash: SIGKILL a training run, then --resume it", flush=True)
        crash_orphans, shm_left = crash_and_resume(model, work, tally)
    except Exception as e:  # a server that did not start, a run that never got ready: a failed soak, with why
        tally.fail(f"{type(e).__name__}: {e}")
        orphans, crash_orphans, shm_left = 0, 0, 0
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    counts = report(tally, orphans + crash_orphans, shm_left, time.monotonic() - t0)
    if args.json:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        from _machine import write_results

        write_results(args.json, "soak", args, ROOT, counts=counts)
    return 0 if counts["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
