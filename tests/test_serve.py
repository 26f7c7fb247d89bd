"""Tests of the embedded SGLang-compatible server: real server processes on the tiny model, plus in-process checks
of the batching and sampling pieces against plain forward passes."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import json
import logging
import platform
import random
import statistics
import threading
import time
import urllib.error
import urllib.request
import warnings

import pytest
import torch
from test_procs import wait_until  # one copy of the polling helper

from areal_lite.api.cli_args import EmbeddedServerConfig
from areal_lite.kit.server import sampling
from areal_lite.kit.server.batch import RunningBatch, prefill_distinct, prefill_groups
from areal_lite.kit.server.cli import build_parser, parse_args
from areal_lite.kit.server.protocol import GenerationState, SamplingParams, parse_generate_body
from areal_lite.kit.server.sampling import RowSeeds, draw, sample_tokens
from areal_lite.utils.jsonhttp import BadRequest

PROMPTS = [[11, 12, 13, 14, 15], [200, 201], [3000, 17, 99, 512, 7, 8, 9, 10, 1000], [42]]


# ----------------------------------------------------------------------------------------------------------------
# tiny HTTP client


def call(addr: str, path: str, body=None, method: str | None = None, raw: bytes | None = None, timeout: float = 60):
    """(status, parsed JSON or text) of one HTTP request; 4xx/5xx are returned, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(
        f"http://{addr}{path}", data=data, method=method or ("GET" if data is None else "POST")
    )
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text) if text else None
    except ValueError:
        return status, text


def generate(addr: str, body: dict, timeout: float = 60):
    status, out = call(addr, "/generate", body, timeout=timeout)
    assert status == 200, out
    return out


def greedy(ids, n_tokens=12, **extra):
    sp = {"max_new_tokens": n_tokens, "temperature": 0.0, **extra.pop("sp", {})}
    return {"input_ids": ids, "sampling_params": sp, "return_logprob": True, **extra}


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server.address


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


def forward_logprobs(model, prompt, output, temperature=1.0):
    """log_softmax(logits / T) of each output token, from one plain forward pass over prompt + output."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(1, torch.tensor(output)[:, None]).flatten()


# ----------------------------------------------------------------------------------------------------------------
# endpoints and shapes


def test_health_model_info(server):
    assert call(server, "/health")[0] == 200
    assert call(server, "/health_generate")[0] == 200
    for path in ("/model_info", "/get_model_info"):
        status, info = call(server, path)
        assert status == 200
        assert {"model_path", "tokenizer_path", "is_generation", "weight_version"} <= set(info)
        assert info["is_generation"] is True and isinstance(info["weight_version"], str)
        assert info["vocab_size"] > 0 and info["max_context_length"] > 0
    status, stats = call(server, "/server_info")
    assert status == 200 and "max_running_batch" in stats and stats["paused"] is False


def test_generate_shapes(server, tiny):
    _, tok = tiny
    one = generate(server, greedy(PROMPTS[0], 5, rid="r-single"))
    assert isinstance(one, dict) and set(one) >= {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["id"] == "r-single"
    assert meta["finish_reason"] in ({"type": "length", "length": 5},) or meta["finish_reason"]["type"] == "stop"
    assert meta["prompt_tokens"] == len(PROMPTS[0]) and meta["completion_tokens"] == len(one["output_ids"])
    assert meta["cached_tokens"] == 0 and isinstance(meta["weight_version"], str) and meta["e2e_latency"] > 0
    lps = meta["output_token_logprobs"]
    assert [e[1] for e in lps] == one["output_ids"] and all(e[2] is None and e[0] <= 0 for e in lps)

    # without return_logprob: no logprobs key
    plain = generate(server, {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3}})
    assert "output_token_logprobs" not in plain["meta_info"]

    # a batch: a list in order, one rid per prompt; a single rid string is suffixed per prompt as in SGLang
    batch = generate(server, greedy(PROMPTS, 4, rid=["a", "b", "c", "d"]))
    assert [r["meta_info"]["id"] for r in batch] == ["a", "b", "c", "d"]
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [len(p) for p in PROMPTS]
    batch = generate(server, greedy(PROMPTS[:2], 2, rid="x"))
    assert [r["meta_info"]["id"] for r in batch] == ["x_0", "x_1"]

    # per-prompt sampling params
    per = generate(
        server,
        {
            "input_ids": PROMPTS[:2],
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 3, "ignore_eos": True}],
        },
    )
    assert per[0]["meta_info"]["completion_tokens"] == 1 and per[1]["meta_info"]["completion_tokens"] == 3

    # text prompts are tokenized by the server
    text = "What is 2 + 3?"
    out = generate(server, {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert out["meta_info"]["prompt_tokens"] == len(tok(text)["input_ids"])
    assert isinstance(generate(server, {"text": [text, "Hi"], "sampling_params": {"max_new_tokens": 1}}), list)

    # n > 1: one response per sample, in order, with distinct ids
    many = generate(
        server,
        {"input_ids": PROMPTS[1], "rid": "g", "sampling_params": {"n": 4, "max_new_tokens": 6, "ignore_eos": True}},
    )
    assert [r["meta_info"]["id"] for r in many] == ["g_0", "g_1", "g_2", "g_3"]
    assert len({tuple(r["output_ids"]) for r in many}) > 1  # sampled at T=1 from a 4k vocabulary

    # max_new_tokens 0
    zero = generate(server, {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 0}})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_logprobs_equal_forward_pass(server, tiny):
    model, _ = tiny
    for temperature in (0.0, 0.7, 1.3):
        body = {
            "input_ids": PROMPTS,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": temperature, "ignore_eos": True},
        }
        for prompt, out in zip(PROMPTS, generate(server, body)):
            got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
            # SGLang: logprobs of the temperature-scaled distribution; greedy -> the raw distribution
            want = forward_logprobs(model, prompt, out["output_ids"], temperature if temperature > 0 else 1.0)
            assert (got - want).abs().max().item() < 1e-3, (temperature, got, want)


def test_frequency_and_presence_penalties_as_sglang(server, tiny):
    """Greedy with penalties: each token is the argmax of the forward pass's logits less frequency_penalty times its
    count among the tokens generated so far (the prompt does not count) and presence_penalty if it is among them;
    its logprob is taken after the penalties, as SGLang's penalizers run before logprobs."""
    model, _ = tiny
    fp, pp = 1.5, 0.7
    penalties = {"ignore_eos": True, "frequency_penalty": fp, "presence_penalty": pp}
    out = generate(server, greedy(PROMPTS[2], 24, sp=penalties))
    ids, lps = out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    assert ids != generate(server, greedy(PROMPTS[2], 24, sp={"ignore_eos": True}))["output_ids"]  # they changed it
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[2] + ids])).logits[0, len(PROMPTS[2]) - 1 : -1].float()
    counts = torch.zeros(logits.shape[-1])
    for i, t in enumerate(ids):
        penalized = logits[i] - fp * counts - pp * (counts > 0).float()
        assert int(penalized.argmax()) == t, i
        assert abs(torch.log_softmax(penalized, -1)[t].item() - lps[i]) < 1e-3, i
        counts[t] += 1


def test_greedy_deterministic_and_same_batched_or_alone(server):
    alone = [generate(server, greedy(p, 16, sp={"ignore_eos": True}))["output_ids"] for p in PROMPTS]
    again = [generate(server, greedy(p, 16, sp={"ignore_eos": True}))["output_ids"] for p in PROMPTS]
    assert alone == again
    # one batched request ...
    batched = [r["output_ids"] for r in generate(server, greedy(PROMPTS, 16, sp={"ignore_eos": True}))]
    assert batched == alone
    # ... and concurrent requests of different lengths that join and leave the running batch at different steps
    lengths = [16, 5, 11, 16]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = [
            pool.submit(generate, server, greedy(p, n, sp={"ignore_eos": True}))
            for p, n in zip(PROMPTS * 2, lengths * 2)
        ]
        outs = [f.result()["output_ids"] for f in futs]
    for i, out in enumerate(outs):
        assert out == alone[i % 4][: lengths[i % 4]]


def test_sampled_rows_and_logprobs_same_alone_together_or_staggered(server):
    """Seeded sampling is reproducible whatever the batching: each request's tokens and log-probs are bit for bit
    the same run alone, sent together, or arriving one by one into a running batch (rows of different lengths
    beside it). Needs both the per-request random stream and the batch-invariant fast path."""

    def body(i):
        prompt = PROMPTS[i % 4] + [i + 1] * (i % 3)
        sp = {"max_new_tokens": 12 + i % 5, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 100 + i}
        return {"input_ids": prompt, "sampling_params": sp, "return_logprob": True}

    def result(out):
        return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]

    n = 8
    alone = [result(generate(server, body(i))) for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        together = [f.result() for f in [pool.submit(generate, server, body(i)) for i in range(n)]]
        futs = []
        for i in range(n):
            prefills = call(server, "/server_info")[1]["prefill_batches"]
            futs.append(pool.submit(generate, server, body(i)))
            # the next one is sent once this one is prefilled: each joins the rows still decoding
            assert wait_until(lambda p=prefills: call(server, "/server_info")[1]["prefill_batches"] > p, interval=0.005)
        staggered = [f.result() for f in futs]
    assert [result(o) for o in together] == alone
    assert [result(o) for o in staggered] == alone


def test_concurrent_requests_share_decode_steps(server):
    before = call(server, "/server_info")[1]
    n_req, n_tok = 8, 24
    with concurrent.futures.ThreadPoolExecutor(n_req) as pool:
        futs = [
            pool.submit(
                generate,
                server,
                {"input_ids": PROMPTS[i % 4] + [i], "sampling_params": {"max_new_tokens": n_tok, "ignore_eos": True}},
            )
            for i in range(n_req)
        ]
        assert all(f.result()["meta_info"]["completion_tokens"] == n_tok for f in futs)
    after = call(server, "/server_info")[1]
    steps = after["decode_steps"] - before["decode_steps"]
    # One request at a time would need n_req * (n_tok - 1) decode steps; a shared batch needs far fewer.
    assert steps <= n_req * (n_tok - 1) / 2, steps
    assert after["max_running_batch"] > 1


@pytest.mark.skipif(platform.system() != "Linux", reason="reads the server's page faults from /proc")
def test_a_warm_server_reuses_its_rollouts_memory(cold_server):
    """A rollout's KV cache and transients stay with malloc when its batch empties, so the next rollout of the same
    shape page-faults almost nothing in: handed back to the OS, they would be faulted in again every time, which a VM
    that returns freed pages to its host charges dearly."""

    def minor_faults() -> int:
        with open(f"/proc/{cold_server.proc.pid}/stat") as f:  # field 10, counted after the parenthesised name
            return int(f.read().rsplit(")", 1)[1].split()[7])

    # 32 rows of 80 + 48 tokens as one batch: every rollout then has the same shape (one prefill, one running batch),
    # where 32 separate requests would join in batches that depend on when each arrives
    prompts = [list(range(10 + i, 90 + i)) for i in range(32)]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
    faults = []
    for _ in range(5):
        before = minor_faults()
        assert len(generate(cold_server.address, body)) == 32
        faults.append(minor_faults() - before)
    # the median warm rollout: one may still grow a buffer, or a request thread fault in its own malloc arena
    assert statistics.median(faults[1:]) < faults[0] / 10, faults


def test_stop_strings_stop_ids_and_length(server, tiny):
    _, tok = tiny
    prompt = tok("The capital of France is")["input_ids"]
    base = generate(server, greedy(prompt, 12, sp={"ignore_eos": True}))
    ids = base["output_ids"]
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 12}

    # stop string: the first two characters of the 4th token's text, searched in the growing output
    piece = tok.decode(ids[3:4]) or tok.decode(ids[3:5])
    stop = piece[-2:] if len(piece) >= 2 else piece
    expect_len = next(j for j in range(1, len(ids) + 1) if stop in tok.decode(ids[:j]))
    out = generate(server, greedy(prompt, 12, sp={"stop": [stop, "never-appears-xyz"], "ignore_eos": True}))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[:expect_len]  # output_ids keep the stop tokens
    full = tok.decode(ids[:expect_len])
    assert out["text"] == full[: full.find(stop)]  # text is trimmed before the stop string
    kept = generate(server, greedy(prompt, 12, sp={"stop": stop, "no_stop_trim": True, "ignore_eos": True}))
    assert kept["text"] == full and kept["meta_info"]["finish_reason"]["matched"] == stop

    # stop token id: ends at its first occurrence; the text leaves the matched token out
    target = ids[4]
    first = ids.index(target)
    out = generate(server, greedy(prompt, 12, sp={"stop_token_ids": [target]}))
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert out["text"] == tok.decode(ids[:first], skip_special_tokens=True)
    # ignore_eos also ignores stop ids (SGLang); min_new_tokens masks them until reached
    out = generate(server, greedy(prompt, 12, sp={"stop_token_ids": [target], "ignore_eos": True}))
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    out = generate(server, greedy(prompt, 12, sp={"stop_token_ids": [ids[0]], "min_new_tokens": 3}))
    assert out["meta_info"]["completion_tokens"] >= 3 and ids[0] not in out["output_ids"][:3]

    # EOS: the ChatML end token is a stop id (a random model rarely samples it, so check the set itself)
    from areal_lite.kit.server.weights import eos_ids

    assert tok.convert_tokens_to_ids("<|im_end|>") in eos_ids(tiny[0], tok)


def test_skip_special_tokens_affects_text_only(server, tiny):
    _, tok = tiny
    special = tok.convert_tokens_to_ids("<|im_start|>")
    # a greedy continuation of a prompt made of the special token tends to repeat it; whatever comes out,
    # the two settings must agree on ids and differ only in how the text renders special tokens
    body = lambda skip: {
        "input_ids": [special] * 3,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "skip_special_tokens": skip},
    }
    a, b = generate(server, body(True)), generate(server, body(False))
    assert a["output_ids"] == b["output_ids"]
    assert a["text"] == tok.decode(a["output_ids"], skip_special_tokens=True)
    assert b["text"] == tok.decode(b["output_ids"], skip_special_tokens=False)


BAD_BODIES = [
    b"{not json",
    b"[1, 2",
    b"\xff\xfe",
    b"null",
    b"[]",
    b"42",
    b'"text"',
    {},
    {"sampling_params": {"max_new_tokens": 4}},
    {"text": "hi", "input_ids": [1, 2]},
    {"input_ids": []},
    {"input_ids": [[]]},
    {"input_ids": [[1, 2], []]},
    {"text": ""},
    {"text": 5},
    {"text": ["a", 3]},
    {"input_ids": "1 2 3"},
    {"input_ids": [1, "2"]},
    {"input_ids": [1.0, 2.0]},
    {"input_ids": [True, 2]},
    {"input_ids": [-1]},
    {"input_ids": [10**9]},
    {"input_ids": [[1], [2, 10**9]]},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": 16.0}},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": True}},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**7}},
    {"input_ids": [1], "sampling_params": {"temperature": -0.5}},
    {"input_ids": [1], "sampling_params": {"temperature": "hot"}},
    {"input_ids": [1], "sampling_params": {"top_p": 0.0}},
    {"input_ids": [1], "sampling_params": {"top_p": 1.5}},
    {"input_ids": [1], "sampling_params": {"top_k": 0}},
    {"input_ids": [1], "sampling_params": {"top_k": -2}},
    {"input_ids": [1], "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 4}},
    {"input_ids": [1], "sampling_params": {"min_new_tokens": -1}},
    {"input_ids": [1], "sampling_params": {"n": 0}},
    {"input_ids": [1], "sampling_params": {"n": 2.0}},
    {"input_ids": [1], "sampling_params": {"stop": 7}},
    {"input_ids": [1], "sampling_params": {"stop": ["ok", None]}},
    {"input_ids": [1], "sampling_params": {"stop_token_ids": [-3]}},
    {"input_ids": [1], "sampling_params": {"stop_token_ids": "2"}},
    {"input_ids": [1], "sampling_params": {"ignore_eos": 1}},
    {"input_ids": [1], "sampling_params": {"max_tokens": 8}},  # unknown key (OpenAI's name)
    {"input_ids": [1], "sampling_params": {"temprature": 0.5}},
    {"input_ids": [1], "sampling_params": {"repetition_penalty": 1.5}},  # SGLang key, not implemented here
    {"input_ids": [1], "sampling_params": {"frequency_penalty": 2.5}},  # implemented, out of range
    {"input_ids": [1], "sampling_params": {"regex": "a+"}},
    {"input_ids": [1], "sampling_params": [{"max_new_tokens": 1}]},  # a list for a single prompt
    {"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 1}]},  # length mismatch
    {"input_ids": [[1], [2]], "sampling_params": "fast"},
    {"input_ids": [[1], [2]], "rid": ["same", "same"]},
    {"input_ids": [[1], [2]], "rid": ["only-one"]},
    {"input_ids": [1], "rid": 7},
    {"input_ids": [1], "return_logprob": "yes"},
    {"input_ids": [[1], [2]], "return_logprob": [True]},
    {"input_ids": [[1]] * 1025},
    {"input_ids": [1], "stream": True},
    {"input_ids": [1], "top_logprobs_num": 5},
    {"input_ids": [1], "sampling_params": {"temperature": float("nan")}},
]


def test_malformed_requests_get_4xx_and_server_keeps_serving(server):
    assert len(BAD_BODIES) >= 30
    for body in BAD_BODIES:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN -> "NaN", accepted by json.loads
        status, out = call(server, "/generate", raw=raw)
        assert 400 <= status < 500, (body, status, out)
        assert isinstance(out, dict) and isinstance(out.get("error"), str) and out["error"], (body, out)
        assert call(server, "/health")[0] == 200
    status, out = call(server, "/no_such_route")
    assert status == 404 and "/generate" in out["error"]  # the answer lists the routes that exist
    status, out = call(server, "/generate", method="GET")
    assert status == 405 and "POST /generate" in out["error"]
    assert call(server, "/health", body={}, method="POST")[0] == 405
    for path in ("/pause_generation", "/abort_request", "/update_weights_from_disk"):
        status, out = call(server, path, raw=b"[1]")
        assert status == 400 and "must be a JSON object" in out["error"]
        status, out = call(server, path, raw=b"{oops")
        assert status == 400 and "not valid JSON" in out["error"]
    for path, body, words in [
        ("/pause_generation", {"mode": "sideways"}, "mode: expected 'abort'"),
        ("/abort_request", {"rid": 5}, "rid: expected a string"),
        ("/update_weights_from_disk", {"model_path": 3}, "model_path: expected a non-empty string"),
    ]:
        status, out = call(server, path, body)
        assert status == 400 and words in out["error"], (path, out)
    for path in ("/init_weights_update_group", "/update_weights_from_distributed"):
        status, out = call(server, path, {})
        assert status == 400 and "not supported by the embedded server" in out["error"]
    # a top-level key SGLang does not define is refused (a typo must not silently drop a feature); SGLang's own
    # fields pass at their neutral values
    status, out = call(server, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "foo": 1})
    assert status == 400 and "unknown field `foo`" in out["error"], out
    assert generate(server, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "lora_path": None})
    assert call(server, "/server_info")[1]["paused"] is False


# ----------------------------------------------------------------------------------------------------------------
# pause / abort / weight updates (private server)


def _long(ids, n=3000, **kw):
    return {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0.0},
        **kw,
    }


def _wait_info(addr, ready, what: str, timeout=30) -> dict:
    """Poll /server_info until `ready(info)`: tests wait on the server's observable state, never on a sleep."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = call(addr, "/server_info")[1]
        if ready(info):
            return info
        time.sleep(0.02)
    raise AssertionError(f"the server never reached: {what} (last /server_info: {info})")


def _wait_running(addr, count=1):
    return _wait_info(addr, lambda i: i["num_running"] >= count, f"{count} running")


def _start_together(addr, pool, bodies, rows=None):
    """Send requests while generation is paused, wait until the server holds them all, then continue: the
    scheduler admits held requests together, so they are all running before any later command is handled (the
    scheduler handles commands between steps, in arrival order). No request can finish before the test acts."""
    assert call(addr, "/pause_generation", {"mode": "in_place"})[0] == 200
    futures = [pool.submit(generate, addr, body) for body in bodies]
    rows = len(bodies) if rows is None else rows  # a batch of prompts is one request, several rows
    _wait_info(addr, lambda i: i["num_held"] == rows, f"{rows} rows held")
    assert call(addr, "/continue_generation", {})[0] == 200
    return futures


def _counters_add_up(addr, before: dict, rows: list[dict]) -> None:
    """Every row ended exactly once and every token it made was counted; nothing is left running or queued."""
    info = _wait_info(addr, lambda i: i["num_running"] == 0, "idle")
    finished = sum(r["meta_info"]["finish_reason"]["type"] != "abort" for r in rows)
    assert info["finished_requests"] - before["finished_requests"] == finished
    assert info["aborted_requests"] - before["aborted_requests"] == len(rows) - finished
    assert info["generated_tokens"] - before["generated_tokens"] == sum(
        r["meta_info"]["completion_tokens"] for r in rows
    )
    assert info["num_waiting"] == info["num_held"] == 0 and info["paused"] is False


def test_pause_aborts_in_flight_and_holds_new_requests(private_server, tiny):
    addr = private_server.address
    model, _ = tiny
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        inflight = pool.submit(generate, addr, _long(PROMPTS[0], rid="long-1"))
        _wait_running(addr)  # prefilled, so its first token is already sampled
        status, clash = call(addr, "/generate", _long(PROMPTS[1], rid="long-1"))
        assert status == 400 and "already in flight" in clash["error"]
        status, out = call(addr, "/pause_generation", {"mode": "abort"})
        assert status == 200 and out["status"] == "ok"
        res = inflight.result(timeout=30)
        meta = res["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        n = meta["completion_tokens"]
        assert 0 < n < 3000 and len(res["output_ids"]) == n == len(meta["output_token_logprobs"])
        # the partial output is a real greedy prefix with correct logprobs
        got = torch.tensor([e[0] for e in meta["output_token_logprobs"][:50]])
        want = forward_logprobs(model, PROMPTS[0], res["output_ids"][:50])
        assert (got - want).abs().max().item() < 1e-3

        held = pool.submit(generate, addr, greedy(PROMPTS[2], 8, sp={"ignore_eos": True}))
        _wait_info(addr, lambda i: i["num_held"] == 1, "1 held")
        assert not held.done() and call(addr, "/server_info")[1]["num_running"] == 0  # held, not started
        status, out = call(addr, "/continue_generation", {})
        assert status == 200 and out["status"] == "ok"
        done = held.result(timeout=30)
        assert done["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert call(addr, "/server_info")[1]["paused"] is False


def test_abort_request_by_rid_and_all(private_server):
    """Abort by rid ends that request only (the other one runs on to its length); abort_all ends every row; the
    server's counters add up across the aborts. The requests start together while the server is held (see
    `_start_together`), so the test does not race the server on any machine."""
    addr = private_server.address
    before = call(addr, "/server_info")[1]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        a, b = _start_together(addr, pool, [_long(PROMPTS[0], rid="victim"), _long(PROMPTS[1], rid="bystander", n=40)])
        assert call(addr, "/abort_request", {"rid": "victim"})[0] == 200
        ra, rb = a.result(timeout=30), b.result(timeout=30)
        assert ra["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < ra["meta_info"]["completion_tokens"] < 3000  # it ran, and it was cut short
        assert rb["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
        group = {
            "input_ids": [[1, 2], [3, 4]],
            "rid": "grp",
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
        (c,) = _start_together(addr, pool, [group], rows=2)
        assert call(addr, "/abort_request", {"abort_all": True})[0] == 200
        rc = c.result(timeout=30)
        assert [r["meta_info"]["finish_reason"]["type"] for r in rc] == ["abort", "abort"]
        assert all(0 < r["meta_info"]["completion_tokens"] < 3000 for r in rc)
    _counters_add_up(addr, before, [ra, rb, *rc])


def test_flush_cache_only_when_nothing_is_in_flight(private_server):
    """SGLang's /flush_cache: flushed when idle, refused (400) while a request runs, flushed again once it ended.
    Both branches, with their bodies; the request is awaited running on the server's own state, not a sleep."""
    addr = private_server.address
    assert call(addr, "/flush_cache", {}) == (200, "Cache flushed.\n")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(generate, addr, _long(PROMPTS[0], rid="busy"))
        try:
            _wait_running(addr)
            status, text = call(addr, "/flush_cache", {})
        finally:  # never leave a 3000-token request running on the module's server
            call(addr, "/abort_request", {"rid": "busy"})
        assert busy.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
    assert status == 400 and "running or waiting requests" in text, (status, text)
    _wait_info(addr, lambda i: i["num_running"] == i["num_waiting"] == 0, "idle")
    assert call(addr, "/flush_cache", {}) == (200, "Cache flushed.\n")


def test_client_disconnect_aborts_its_request(private_server):
    addr = private_server.address
    aborted = call(addr, "/server_info")[1]["aborted_requests"]
    with pytest.raises((TimeoutError, urllib.error.URLError)):  # the client gives up and closes the connection
        call(addr, "/generate", _long(PROMPTS[3], n=4000, rid="gone"), timeout=0.5)
    info = _wait_info(addr, lambda i: i["num_running"] == 0, "idle")
    assert info["aborted_requests"] == aborted + 1  # aborted, not run to the end


def test_update_weights_from_disk(private_server, tiny, tmp_path):
    from safetensors.torch import save_file

    addr = private_server.address
    model, _ = tiny
    before = generate(addr, greedy(PROMPTS[2], 10, sp={"ignore_eos": True}))
    version0 = call(addr, "/model_info")[1]["weight_version"]
    assert before["meta_info"]["weight_version"] == version0

    # a perturbed copy of the model (tied lm_head saved once, as save_pretrained does)
    gen = torch.Generator().manual_seed(3)
    state = {
        k: (v + 0.5 * torch.randn(v.shape, generator=gen) if v.dtype.is_floating_point else v).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    new_dir = tmp_path / "v7"
    new_dir.mkdir()
    save_file(state, str(new_dir / "model.safetensors"))
    status, out = call(addr, "/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "7"})
    assert status == 200 and out["success"] is True and out["num_paused_requests"] == 0, out
    info = call(addr, "/model_info")[1]
    assert info["weight_version"] == "7" and info["model_path"] == str(new_dir)
    after = generate(addr, greedy(PROMPTS[2], 10, sp={"ignore_eos": True}))
    assert after["meta_info"]["weight_version"] == "7"
    assert after["output_ids"] != before["output_ids"]
    # the served logprobs are those of the new weights
    perturbed = type(model)(model.config).eval()
    perturbed.load_state_dict(state, strict=False)
    perturbed.tie_weights()
    got = torch.tensor([e[0] for e in after["meta_info"]["output_token_logprobs"]])
    assert (got - forward_logprobs(perturbed, PROMPTS[2], after["output_ids"])).abs().max().item() < 1e-3

    # a bad folder: 400, nothing changed, server fine
    status, out = call(addr, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and out["success"] is False
    (tmp_path / "bad").mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(tmp_path / "bad" / "model.safetensors"))
    status, out = call(addr, "/update_weights_from_disk", {"model_path": str(tmp_path / "bad")})
    assert status == 400 and out["success"] is False and "shape" in out["message"]
    assert call(addr, "/model_info")[1]["weight_version"] == "7"

    # while a request runs (not paused): the update waits for it, so the response is from one version
    orig_dir = tmp_path / "orig"
    orig_dir.mkdir()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
        str(orig_dir / "model.safetensors"),
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # long enough that the update (one HTTP call away) always arrives while it runs
        running = pool.submit(generate, addr, _long(PROMPTS[0], n=1500))
        _wait_running(addr)
        status, out = call(addr, "/update_weights_from_disk", {"model_path": str(orig_dir)})  # no version: 7 -> 8
        assert status == 200 and out["success"], out
        r = running.result(timeout=60)
        assert r["meta_info"]["finish_reason"]["type"] == "length" and r["meta_info"]["weight_version"] == "7"
    again = generate(addr, greedy(PROMPTS[2], 10, sp={"ignore_eos": True}))
    assert again["output_ids"] == before["output_ids"] and again["meta_info"]["weight_version"] == "8"


# ----------------------------------------------------------------------------------------------------------------
# in-process pieces: request parsing, sampling, batch-cache surgery


def test_parse_generate_body_units():
    kw = dict(vocab_size=100, context_length=64, tokenize=lambda t: [1] * len(t))
    is_batch, specs, _ = parse_generate_body({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5}}, **kw)
    assert not is_batch and specs[0].params.max_new_tokens == 5 and specs[0].rid
    is_batch, specs, _ = parse_generate_body({"text": ["ab", "c"], "return_logprob": [True, False]}, **kw)
    assert (
        is_batch and [len(s.input_ids) for s in specs] == [2, 1] and [s.return_logprob for s in specs] == [True, False]
    )
    sp = parse_generate_body(
        {"input_ids": [1], "sampling_params": {"top_k": 1 << 30, "stop": "x", "temperature": 0}}, **kw
    )[1][0].params
    assert sp.top_k == -1 and sp.stop == ["x"] and sp.greedy
    # unset max_new_tokens: 128, shortened to what fits (SGLang); a set one must fit
    assert parse_generate_body({"input_ids": [1] * 10}, **kw)[1][0].params.max_new_tokens == 54
    with pytest.raises(BadRequest, match="context length"):
        parse_generate_body({"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 5}}, **kw)
    penalties = {"frequency_penalty": -2, "presence_penalty": 2}
    sp = parse_generate_body({"input_ids": [1], "sampling_params": penalties}, **kw)[1][0].params
    assert (sp.frequency_penalty, sp.presence_penalty) == (-2.0, 2.0)
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"temperature": 10**400}):
        with pytest.raises(BadRequest, match="must be"):
            parse_generate_body({"input_ids": [1], "sampling_params": bad}, **kw)
    with pytest.raises(BadRequest, match="unknown field `max_tokens`"):
        parse_generate_body({"input_ids": [1], "sampling_params": {"max_tokens": 5}}, **kw)


def _seq(params: SamplingParams, output=(), stop_ids=(), prompt=(1,), seed=0) -> GenerationState:
    state = GenerationState("r", "r", list(prompt), params, True, frozenset(stop_ids), output=list(output))
    state.rng = random.Random(seed)
    return state


def _uniforms(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_sample_tokens_units():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    seqs = [
        _seq(SamplingParams(temperature=0.0)),
        _seq(SamplingParams(temperature=0.5, top_k=1)),
        _seq(SamplingParams(temperature=2.0)),
        _seq(SamplingParams(temperature=0.0, min_new_tokens=2), stop_ids=[int(logits[3].argmax())]),
    ]
    tokens, lps = sample_tokens(logits.clone(), seqs)
    assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()  # top_k=1 is greedy
    assert tokens[3] != logits[3].argmax()  # the stop id is masked until min_new_tokens
    assert torch.allclose(lps[0], torch.log_softmax(logits[0], -1)[tokens[0]])
    assert torch.allclose(lps[2], torch.log_softmax(logits[2] / 2.0, -1)[tokens[2]])  # temperature applied (SGLang)
    for s in seqs:
        s.rng.seed(0)  # the same draws again
    _, orig = sample_tokens(logits.clone(), seqs, original_logprob=True)
    assert torch.allclose(orig[2], torch.log_softmax(logits[2], -1)[tokens[2]])
    # top_p keeps the smallest set whose mass reaches p: with p tiny only the argmax survives
    t, _ = sample_tokens(logits.clone(), [_seq(SamplingParams(temperature=1.0, top_p=1e-4))] * 4)
    assert torch.equal(t, logits.argmax(-1))


@pytest.mark.parametrize("original_logprob", [False, True])
def test_a_rows_sample_does_not_depend_on_the_rows_beside_it(original_logprob, monkeypatch):
    """A batch of mixed rows (greedy, temperatures, top-k/top-p, penalties), more than one CPU pass of rows
    (`CPU_SAMPLE_ROWS`): each row's token and logprob are bit for bit those it gets sampled alone, and those it gets
    beside rows of another kind (a sampled row next to a greedy one)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(11, 49152, generator=g) * 3
    kinds = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
             SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.3, top_p=0.9),
             SamplingParams(temperature=0.8, frequency_penalty=0.5)]  # fmt: skip
    params = [kinds[i % len(kinds)] for i in range(11)]

    def rows(order):
        return [_seq(params[i], output=[5, 5, 7], seed=i) for i in order]

    drawn = []  # the probabilities each sampled row is drawn from, in row order: equal bits, not only equal tokens
    real_draw = sampling.draw
    monkeypatch.setattr(sampling, "draw", lambda probs, u: drawn.extend(probs) or real_draw(probs, u))
    together = sample_tokens(logits.clone(), rows(range(11)), original_logprob)
    probs = dict(zip([i for i in range(11) if not params[i].greedy], drawn))
    assert 11 > sampling.CPU_SAMPLE_ROWS and len(probs) == 9
    for i in range(11):
        drawn.clear()
        alone = sample_tokens(logits[i : i + 1].clone(), rows([i]), original_logprob)
        assert torch.equal(alone[0], together[0][i : i + 1]) and torch.equal(alone[1], together[1][i : i + 1]), i
        assert len(drawn) == (i in probs) and (not drawn or torch.equal(drawn[0], probs[i])), i
    mixed = [0, 1, 4, 1]  # sampled rows between greedy ones, in one pass
    drawn.clear()
    pair = sample_tokens(logits[mixed].clone(), rows(mixed), original_logprob)
    assert torch.equal(pair[0], together[0][mixed]) and torch.equal(pair[1], together[1][mixed])
    assert torch.equal(drawn[0], probs[0]) and torch.equal(drawn[1], probs[4])


def test_draw_follows_each_rows_probabilities_and_never_picks_a_zero():
    """`draw` (inverse CDF) against the exact probabilities: unnormalised rows (top-k/top-p zero entries without
    renormalising), zeros at both ends and inside, one row with a single nonzero entry. A sampler off by one entry,
    or one that ignores the row's total, fails the frequency check."""
    rows = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0], [0.0] * 5 + [0.25], [1.0, 3.0, 0.0, 0.0, 2.0, 2.0]])
    n = 20000
    picked = draw(rows.repeat_interleave(n, 0), _uniforms(3 * n, 0)).view(3, n)
    for row, got in zip(rows, picked):
        expected = row / row.sum()
        freq = torch.bincount(got, minlength=6).double() / n
        assert (freq[expected == 0] == 0).all()  # zero-probability entries are never drawn
        sigma = (expected * (1 - expected) / n).sqrt()
        assert ((freq - expected).abs() <= 5 * sigma + 1e-12).all(), (freq, expected)
    big = torch.softmax(torch.randn(4, 49152, generator=torch.Generator().manual_seed(1)) * 4, -1)
    assert draw(big, _uniforms(4, 2)).max() < 49152
    assert draw(rows, torch.tensor([1 - 2**-53] * 3, dtype=torch.float64)).tolist() == [4, 5, 5]  # u -> 1: last nonzero
    for bad in (float("nan"), float("inf")):  # NaN weights: a clear error, not an index past the vocabulary
        with pytest.raises(ValueError, match="not finite"):
            draw(torch.tensor([[0.5, bad, 0.5]]), _uniforms(1, 3))
    logits = torch.full((2, 6), float("nan"))  # NaN weights under greedy decoding: no token 0 as if it meant something
    with pytest.raises(ValueError, match="not finite"):
        sample_tokens(logits, [_seq(SamplingParams(temperature=0.0))] * 2)


def test_row_seeds_streams():
    """Each row's stream: identical requests get different streams, and the same ones in any arrival order; a
    client's sampling_seed gives the same stream on any server (per sample index), and a server seed changes the
    rest."""

    def first_draws(seeds: RowSeeds, rows: list[GenerationState]) -> list[float]:
        for r in rows:
            seeds.assign(r)
        return [r.rng.random() for r in rows]

    def rows(order=(0, 1, 2, 3)):
        specs = [([5, 6], SamplingParams()), ([5, 6], SamplingParams()), ([5, 6], SamplingParams(temperature=0.5)),
                 ([7], SamplingParams())]  # fmt: skip
        return [_seq(specs[i][1], prompt=specs[i][0]) for i in order]

    a = first_draws(RowSeeds(1), rows())
    assert len(set(a)) == 4  # identical requests (rows 0 and 1) still get different streams
    b = first_draws(RowSeeds(1), rows((3, 1, 2, 0)))
    # the same streams in another arrival order: the first of the identical pair to arrive gets the first stream
    assert [b[1], b[3], b[2], b[0]] == a
    assert set(first_draws(RowSeeds(2), rows())).isdisjoint(a)  # another server seed, other streams
    seeded = [_seq(SamplingParams(sampling_seed=9), prompt=[5]) for _ in range(2)]
    seeded[1].sample = 1
    c = first_draws(RowSeeds(1), seeded)
    assert c[0] != c[1] and first_draws(RowSeeds(2), [_seq(SamplingParams(sampling_seed=9), prompt=[8])]) == c[:1]
    small = RowSeeds(1, remember=2)
    first_draws(small, rows())  # four requests, three distinct: the oldest count is forgotten, nothing grows
    assert len(small._seen) == 2


def _run_rows(scheduler, rows: list[GenerationState], timeout: float = 120) -> None:
    done = threading.Semaphore(0)
    for r in rows:
        r.on_done = lambda _row: done.release()
    scheduler.submit(rows)
    for _ in rows:
        assert done.acquire(timeout=timeout), "a row never finished"


def test_sampling_does_not_depend_on_batch_neighbours(tiny_model_path, tiny):
    """The same sampled requests give the same tokens whether they run alone or among other rows, and in any
    arrival order: each row draws from its own stream. A different server seed gives other samples."""
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server.scheduler import Scheduler

    tok = tiny[1]
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True)

    def outputs(seed: int, neighbours: int, reverse: bool) -> list[list[int]]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()  # the fast path
        sched = Scheduler(model, tok, model_path="tiny", random_seed=seed, max_running_requests=16)  # rebinds it
        sched.start()
        try:
            mine = [sched.new_state(_spec(p, sp), 0) for p in (PROMPTS[0], PROMPTS[0], PROMPTS[2])]
            others = [sched.new_state(_spec([100 + i] * (i + 1), sp), 0) for i in range(neighbours)]
            rows = others + (mine[::-1] if reverse else mine)
            _run_rows(sched, rows)
        finally:
            sched.stop()
        assert all(r.finish == {"type": "length", "length": 24} for r in rows)
        return sorted(r.output for r in mine[:2]) + [mine[2].output]

    alone = outputs(seed=3, neighbours=0, reverse=False)
    assert alone[0] != alone[1]  # two samples of one prompt differ
    assert outputs(seed=3, neighbours=9, reverse=True) == alone
    assert outputs(seed=4, neighbours=0, reverse=False) != alone


def test_an_idle_server_prefills_a_burst_together(tiny_model_path, tiny):
    """Requests that reach an idle server one after another (a GRPO client sends one per sample) are prefilled as one
    batch once none has come for `admit_quiet` seconds. Without the wait, the first is prefilled alone and the
    rest need a second prefill. Either way each row gets the same tokens (sampling is batch-invariant)."""
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server.scheduler import Scheduler

    sp = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)

    def burst(quiet: float) -> tuple[int, list[list[int]]]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
        sched = Scheduler(model, tiny[1], model_path="tiny", random_seed=5, admit_quiet=quiet, admit_max=30.0)
        rows = [sched.new_state(_spec(PROMPTS[i % 2], sp), 0) for i in range(4)]
        done = threading.Semaphore(0)
        for r in rows:
            r.on_done = lambda _row: done.release()
        sched.start()
        try:
            sched.submit(rows[:1])
            if quiet:  # the first row taken in, and held back: the burst is open
                assert wait_until(
                    lambda: len(sched.waiting) == 1 and sched.counters["prefill_batches"] == 0, interval=0.005
                )
            else:
                assert wait_until(lambda: sched.counters["prefill_batches"] == 1, interval=0.005)
            sched.submit(rows[1:])
            assert all(done.acquire(timeout=60) for _ in rows)
            return sched.counters["prefill_batches"], [r.output for r in rows]
        finally:
            sched.stop()

    together, tokens = burst(quiet=3.0)  # far longer than the test takes to send the rest
    apart, tokens_apart = burst(quiet=0.0)
    assert (together, apart) == (1, 2)
    assert tokens == tokens_apart


def test_counters_include_a_row_when_its_client_is_answered(tiny_model_path, tiny):
    """`on_done` answers the client, who may read /server_info at once: by then the counters must hold every token
    and the end of the row (they were once updated after it, so a test's counter deltas were off by a step)."""
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server.scheduler import Scheduler

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    sched = Scheduler(model, tiny[1], model_path="tiny")
    seen = []
    rows = [
        sched.new_state(_spec(p, SamplingParams(max_new_tokens=n, ignore_eos=True)), 0)
        for p, n in ((PROMPTS[0], 5), (PROMPTS[1], 9))
    ]
    sched.start()
    try:
        done = threading.Semaphore(0)
        for r in rows:
            r.on_done = lambda row: (seen.append((len(row.output), dict(sched.counters))), done.release())
        sched.submit(rows)
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
    finally:
        sched.stop()
    (first_len, at_first), (second_len, at_second) = seen
    assert (first_len, second_len) == (5, 9)
    assert at_first["generated_tokens"] == 2 * 5 and at_first["finished_requests"] == 1  # both rows ran 5 steps
    assert at_second["generated_tokens"] == 5 + 9 and at_second["finished_requests"] == 2


def test_the_scheduler_thread_builds_the_runner_and_start_raises_its_failure(tiny_model_path, tiny, monkeypatch):
    """The runner (whose weight packing runs parallel regions) is built on the scheduler thread, the thread that then
    computes every step, so that no other thread of the server gets an OpenMP team (scheduler.py's `_run`: a second
    team made each decode step 25% slower). A runner that cannot be built fails `start`, not a later request."""
    from transformers import AutoModelForCausalLM

    import areal_lite.kit.server.scheduler as scheduler_module
    from areal_lite.kit.server.scheduler import Scheduler

    built_on = []
    real = scheduler_module.make_runner
    monkeypatch.setattr(
        scheduler_module, "make_runner", lambda *a, **k: built_on.append(threading.current_thread()) or real(*a, **k)
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    sched = Scheduler(model, tiny[1], model_path="tiny")
    assert built_on == [] and sched.runner is None
    sched.start()
    try:
        assert built_on == [sched._thread] and sched._thread is not threading.current_thread()
        row = sched.new_state(_spec(PROMPTS[0], SamplingParams(max_new_tokens=3, ignore_eos=True)), 0)
        _run_rows(sched, [row])
        assert len(row.output) == 3
    finally:
        sched.stop()

    def broken(*a, **k):
        raise RuntimeError("cannot pack these weights")

    monkeypatch.setattr(scheduler_module, "make_runner", broken)
    failing = Scheduler(model, tiny[1], model_path="tiny")
    with pytest.raises(RuntimeError, match="cannot pack these weights"):
        failing.start()
    failing._thread.join(timeout=10)
    assert not failing._thread.is_alive()


def _spec(ids, params):
    from areal_lite.kit.server.protocol import PromptSpec

    return PromptSpec(f"r{random.random()}", list(ids), params, False)


@pytest.fixture(params=["hf", "fast"])
def runner(request, tiny_model_path):
    """Each runner on its own copy of the tiny model (the fast one re-binds the model's weights as fused views)."""
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server.batch import HFRunner
    from areal_lite.kit.server.fastpath import FastRunner, supports

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    assert supports(model)  # the tiny Qwen2 (with q/k/v biases) takes the fast path in the server
    return (HFRunner if request.param == "hf" else FastRunner)(model)


def test_hf_runner_hands_the_cache_over_under_the_name_the_models_forward_declares(tiny):
    """transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns, and goes in 5.40); the
    5.x releases before it know only the old one. The runner uses whichever the model declares, so neither a
    deprecation warning nor an unknown keyword comes out of a prefill or a decode step."""
    from areal_lite.kit.server.batch import HFRunner

    model, _ = tiny
    runner = HFRunner(model)
    assert runner.cache_kw in inspect.signature(model.forward).parameters
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("error", FutureWarning)
        b = RunningBatch(runner.new_kv())
        part, logits = prefill_distinct(runner, [PROMPTS[0], PROMPTS[1]])
        b.add([_seq(SamplingParams(), prompt=[i]) for i in (0, 1)], part, logits.argmax(-1),
              torch.tensor([len(PROMPTS[0]), len(PROMPTS[1])]))  # fmt: skip
        assert runner.decode(b).shape == logits.shape
    assert len(b.kv.cache.layers[0].keys[0, 0]) == max(len(PROMPTS[0]), len(PROMPTS[1])) + 1  # one column added


def test_running_batch_matches_separate_runs(runner, tiny):
    """Join, decode and leave on the left-padded cache give the same tokens and logits as running each prompt
    alone: rows join mid-way (a longer prompt widens the window), leave (the longest row: its columns are trimmed;
    a middle row: rows move), join again into the freed rows, and the cache grows over many steps."""
    model, _ = tiny
    prompts = PROMPTS + [PROMPTS[1], [5] * 12, PROMPTS[0], PROMPTS[1], [300, 301, 302], [7] * 3, list(range(20, 40))]
    n_tokens = 50
    with torch.no_grad():
        solo = []
        for p in prompts:
            ids = list(p)
            for _ in range(n_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            full = model(torch.tensor([ids])).logits[0, len(p) - 1 : -1]
            solo.append((ids[len(p) :], full))
    got: dict[int, list] = {i: [] for i in range(len(prompts))}

    def join(b, rows):
        part, logits = prefill_distinct(runner, [prompts[i] for i in rows])
        b.add([_seq(SamplingParams(), prompt=[i]) for i in rows], part, logits.argmax(-1),
              torch.tensor([len(prompts[i]) for i in rows]))  # fmt: skip
        for i, lg in zip(rows, logits):
            got[i].append(lg)

    def step(b, k=1):
        for _ in range(k):
            logits = runner.decode(b)
            b.next_ids = logits.argmax(-1)
            for s, lg in zip(b.seqs, logits):
                got[s.prompt[0]].append(lg)

    with torch.inference_mode():
        b = RunningBatch(runner.new_kv())
        join(b, [0, 1])
        step(b, 2)
        join(b, [2, 3])  # the longest prompt joins mid-way
        step(b, 3)
        b.keep([0, 1, 3])  # the longest row leaves: leading all-padding columns are trimmed
        step(b, 2)
        b.keep([0, 2])  # a middle row leaves: the rows after it move
        join(b, [4, 5, 7, 8, 9, 10])  # new rows take the freed places (4 and 7: one prompt, prefilled once): 8 rows
        step(b, n_tokens - 1 - 7)
        b.keep([])
        join(b, [6])  # an emptied batch starts again
        step(b, 3)
    lengths = {0: n_tokens, 1: 8, 2: 4, 3: n_tokens - 2, 6: 4} | dict.fromkeys([4, 5, 7, 8, 9, 10], n_tokens - 7)
    for i, (tokens, full) in enumerate(solo):
        n = lengths[i]
        assert len(got[i]) == n, (i, len(got[i]))
        assert [int(lg.argmax()) for lg in got[i]] == tokens[:n], i
        assert (torch.stack(got[i]) - full[:n]).abs().max().item() < 1e-4, i
    assert len(b) == 1


def _logits_by_schedule(runner, prompts, schedule) -> dict:
    """Every logits row each prompt gets (prefill's, then each decode step's) under `schedule`: ("join", [prompt
    indices]), ("step", k decode steps), ("keep", [prompt indices that stay])."""
    got: dict[int, list] = {i: [] for i in range(len(prompts))}
    with torch.inference_mode():
        b = RunningBatch(runner.new_kv())
        for op, arg in schedule:
            if op == "join":
                part, logits = prefill_distinct(runner, [prompts[i] for i in arg])
                b.add([_seq(SamplingParams(), prompt=[i]) for i in arg], part, logits.argmax(-1),
                      torch.tensor([len(prompts[i]) for i in arg]))  # fmt: skip
                for i, lg in zip(arg, logits):
                    got[i].append(lg.clone())
            elif op == "step":
                for _ in range(arg):
                    logits = runner.decode(b)
                    b.next_ids = logits.argmax(-1)
                    for s, lg in zip(b.seqs, logits):
                        got[s.prompt[0]].append(lg.clone())
            else:
                b.keep([j for j, s in enumerate(b.seqs) if s.prompt[0] in arg])
    return got


def _assert_as_alone(runs, alone: dict, least: int) -> None:
    """Each prompt's logits in every run of `runs` are bit for bit its solo run's, over at least `least` steps."""
    for got in runs:
        for i in alone:
            n = min(len(got[i]), len(alone[i]))
            assert n >= least, (i, n)
            unequal = [j for j in range(n) if not torch.equal(got[i][j], alone[i][j])]
            assert not unequal, f"prompt {i}: logits differ from its solo run at steps {unequal[:5]}"


@pytest.mark.parametrize(
    "model_name, threads, dtype",
    [("tiny", 1, "float32"), ("tiny", 2, "float32"), ("smollm2", 2, "float32"), ("smollm2", 2, "auto")],
)  # 2 threads: the demo's
def test_fast_path_rows_do_not_depend_on_their_batch(model_name, threads, dtype, tiny_model_path, smollm_path):
    """The fast path on CPU is batch-invariant: a row's logits are bit for bit the same whether it runs alone, with
    others from the start, or joins a running batch whose rows are longer, shorter, leaving and joining (prefill
    alone or beside other prompts, every decode step). This is what makes a seeded run reproducible whatever the
    arrival order of its requests (`sampling.py`); before it, logits moved by up to 1e-4 with the batch. `auto`:
    in the dtype `--dtype auto` serves on this CPU (bfloat16 where it measures it faster and exact)."""
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server.fastpath import FastRunner, shared_start
    from areal_lite.kit.server.weights import auto_dtype

    path = tiny_model_path if model_name == "tiny" else smollm_path
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch_dtype = auto_dtype(path, torch.device("cpu")) if dtype == "auto" else getattr(torch, dtype)
        if dtype == "auto" and torch_dtype == torch.float32:
            pytest.skip("`--dtype auto` serves float32 on this CPU: the float32 case is this case")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
        runner = FastRunner(model)
        g = torch.Generator().manual_seed(0)
        high = min(model.config.vocab_size, 40000)
        prompts = [torch.randint(10, high, (n,), generator=g).tolist() for n in (38, 38, 41, 12, 60, 5, 33, 90, 3)]
        prompts[1][:30] = prompts[0][:30]  # joined together below: their first 30 tokens run once (the shared start)
        prompts[3][:10] = prompts[4][:10] = prompts[2][:10]  # the same, 10 tokens
        n_steps = 8
        alone = {i: _logits_by_schedule(runner, prompts, [("join", [i]), ("step", n_steps)])[i] for i in range(9)}
        together = _logits_by_schedule(runner, prompts, [("join", list(range(9))), ("step", n_steps)])
        staggered = _logits_by_schedule(runner, prompts, [
            ("join", [0, 1]), ("step", 2), ("join", [2, 3, 4]), ("step", 3), ("keep", [0, 2, 3, 4]),
            ("join", [5, 6, 7, 8]), ("step", n_steps),
        ])  # fmt: skip
    finally:
        torch.set_num_threads(saved)
    assert shared_start([prompts[0], prompts[1]]) == 30 and shared_start([prompts[i] for i in (2, 3, 4)]) == 10
    _assert_as_alone((together, staggered), alone, least=5)


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_past_128_tokens_do_not_depend_on_their_batch(threads, smollm_path):
    """Contexts longer than 128 tokens keep their bits too. A row's attention sums its values over the batch's
    width (the longest row's keys, padded), and MKL's matmul groups a sum over more than 192 columns otherwise than
    a narrower one: a 150-token row beside a 230-token one, or a shared start of 175 tokens prefilled apart from its
    214-token prompt, would get other last bits (`fastpath.value_sum` sums 128 columns at a time)."""
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server.fastpath import FastRunner, padded_sums_exact, shared_start

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32).eval()
        runner = FastRunner(model)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (214, 198, 150, 230, 100)]
        prompts[1][:175] = prompts[0][:175]  # joined together: a shared start of 175 tokens, prefilled once
        n_steps = 4
        alone = {i: _logits_by_schedule(runner, prompts, [("join", [i]), ("step", n_steps)])[i] for i in range(5)}
        together = _logits_by_schedule(runner, prompts, [("join", list(range(5))), ("step", n_steps)])
        staggered = _logits_by_schedule(runner, prompts, [
            ("join", [2, 4]), ("step", 1), ("join", [3]), ("step", 2), ("keep", [2, 4]), ("join", [0, 1]),
            ("step", n_steps),
        ])  # fmt: skip
    finally:
        torch.set_num_threads(saved)
    assert padded_sums_exact(runner.head_dim, runner.heads // runner.kv_heads, threads) and runner.batch_invariant
    assert shared_start(prompts[:2]) == 175
    _assert_as_alone((together, staggered), alone, least=3)


@pytest.mark.parametrize("model_name", ["tiny", "smollm2"])  # a Qwen2 and a Llama
def test_lean_load_is_transformers_load_bit_for_bit(model_name, tiny_model_path, smollm_path):
    """The server's transformers-free load (`lean.load_lean`) gives the fast path what `from_pretrained` gives it:
    the same parameters under the same names (tied alike), the same rotary tables, so the same logits at prefill
    and every decode step, in float32 and bf16; and a tokenizer that encodes and decodes as transformers' does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_lite.kit.server.fastpath import FastRunner
    from areal_lite.kit.server.lean import lean_files, load_lean

    path = tiny_model_path if model_name == "tiny" else smollm_path
    assert lean_files(path) is None
    for dtype in (torch.float32, torch.bfloat16):
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        lean, tok = load_lean(path, dtype, torch.device("cpu"))
        ours, theirs = lean.state_dict(), ref.state_dict()
        assert list(ours) == list(theirs)
        assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in theirs)
        assert (lean.lm_head.weight is lean.model.embed_tokens.weight) == (
            ref.lm_head.weight is ref.get_input_embeddings().weight
        )
        x, positions = torch.zeros(1, dtype=dtype), torch.arange(0, 4096, 7)[None]
        for a, b in zip(lean.model.rotary_emb(x, positions), ref.model.rotary_emb(x, positions)):
            assert torch.equal(a, b)
        g = torch.Generator().manual_seed(0)
        high = min(ref.config.vocab_size, 40000)
        # bf16 on fewer tokens: without bf16 instructions (AVX2-only CPUs) a bf16 matmul is emulated, ~30x as slow as
        # float32's (AVX2-only kernels, one core); these still prefill prompts of three lengths, then decode
        lengths, steps = ((38, 12, 60), 4) if dtype == torch.float32 else ((7, 3, 10), 2)
        prompts = [torch.randint(10, high, (n,), generator=g).tolist() for n in lengths]
        schedule = [("join", [0, 1, 2]), ("step", steps)]
        got = _logits_by_schedule(FastRunner(lean), prompts, schedule)
        want = _logits_by_schedule(FastRunner(ref), prompts, schedule)
        assert all(torch.equal(a, b) for i in want for a, b in zip(got[i], want[i]))
    hf = AutoTokenizer.from_pretrained(path)
    texts = ["", "What is 3 + 4?", "  two  spaces\n\nand tabs\t", "<|im_start|>user\nhi<|im_end|>\n", "ünïcödé ✓ 数学",
             "The answer is \\boxed{42}.", "<search>capital of France</search><answer>Paris</answer>"]  # fmt: skip
    for text in texts:
        ids = hf(text)["input_ids"]
        assert tok(text)["input_ids"] == ids, text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert tok.eos_token_id == hf.eos_token_id and tok.get_vocab() == hf.get_vocab()


def test_lean_load_refuses_what_it_does_not_reproduce(tmp_path, smollm_path, monkeypatch):
    """Another model type, another RoPE, a tokenizer class that adds to tokenizer.json or a BOS it adds: `lean_files`
    says why, and the server loads through transformers instead (its log says which), as with `--no-fast-path` or
    AREAL_LITE_SERVER_TRANSFORMERS=1."""
    import json
    import logging
    import shutil

    from areal_lite.kit.server.lean import lean_files

    def variant(name: str, file: str, change: dict) -> str:
        folder = tmp_path / name
        shutil.copytree(smollm_path, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        (folder / "model.safetensors").symlink_to(f"{smollm_path}/model.safetensors")
        data = json.loads((folder / file).read_text())
        data.update(change)
        (folder / file).write_text(json.dumps(data))
        return str(folder)

    cases = {
        variant("mistral", "config.json", {"model_type": "mistral"}): "model_type 'mistral'",
        variant("llama3", "config.json", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}): "'llama3'",
        variant("gpt2tok", "tokenizer_config.json", {"tokenizer_class": "GPT2Tokenizer"}): "'GPT2Tokenizer'",
        variant("bos", "tokenizer_config.json", {"add_bos_token": True}): "adds BOS/EOS",
    }
    for folder, why in cases.items():
        assert why in (lean_files(folder) or ""), folder
    (tmp_path / "empty").mkdir()
    assert "config" in lean_files(str(tmp_path / "empty"))
    from areal_lite.kit.server import weights
    from areal_lite.kit.server.lean import LeanCausalLM
    from areal_lite.kit.server.weights import load_model

    # The module's own logger object, enabled for the call: AReaL's `getLogger` (other tests in this process) runs
    # logging.config.dictConfig, which disables the loggers that exist and swaps logging's logger registry.
    logger, lines = weights.log, []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    saved = logger.level, logger.disabled
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.disabled = False
    try:
        model, _, _ = load_model(str(tmp_path / "bos"), "cpu", "float32")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.disabled = saved[1]
    assert not isinstance(model, LeanCausalLM)
    assert "loading through transformers (the tokenizer adds BOS/EOS tokens)" in lines
    assert isinstance(load_model(smollm_path, "cpu", "float32")[0], LeanCausalLM)
    assert not isinstance(load_model(smollm_path, "cpu", "float32", lean=False)[0], LeanCausalLM)  # --no-fast-path
    monkeypatch.setenv("AREAL_LITE_SERVER_TRANSFORMERS", "1")  # bench/server_start.py's other way
    assert not isinstance(load_model(smollm_path, "cpu", "float32")[0], LeanCausalLM)


def test_dtype_auto_takes_bf16_only_where_measured_faster_and_exact(monkeypatch):
    """`--dtype auto` on a CPU: float32 without bf16 instructions, or where bf16 measured under `BF16_MIN_SPEEDUP` times
    as fast, or where its rows change with the batch; bfloat16 only when all three checks pass. A GPU: bfloat16."""
    from areal_lite.kit.server import fastpath, precision
    from areal_lite.utils import device as device_utils
    from areal_lite.utils.device import BF16_MIN_SPEEDUP

    cpu = torch.device("cpu")
    assert precision.serving_dtype(torch.device("cuda"), 576, 1536)[0] == torch.bfloat16
    assert precision.serving_dtype(torch.device("mps"), 576, 1536)[0] == torch.float32
    monkeypatch.setattr(device_utils, "cpu_native_bf16", lambda: "")
    dtype, why = precision.serving_dtype(cpu, 576, 1536)
    assert dtype == torch.float32 and "no AVX-512 BF16/AMX" in why
    monkeypatch.setattr(device_utils, "cpu_native_bf16", lambda: "AMX")
    monkeypatch.setattr(fastpath, "packs_weights", lambda dtype: True)
    monkeypatch.setattr(fastpath, "probe_linears", lambda hidden, intermediate, dtype: [])  # no real bf16 packing here
    monkeypatch.setattr(fastpath, "rows_exact", lambda bf16: True)
    monkeypatch.setattr(precision, "_decode_speedup", lambda fp32, bf16: BF16_MIN_SPEEDUP - 0.01)
    dtype, why = precision.serving_dtype(cpu, 576, 1536)
    assert dtype == torch.float32 and "1.19x as fast" in why
    monkeypatch.setattr(precision, "_decode_speedup", lambda fp32, bf16: 3.0)
    dtype, why = precision.serving_dtype(cpu, 576, 1536)
    assert (
        dtype == torch.bfloat16
        and why
        == "this CPU has AMX; a decode step's matmuls ran 3.00x as fast in bf16 as in float32, rows exact at any batch"
    )
    monkeypatch.setattr(fastpath, "rows_exact", lambda bf16: False)
    dtype, why = precision.serving_dtype(cpu, 576, 1536)
    assert dtype == torch.float32 and why.endswith("its bf16 rows change with the batch")


def test_weight_matmuls_keep_rows_exact_or_the_log_says_so(monkeypatch, tiny_model_path):
    """A CPU server's weight matmuls are chosen by what this CPU measures at start-up (`fastpath.weight_matmuls`):
    oneDNN-packed where its rows are exact, else the plain matmul where those are, else the packed ones with a
    warning that seeded requests repeat only in the same batch; the runner follows the choice."""
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server import fastpath

    threads = torch.get_num_threads()
    if fastpath.packs_weights(torch.float32):  # the kit's x86 CPUs: oneDNN's float32 rows are exact
        assert fastpath.weight_matmuls(576, 1536, torch.float32, threads)[:2] == (True, True)

    class BatchDependent:
        """A matmul whose rows change, in the last bit, above 16 rows: what the probe must catch."""

        weight = torch.randn(8, 4)

        def __call__(self, x):
            return (x @ self.weight.t()) * (1 + 2**-20 * (x.shape[0] > 16))

    assert not fastpath.rows_exact([BatchDependent()], fastpath.EXACT_COUNTS, fastpath.EXACT_MOST)
    messages = []
    handler = logging.Handler(logging.INFO)  # on the server's own logger: importing areal elsewhere replaces the root
    handler.emit = lambda record: messages.append((record.levelno, record.getMessage()))
    fastpath.log.addHandler(handler)
    saved_level = fastpath.log.level
    fastpath.log.setLevel(logging.INFO)  # as the server's process sets it
    cfg = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).config
    try:
        for exact, want in (
            (lambda pack: not pack, (False, True)),  # packed rows change, plain ones do not: plain
            (lambda pack: False, (True, False)),  # neither: packed, and the log says what that costs
        ):
            monkeypatch.setattr(fastpath, "packs_weights", lambda dtype: True)
            monkeypatch.setattr(fastpath, "probe_linears", lambda hidden, inter, dtype, pack=True: pack)
            monkeypatch.setattr(fastpath, "rows_exact", lambda pack, counts, most, f=exact: f(pack))
            fastpath.weight_matmuls.cache_clear()
            assert fastpath.weight_matmuls(cfg.hidden_size, cfg.intermediate_size, torch.float32, threads)[:2] == want
            monkeypatch.undo()  # the runner below packs for real, as the probe's answer (still cached) says
            messages.clear()
            runner = fastpath.FastRunner(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32))
            pack, invariant = want
            assert (runner.layers[0].qkv.pack, runner.lm_head.pack, runner.batch_invariant) == (pack, pack, invariant)
            [(level, text)] = [m for m in messages if m[1].startswith("weight matmuls: ")]
            if invariant:
                assert level == logging.INFO
                assert text.startswith("weight matmuls: plain (torch.mm, F.linear), each row's bits")
            else:
                assert level == logging.WARNING and text.endswith("samples the same tokens only in the same batch")
    finally:
        fastpath.log.removeHandler(handler)
        fastpath.log.setLevel(saved_level)
        fastpath.weight_matmuls.cache_clear()  # later runners measure this CPU again


def test_weight_matmuls_fall_back_to_plain_where_onednn_cannot_pack(monkeypatch):
    """A torch whose oneDNN says it is there but cannot pack weights on this CPU (an Arm build, say) gets the plain
    matmuls, measured as usual, instead of a server that fails to start."""
    from areal_lite.kit.server import fastpath

    real = fastpath.probe_linears

    def probe(hidden, inter, dtype, pack=True):
        if pack:
            raise RuntimeError("mkldnn_reorder_linear_weight: unsupported on this platform")
        return real(hidden, inter, dtype, pack)

    monkeypatch.setattr(fastpath, "packs_weights", lambda dtype: True)
    monkeypatch.setattr(fastpath, "probe_linears", probe)
    monkeypatch.setattr(fastpath, "rows_exact", lambda linears, counts, most: all(not x.pack for x in linears))
    fastpath.weight_matmuls.cache_clear()
    try:
        pack, exact, why = fastpath.weight_matmuls(64, 96, torch.float32, torch.get_num_threads())
        assert (pack, exact) == (False, True) and why.startswith("plain (torch.mm, F.linear), each row's bits")
        monkeypatch.setattr(fastpath, "rows_exact", lambda linears, counts, most: False)
        fastpath.weight_matmuls.cache_clear()
        pack, exact, why = fastpath.weight_matmuls(64, 96, torch.float32, torch.get_num_threads())
        assert (pack, exact) == (False, False) and why.startswith("plain (torch.mm, F.linear); on this CPU the plain")
    finally:
        fastpath.weight_matmuls.cache_clear()  # later runners measure this CPU again


def test_the_plain_matmul_check_also_runs_the_lm_heads_layout(monkeypatch):
    """Unpacked, the lm_head runs `F.linear` over the model's [out, in] weight, another matmul than the layers'
    transposed one: the start-up check probes that layout too, so a CPU where only the layers' plain matmul keeps
    rows exact is not given the plain path as exact."""
    from areal_lite.kit.server import fastpath

    plain = fastpath.probe_linears(64, 96, torch.float32, pack=False)
    assert [linear.wt is not None for linear in plain] == [True, True, False]
    x = torch.randn(5, 64)
    with torch.inference_mode():
        assert torch.equal(plain[2](x), torch.nn.functional.linear(x, plain[2].weight))  # the lm_head's own call
    assert len(fastpath.probe_linears(64, 96, torch.float32, pack=True)) == 2  # packed: one path for all weights

    def exact(linears, counts, most):  # packed rows change; plain ones are exact in the layers' layout only
        return all(not linear.pack and linear.wt is not None for linear in linears)

    monkeypatch.setattr(fastpath, "packs_weights", lambda dtype: True)
    monkeypatch.setattr(fastpath, "rows_exact", exact)
    fastpath.weight_matmuls.cache_clear()
    try:
        assert fastpath.weight_matmuls(64, 96, torch.float32, torch.get_num_threads())[:2] == (True, False)
    finally:
        fastpath.weight_matmuls.cache_clear()  # later runners measure this CPU again


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no oneDNN bf16 kernels")
def test_bf16_linear_runs_its_rows_in_chunks_that_keep_them_exact():
    """Above `BF16_ROWS` rows a bf16 `_Linear` runs its input in chunks (the last may be a lone row, given company),
    and the pieces are the rows' own results: the same bits as each row alone wherever `rows_exact` holds."""
    from areal_lite.kit.server import fastpath
    from areal_lite.kit.server.fastpath import BF16_ROWS

    linears = fastpath.probe_linears(64, 96, torch.bfloat16)
    up = linears[0]
    x = torch.randn(2 * BF16_ROWS + 1, 64).to(torch.bfloat16)
    with torch.inference_mode():
        whole = up(x)
        chunks = torch.cat([up(x[i : i + BF16_ROWS]) for i in range(0, len(x), BF16_ROWS)])
    assert whole.shape == (2 * BF16_ROWS + 1, 192) and torch.equal(whole, chunks)
    if fastpath.rows_exact(linears):
        assert torch.equal(whole, torch.cat([up(x[i : i + 1]) for i in range(len(x))]))


@pytest.mark.parametrize("model_name", ["tiny", "smollm2"])
def test_a_grpo_batch_gets_each_prompts_own_numbers_while_rows_leave(model_name, tiny_model_path, smollm_path):
    """The demo's shape of batch on the fast path: several samples of each prompt, prefilled once per prompt and
    copied into their rows (`PrefillKV.select` records which prompt a row holds, `StaticKV.join` copies it there),
    one row finished at its first token and never joining, then rows leaving from the middle, the last rows taking
    their places (`batch.fill_places`). Every row's logits, at every step, are bit for bit its prompt's alone."""
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server.batch import fill_places
    from areal_lite.kit.server.fastpath import FastRunner

    assert fill_places([0, 2, 3, 5, 6]) == [0, 5, 2, 3, 6]  # place 1 and 4 were left: 5 and 6 fill them, in order
    assert fill_places([1, 2, 3]) == [3, 1, 2] and fill_places([0, 1]) == [0, 1] and fill_places([]) == []
    path = tiny_model_path if model_name == "tiny" else smollm_path
    runner = FastRunner(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    g = torch.Generator().manual_seed(1)
    start = torch.randint(10, 3000, (20,), generator=g).tolist()  # a shared system prompt
    prompts = [start + torch.randint(10, 3000, (n,), generator=g).tolist() for n in (11, 9, 12)]
    rows = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]  # each row's prompt
    n_steps = 6

    def decode_rows(which: list[int], leave: list[tuple[int, int]]) -> dict:
        """Logits by (row id, step) of rows `which` prefilled together, row ids in `leave` leaving after a step."""
        got: dict = {}
        with torch.inference_mode():
            part, logits = prefill_distinct(runner, [prompts[rows[r]] for r in which])
            joined = [j for j, r in enumerate(which) if r != 1]  # row 1 "finished at its first token"
            part.select(torch.tensor(joined))
            for j in range(len(which)):
                got[which[j], 0] = logits[j]
            b = RunningBatch(runner.new_kv())
            b.add([_seq(SamplingParams(), prompt=[which[j]]) for j in joined], part, logits[joined].argmax(-1),
                  torch.tensor([len(prompts[rows[which[j]]]) for j in joined]))  # fmt: skip
            for step in range(1, n_steps + 1):
                logits = runner.decode(b)
                b.next_ids = logits.argmax(-1)
                for s, lg in zip(b.seqs, logits):
                    got[s.prompt[0], step] = lg.clone()
                gone = {r for at, r in leave if at == step}
                b.keep([j for j, s in enumerate(b.seqs) if s.prompt[0] not in gone])
        return got

    alone = {p: decode_rows([i], []) for i, p in enumerate(rows) if i == rows.index(p)}
    together = decode_rows(list(range(len(rows))), [(1, 2), (2, 5), (2, 6), (4, 0)])
    for (r, step), lg in together.items():
        want = alone[rows[r]][rows.index(rows[r]), step]
        assert torch.equal(lg, want), f"row {r} (prompt {rows[r]}) differs from its prompt alone at step {step}"
    assert {r for r, step in together if step == n_steps} == set(range(len(rows))) - {0, 1, 2, 5, 6}


def test_shared_start_is_the_common_prefix_that_leaves_each_prompt_a_token():
    from areal_lite.kit.server.fastpath import MIN_SHARED_START, shared_start

    start = list(range(100, 100 + MIN_SHARED_START + 4))
    assert shared_start([start + [1, 2], start + [1, 3], start + [4]]) == len(start)
    assert shared_start([start + [1, 2, 3], start + [1, 2, 5]]) == len(start) + 2
    assert shared_start([start, start + [7]]) == len(start) - 1  # the shorter keeps its last token
    assert shared_start([start + [1]]) == 0  # one prompt: nothing to share
    assert shared_start([start[: MIN_SHARED_START - 1] + [1], start[: MIN_SHARED_START - 1] + [2]]) == 0  # too short
    assert shared_start([[5] + start, start]) == 0


@pytest.mark.parametrize("threads, per_token", [(1, None), (2, None), (2, True)])
def test_prefill_numbers_do_not_depend_on_a_shared_start_or_chunking(threads, per_token, smollm_path, monkeypatch):
    """A prompt's prefill logits, keys and values are bit for bit the same prefilled alone (whole), beside prompts
    that share its start (which then runs once), with its attention in chunks of a few queries or of one, batched
    with the other prompts' or alone; and are the model's own forward's up to rounding. `per_token`: None takes the
    attention this CPU measured (`rows_independent_bmm`), True the one-product-per-token attention whatever it
    measured."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_lite.kit.server import fastpath

    model = AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm_path)
    chats = [[{"role": "user", "content": q}] for q in ("What is 3 + 4?", "Name a city in Peru.", "Why is ice cold?")]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chats]
    assert fastpath.shared_start(prompts) >= 20  # SmolLM2's template opens with its default system prompt
    runner = fastpath.FastRunner(model)
    if per_token is not None:
        runner.per_token_attention = per_token
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            together = runner.prefill(prompts)
            alone = [runner.prefill([p]) for p in prompts]
            # two prompts that differ in their last token only: one own token each, batched
            pair = [prompts[0], prompts[0][:-1] + [prompts[1][-1]]]
            pair_together = runner.prefill(pair)[1]
            pair_alone = [runner.prefill([p])[1][0] for p in pair]
            chunked = []  # 7 queries a product; one leaving the shared start's last token alone in its product;
            # and prompts' own tokens one prompt at a time (no batch of prompts fits in 0 scores)
            for chunk, scores in ((7, None), (fastpath.shared_start(prompts) - 1, None), (7, 0)):
                monkeypatch.setattr(fastpath, "QUERY_CHUNK", chunk)
                if scores is not None:
                    monkeypatch.setattr(fastpath, "BATCHED_SCORES", scores)
                chunked.append(runner.prefill(prompts))
            reference = [model(torch.tensor([p])).logits[0, -1] for p in prompts]
    finally:
        torch.set_num_threads(saved)
    for i, (part, logits) in enumerate(alone):
        n = len(prompts[i])
        for got_part, got_logits in (together, *chunked):
            assert torch.equal(got_logits[i], logits[0]), i
            assert torch.equal(got_part.mask[i, :n], part.mask[0]) and not got_part.mask[i, n:].any()
            for a, b in zip(part.keys + part.values, got_part.keys + got_part.values):
                assert torch.equal(b[i, :, :n], a[0]), i
        assert (logits[0] - reference[i]).abs().max().item() < 1e-3, i
    assert fastpath.shared_start(pair) == len(pair[0]) - 1
    assert all(torch.equal(pair_together[i], pair_alone[i]) for i in range(2))


def test_prefill_numbers_hold_under_mkls_avx2_kernels():
    """MKL's AVX2 kernels (what an Intel CPU without AVX-512 runs) may pick a batched matmul kernel by the row count;
    a lone token's company and the probe's choice of attention keep a prompt's bits there: the test above and the
    long-context one, run by pytest in a process where MKL is held to AVX2 (its own switch, as an AVX2-only CPU
    would have it)."""
    import os
    import subprocess
    import sys

    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("an AVX2-only CPU: MKL runs its AVX2 kernels in this process, so the test above is this test")
    tests = [f"{__file__}::test_prefill_numbers_do_not_depend_on_a_shared_start_or_chunking[1-None]",
             f"{__file__}::test_rows_past_128_tokens_do_not_depend_on_their_batch[2]"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # the outer run's report file is not ours
    env["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_the_attention_probe_is_measured_once_per_shape_and_thread_count():
    from areal_lite.kit.server import fastpath

    fastpath.rows_independent_bmm.cache_clear()
    first = fastpath.rows_independent_bmm(64, 3, torch.get_num_threads())
    assert isinstance(first, bool) and fastpath.rows_independent_bmm(64, 3, torch.get_num_threads()) is first
    assert fastpath.rows_independent_bmm.cache_info().hits == 1


def test_prefill_groups_bound_padded_tokens():
    rows = [_seq(SamplingParams(), prompt=[1] * n) for n in (3, 3, 5, 1, 9, 2)]
    groups = prefill_groups(rows, max_tokens=10)
    assert [r for g in groups for r in g] == rows  # order kept, nothing lost
    assert [[len(r.prompt) for r in g] for g in groups] == [[3, 3], [5, 1], [9], [2]]
    assert all(len(g) * max(len(r.prompt) for r in g) <= 10 for g in groups)
    assert prefill_groups([_seq(SamplingParams(), prompt=[1] * 50)], max_tokens=10)[0][0].prompt == [1] * 50


# ----------------------------------------------------------------------------------------------------------------
# the command line: defined once, in EmbeddedServerConfig

# Per launch, not per config: the launcher passes them itself.
LAUNCH_OPTIONS = {"host", "port", "random_seed", "exit_with_parent", "listen_fd"}


def test_server_options_are_the_config_fields():
    fields = {f.name for f in dataclasses.fields(EmbeddedServerConfig)}
    dests = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert dests == fields | LAUNCH_OPTIONS, dests ^ (fields | LAUNCH_OPTIONS)
    help_text = build_parser().format_help()
    for f in dataclasses.fields(EmbeddedServerConfig):
        assert f.metadata["help"], f"EmbeddedServerConfig.{f.name} needs a one-line help"
        assert "--" + f.name.replace("_", "-") in help_text


def test_config_round_trips_through_the_server_command_line(monkeypatch, capsys):
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    default = EmbeddedServerConfig(model_path="some/model")
    changed = EmbeddedServerConfig(
        model_path="other/model", dtype="bfloat16", device="cpu", max_running_requests=3, max_prefill_tokens=77,
        threads=2, context_length=512, return_original_logprob=True, decode_log_interval=0, log_level="debug",
        fast_path=False,
    )  # fmt: skip
    same = [f.name for f in dataclasses.fields(changed) if getattr(changed, f.name) == getattr(default, f.name)]
    assert not same, f"give these new fields a non-default value in this test: {same}"
    for cfg in (default, changed):
        args = vars(parse_args(cfg.cli_args()))
        assert {k: args[k] for k in dataclasses.asdict(cfg)} == dataclasses.asdict(cfg)
    # launch options keep their defaults unless passed
    args = parse_args([*default.cli_args(), "--host", "0.0.0.0", "--port", "1234", "--random-seed", "7"])
    assert (args.host, args.port, args.random_seed) == ("0.0.0.0", 1234, 7)
    with pytest.raises(SystemExit):  # the server cannot start without a model
        parse_args(EmbeddedServerConfig().cli_args())
    for device in ("mps", "gpu"):  # refused before it listens: Apple's MPS, and a name torch does not know
        with pytest.raises(SystemExit):
            parse_args([*default.cli_args(), "--device", device])
    assert "MPS lacks the float64" in capsys.readouterr().err
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")  # SGLang's switch is honoured too
    assert parse_args(default.cli_args()).return_original_logprob is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_norm_and_rotation_are_the_models_own_bit_for_bit(tiny_model_path, dtype):
    """The fast path's RMSNorm and rotary embedding (written with in-place temporaries, q and k rotated in one call)
    compute exactly what the model's own modules compute, in float32 and bf16, so its logits differ from the model's
    only where matmul kernels round differently."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from areal_lite.kit.server.fastpath import _rms_norm, _rope

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=dtype).eval()
    norm = model.model.layers[0].input_layernorm
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, model.config.hidden_size, generator=g).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)  # a trained norm is not all ones
        assert torch.equal(_rms_norm(x, norm), norm(x))
        heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        d = model.config.hidden_size // heads
        q = torch.randn(1, heads, 7, d, generator=g).to(dtype)
        k = torch.randn(1, kv_heads, 7, d, generator=g).to(dtype)
        cos, sin = model.model.rotary_emb(q, torch.arange(7)[None])
        ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
        qk = torch.cat([q, k], dim=1)[0].transpose(0, 1)  # [N, heads + kv_heads, d], as the fused qkv output
        got = _rope(qk, cos[0][:, None, :], sin[0][:, None, :])
    assert torch.equal(got[:, :heads].transpose(0, 1)[None], ref_q)
    assert torch.equal(got[:, heads:].transpose(0, 1)[None], ref_k)


def test_fast_path_serves_bf16_weights_on_any_cpu(tiny_model_path):
    """oneDNN packs bf16 weights only on CPUs with bf16 instructions (it raises elsewhere): the fast path then runs
    plain matmuls, so a bf16 server starts on any CPU and computes what the model computes."""
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server.fastpath import FastRunner

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = model(torch.tensor([PROMPTS[0]])).logits[0, -1].float()
        _, logits = prefill_distinct(FastRunner(model), [PROMPTS[0]])
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits[0].float(), ref, atol=0.05, rtol=0.02)


def test_fast_path_weights_leave_the_checkpoint_file_and_follow_updates(tiny_model_path):
    """`from_pretrained` leaves float32 weights as views of the safetensors file's private mapping; the fast path gives
    every one a copy of its own (else the first weight update copies-on-write the file page by page, and its pages
    stay resident), keeps the tied LM head tied, and a `copy_` into any layer parameter (what a weight update does)
    reaches the matmul that `refresh()` packs."""
    from transformers import AutoModelForCausalLM

    from areal_lite.kit.server.fastpath import FastRunner
    from areal_lite.utils.device import file_mappings, in_file_mapping

    def in_file(t: torch.Tensor) -> bool:
        return in_file_mapping(t, file_mappings())

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    assert in_file(model.model.layers[0].mlp.down_proj.weight)  # what from_pretrained gives: the file's pages
    runner = FastRunner(model)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert not in_file(t), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = [[5, 6, 7, 8, 9]]
    with torch.inference_mode():
        before = runner.prefill(prompt)[1]
        for name in ("self_attn.o_proj", "mlp.down_proj", "self_attn.q_proj"):
            param = model.model.layers[0].get_submodule(name).weight
            param.copy_(param * 1.5)
            runner.refresh()
            after = runner.prefill(prompt)[1]
            assert not torch.equal(before, after), name
            before = after


@pytest.mark.parametrize("shape, ops", [((960, 576), True), ((576, 1536), True), ((96, 40), True), ((960, 576), False)])
def test_a_refresh_repacks_in_place_exactly_as_a_fresh_packing(shape, ops, monkeypatch):
    """`_Linear.refresh()` after a weight update rewrites the packed copy in place (x86-64, float32, sizes that
    divide into oneDNN's blocks: SmolLM2's) or packs anew (other sizes, or a torch without `mkldnn._nbytes`/
    `data_ptr`): either way every output bit is that of a fresh packing of the new weights, at every row count, and
    the packed copy is the same object when in place."""
    from types import SimpleNamespace

    from areal_lite.kit.server.fastpath import _Linear

    def missing(*args):
        raise AttributeError("no such op in this build")

    if not ops:
        monkeypatch.setattr(torch.ops.mkldnn, "_nbytes", missing)
    gen = torch.Generator().manual_seed(0)
    n, k = shape
    module = SimpleNamespace(weight=torch.randn(n, k, generator=gen), bias=None)
    linear = _Linear([module], pack=True)
    linear.refresh()
    in_place = ops and platform.machine() in ("x86_64", "AMD64") and n % 64 == 0 and k % 16 == 0
    assert (linear._blocks is not None) == in_place
    packed = linear.packed
    with torch.inference_mode():
        module.weight.copy_(torch.randn(n, k, generator=gen))  # a weight update: in place
        linear.refresh()
        assert (linear.packed is packed) == in_place
        fresh = _Linear([SimpleNamespace(weight=module.weight.clone(), bias=None)], pack=True)
        fresh.refresh()
        x = torch.randn(40, k, generator=gen)
        for rows in (1, 2, 17, 32, 40):
            assert torch.equal(linear(x[:rows]), fresh(x[:rows])), rows
