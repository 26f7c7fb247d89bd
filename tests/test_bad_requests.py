"""Every invalid request gets a 4xx, never a 5xx, and nothing slow runs on a server's event loop (issue 31).

Against real servers on 127.0.0.1, as a client sees them: the embedded inference server on the tiny model (the
session's shared process, `embedded_server`), the RAG server (a child process over four countries of the
factbook), and the OpenAI-compatible chat endpoint (its own thread and event loop in this process, in front of the
inference server through the real engine).

- One test per failure the issue reproduced: deeply nested JSON (1), `chat_template_kwargs` repeating a key the
  endpoint sets itself (2), `max_tokens` beyond the context (3), `frequency_penalty` (4), a 10 MB body (5).
- Property-based tests (hypothesis) throw generated bodies at each server's routes: arbitrary JSON, the route's own
  fields with values of any type (huge numbers, NaN, unicode with lone surrogates, nesting), valid bodies with one
  field replaced, raw bytes and deep bracket runs. Each answer must be a 2xx, or a 4xx with an error message;
  `/health` must answer at once after it; a refused request must leave the server's counters as they were (an
  accepted one must move them by exactly what it answered). `AREAL_LITE_SOAK_EXAMPLES` sets the number of bodies
  per test (default 40, so `make test` stays fast; `make soak` sets 500 or more).
- Timing checks leave margins for a loaded 2-core machine (a few hundred ms where the servers take a few), far
  below the seconds the old event-loop blocking took.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import time

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_procs import wait_until  # one copy of the polling helper

from areal_lite import GenerationHyperparameters
from areal_lite.experimental.openai.proxy.protocol import RESERVED_TEMPLATE_KWARGS
from areal_lite.experimental.openai.proxy.server import ChatServer
from areal_lite.kit.server.protocol import SGLANG_CONTROL_FIELDS, SGLANG_SAMPLING_KEYS
from areal_lite.utils.jsonhttp import MAX_JSON_DEPTH

EXAMPLES = int(os.environ.get("AREAL_LITE_SOAK_EXAMPLES", "40"))
SOAK = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # nothing written next to the sources
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
# /health takes ~2 ms; during a 10 MB refusal the worst seen on the loaded 2-core machine was ~0.3 s (the OS gives
# the loop's thread no core for a while); the old event-loop blocking took 8-20 s.
HEALTH_BUDGET_S = 0.6
USER = [{"role": "user", "content": "Count to three."}]
BIG_TEXT = "hello world, this is text " * 400_000  # 10.4 MB: ~10 s of tokenization on one core


# ------------------------------------------------------------------------------------------------ HTTP client


def send(url: str, raw: bytes | None = None, method: str | None = None, key: str | None = None, timeout: float = 120):
    """(status, JSON body or text, seconds) of one request; 4xx/5xx are returned, not raised."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    t0 = time.perf_counter()
    r = requests.request(method or ("GET" if raw is None else "POST"), url, data=raw, headers=headers, timeout=timeout)
    took = time.perf_counter() - t0
    try:
        return r.status_code, r.json(), took
    except ValueError:
        return r.status_code, r.text, took


def dump(value) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as Python writes them (json.loads accepts them)


def error_message(body) -> str:
    """The message of an error body: the kit's `{"error": str}`, OpenAI's `{"error": {...}}`, or SGLang's plain text
    (/flush_cache)."""
    if isinstance(body, str):
        return body.strip()
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("message", "") if isinstance(err, dict) else (err or "")


def assert_answered(status: int, body, what) -> None:
    """A 2xx, or a 4xx with an error message: never a 5xx."""
    assert status < 500, f"{what}: HTTP {status} {body!r:.500}"
    if status >= 400:
        assert error_message(body), f"{what}: HTTP {status} without an error message: {body!r:.300}"


def assert_healthy(url: str) -> None:
    status, _, took = send(url, timeout=30)
    assert status == 200 and took < 5, f"{url} answered {status} after {took:.2f} s"


# ------------------------------------------------------------------------------------------------ servers


@pytest.fixture(scope="module")
def inference(embedded_server) -> str:
    return f"http://{embedded_server.address}"


@pytest.fixture(scope="module")
def chat(engine, tok):
    with ChatServer(engine, tok, GenerationHyperparameters(max_new_tokens=4), model="tiny") as server:
        yield server


@pytest.fixture(scope="module")
def session(chat):
    session = chat.open_session()
    yield session
    chat.close_session(session.api_key)


def chat_url(chat) -> str:
    return chat.base_url[: -len("/v1")]


def post_chat(chat, session, body, **kw):
    raw = body if isinstance(body, bytes) else dump({"model": "tiny", "messages": USER, **body})
    return send(chat_url(chat) + "/v1/chat/completions", raw, key=session.api_key, **kw)


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    from areal_lite.dataset.factbook import build_factbook_corpus
    from areal_lite.kit.rag import launch_rag_server

    corpus = build_factbook_corpus(str(tmp_path_factory.mktemp("rag") / "factbook4.jsonl"), max_countries=4)
    with launch_rag_server(corpus, retriever="bm25") as handle:
        yield f"http://{handle.address}"


def inference_counters(url: str) -> dict:
    """What a request that the server refused must not have changed."""
    info = send(url + "/server_info")[1]
    keys = ("prompt_tokens", "generated_tokens", "finished_requests", "aborted_requests", "weight_updates")
    return {k: info[k] for k in keys} | {"weight_version": info["weight_version"], "paused": info["paused"]}


# ------------------------------------------------------------------------------------------------ failure 1: depth


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 500, 100_000])
def test_deeply_nested_json_gets_400_on_every_server(inference, chat, session, rag, depth):
    """Before: '[' * 100000 made json.loads raise RecursionError, answered 500 by both servers."""
    deep = nested(depth)
    cases = [
        (inference + "/generate", b'{"input_ids": ' + deep + b"}", None),
        (inference + "/pause_generation", deep, None),
        (chat_url(chat) + "/v1/chat/completions", b'{"messages": [], "chat_template_kwargs": {"x": ' + deep + b"}}",
         session.api_key),
        (rag + "/retrieve", b'{"queries": ' + deep + b"}", None),
    ]  # fmt: skip
    for url, raw, key in cases:
        status, body, _ = send(url, raw, key=key)
        assert status == 400, (url, status, body)
        assert f"at most {MAX_JSON_DEPTH} levels" in error_message(body), (url, body)
    assert_healthy(inference + "/health")
    assert_healthy(rag + "/health")


def test_nesting_within_the_limit_and_brackets_in_strings_are_fine(chat, session):
    kwargs = {"deep": json.loads(nested(MAX_JSON_DEPTH - 4)), "text": "[" * 5000}
    status, body, _ = post_chat(chat, session, {"max_tokens": 1, "chat_template_kwargs": kwargs})
    assert status == 200, body


# ------------------------------------------------------------------------------------------------ failure 2


@pytest.mark.parametrize("key", ["add_generation_prompt", "tokenize", "messages", "tools", "chat_template"])
def test_chat_template_kwargs_cannot_set_what_the_endpoint_sets(chat, session, key):
    """Before: {"add_generation_prompt": false} gave 500 ("got multiple values for keyword argument")."""
    status, body, _ = post_chat(chat, session, {"chat_template_kwargs": {key: False}})
    assert status == 400, body
    err = body["error"]
    assert err["param"] == "chat_template_kwargs" and f"'{key}'" in err["message"], err
    status, body, _ = post_chat(chat, session, {"max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, body  # a variable of the template itself passes


def test_the_reserved_keys_are_every_named_argument_of_the_template_call():
    """A transformers release that adds an argument to apply_chat_template must be added to the reserved keys."""
    import inspect

    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    named = {
        name
        for fn in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template)
        for name, p in inspect.signature(fn).parameters.items()
        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    assert named <= RESERVED_TEMPLATE_KWARGS, named - RESERVED_TEMPLATE_KWARGS


# ------------------------------------------------------------------------------------------------ failure 3


@pytest.mark.parametrize(
    "field,nearest",
    [("return_logprobs", "return_logprob"), ("sampling_param", "sampling_params"), ("input_id", "input_ids")],
)
def test_a_misspelt_generate_field_is_a_400_naming_the_nearest(inference, field, nearest):
    good = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    misspelt = {(field if key == nearest else key): value for key, value in good.items()}
    before = inference_counters(inference)
    status, answer, _ = send(inference + "/generate", json.dumps(misspelt).encode())
    assert status == 400, answer
    assert f"`{field}`" in answer["error"] and f"`{nearest}`" in answer["error"], answer
    assert inference_counters(inference) == before  # refused before any work
    status, answer, _ = send(inference + "/generate", json.dumps(good).encode())  # the server goes on
    assert status == 200 and len(answer["meta_info"]["output_token_logprobs"]) == 2, answer


def test_sglang_fields_the_server_does_not_implement_pass_at_their_neutral_values(inference):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}, "return_hidden_states": False,
            "priority": None, "custom_labels": {}, "stream": False, "logprob_start_len": -1}  # fmt: skip
    status, answer, _ = send(inference + "/generate", json.dumps(body).encode())
    assert status == 200, answer


# ------------------------------------------------------------------------------------------------ control fields
# Before: the control routes ignored keys they do not know, as SGLang does, so `{"mod": "retract"}` paused in the
# default mode (abort: the running work was lost), `weigth_version` left the version at "1" and `{"rid_": ...}`
# aborted nothing, each with a 200. Now each is a 400 naming the nearest field, and nothing changes.

LONG_RID = "control-fields-long"
LONG = {"input_ids": [5, 6, 7], "rid": LONG_RID, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}


def _refused_naming(url: str, path: str, body: dict, field: str, nearest: str) -> None:
    status, answer, _ = send(url + path, dump(body))
    assert status == 400 and f"`{field}`" in answer["error"] and f"`{nearest}`" in answer["error"], answer


def _ends_by_abort_request(url: str, running: concurrent.futures.Future) -> None:
    """End the long request by rid: it must have run until then (aborted by this call, by no earlier one)."""
    assert send(url + "/abort_request", dump({"rid": LONG_RID}))[0] == 200
    status, out, _ = running.result(timeout=60)
    assert status == 200 and out["meta_info"]["finish_reason"]["message"] == "Aborted by abort_request.", out


def _start_long(pool, url: str) -> concurrent.futures.Future:
    running = pool.submit(send, url + "/generate", dump(LONG))
    started = wait_until(lambda: send(url + "/server_info")[1]["num_running"] >= 1, timeout=30)  # observable state
    assert started, "the long request never started"
    return running


def test_a_misspelt_pause_field_is_refused_and_the_work_in_flight_kept(inference):
    before = inference_counters(inference)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = _start_long(pool, inference)
        _refused_naming(inference, "/pause_generation", {"mod": "retract"}, "mod", "mode")
        assert inference_counters(inference)["paused"] is False and not running.done()  # no pause, no abort
        # the body meant: retract keeps the request, which runs on after continue_generation
        assert send(inference + "/pause_generation", dump({"mode": "retract"}))[0] == 200
        assert inference_counters(inference)["paused"] is True
        assert send(inference + "/continue_generation", b"{}")[0] == 200
        _ends_by_abort_request(inference, running)
    assert inference_counters(inference)["aborted_requests"] == before["aborted_requests"] + 1


@pytest.mark.parametrize(
    "body,field,nearest", [({"rid_": LONG_RID}, "rid_", "rid"), ({"abort-all": True}, "abort-all", "abort_all")]
)
def test_a_misspelt_abort_field_is_refused_and_aborts_nothing(inference, body, field, nearest):
    before = inference_counters(inference)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = _start_long(pool, inference)
        _refused_naming(inference, "/abort_request", body, field, nearest)
        assert inference_counters(inference)["aborted_requests"] == before["aborted_requests"]
        assert not running.done() and send(inference + "/server_info")[1]["num_running"] >= 1
        _ends_by_abort_request(inference, running)


def test_a_misspelt_weight_update_field_is_refused_and_the_version_kept(inference, tiny_model_path):
    before = inference_counters(inference)
    body = {"model_path": str(tiny_model_path), "weigth_version": "v7"}
    _refused_naming(inference, "/update_weights_from_disk", body, "weigth_version", "weight_version")
    assert inference_counters(inference) == before  # no update: same version, same count of updates


def _every_field_bodies(tiny_model_path: str, version: str, missing: str) -> dict:
    """One body per control route with every field SGLang defines: what the route acts on set to change nothing on
    the shared server, the rest at their neutral values."""
    base = {"rid": None, "http_worker_ipc": None}
    return {
        "/pause_generation": {**base, "mode": "in_place"},
        "/continue_generation": {**base, "torch_empty_cache": False},
        "/abort_request": {**base, "rid": "no-such-request", "abort_all": False, "finished_reason": None,
                           "abort_message": None, "weight_versions": None},
        "/update_weights_from_disk": {**base, "model_path": tiny_model_path, "load_format": None,
                                      "abort_all_requests": False, "weight_version": version, "is_async": False,
                                      "torch_empty_cache": True, "keep_pause": False, "recapture_cuda_graph": False,
                                      "token_step": 0, "flush_cache": True, "manifest": None},
        "/load_lora_adapter": {**base, "lora_name": "a", "lora_path": missing, "pinned": False, "lora_id": None},
        "/unload_lora_adapter": {**base, "lora_name": "a", "lora_id": None},
        "/flush_cache": {},
    }  # fmt: skip


def test_every_field_sglang_defines_for_a_control_route_is_accepted(inference, tiny_model_path, tmp_path):
    greedy = dump({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    outputs = send(inference + "/generate", greedy)[1]["output_ids"]
    version = inference_counters(inference)["weight_version"]
    bodies = _every_field_bodies(str(tiny_model_path), version, str(tmp_path / "missing"))
    assert {route: tuple(body) for route, body in bodies.items()} == SGLANG_CONTROL_FIELDS
    for route, body in bodies.items():
        status, answer, _ = send(inference + route, dump(body))
        if route.endswith("_lora_adapter"):  # the body passed; the adapter is the loader's to refuse (not shared)
            assert status == 400 and answer["success"] is False, (route, answer)
            assert "is not a directory" in answer["error_message"] or "is not loaded" in answer["error_message"]
        else:
            assert status == 200, (route, answer)
    after = inference_counters(inference)
    assert after["weight_version"] == version and after["paused"] is False  # the same weights, reloaded
    assert send(inference + "/generate", greedy)[1]["output_ids"] == outputs


def test_the_control_fields_are_sglangs():
    """Each route's list is the fields of the request type SGLang's own handler reads its body into (none for
    /flush_cache), read from SGLang's source: http_server.py for the type, io_struct.py for its fields."""
    import ast

    from test_sglang_conformance import sglang_dir

    def parse(*parts):
        with open(os.path.join(sglang_dir(), "srt", *parts)) as f:
            return ast.parse(f.read())

    classes = {n.name: n for n in parse("managers", "io_struct.py").body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> tuple:
        cls = classes[name]
        inherited = sum((fields(b.id) for b in cls.bases if isinstance(b, ast.Name) and b.id in classes), ())
        own = tuple(s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
        return inherited + own

    handlers = {}  # route -> the fields of its `Annotated[<type>, Body()]` parameter; () when it reads no body
    for fn in parse("entrypoints", "http_server.py").body:
        routes = [d.args[0].value for d in getattr(fn, "decorator_list", []) if isinstance(d, ast.Call) and d.args
                  and isinstance(d.args[0], ast.Constant) and d.args[0].value in SGLANG_CONTROL_FIELDS]  # fmt: skip
        if not routes:
            continue
        bodies = [a.annotation.slice.elts[0].id for a in fn.args.args
                  if a.annotation is not None and "Body()" in ast.unparse(a.annotation)]  # fmt: skip
        for route in routes:
            handlers[route] = fields(bodies[0]) if bodies else ()
    assert handlers == SGLANG_CONTROL_FIELDS


def test_max_tokens_beyond_the_context_is_judged_by_the_endpoint(chat, session):
    """Before: the engine's 400 came back as a 502. The endpoint now says the limit, as OpenAI and vLLM do."""
    status, body, _ = post_chat(chat, session, {"max_tokens": 10**9})
    assert status == 400, body
    err = body["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens", err
    assert "maximum context length is 4096 tokens" in err["message"], err
    assert "1000000000 in the completion" in err["message"], err
    # The limit is exact: the largest max_tokens that fits is served (the session caps what is generated).
    prompt = post_chat(chat, session, {"max_tokens": 1})[1]["usage"]["prompt_tokens"]
    status, body, _ = post_chat(chat, session, {"max_tokens": 4096 - prompt + 1})
    assert status == 400 and "maximum context length" in body["error"]["message"], body
    small = chat.open_session(GenerationHyperparameters(max_new_tokens=4, max_tokens=prompt + 3))
    try:
        status, body, _ = post_chat(chat, small, {"max_tokens": 4096 - prompt})
        assert status == 200 and body["usage"]["completion_tokens"] <= 3, body
    finally:
        chat.close_session(small.api_key)


def test_an_engine_refusal_is_passed_on_as_a_4xx(engine, tok):
    """An endpoint told a larger context than its server's lets the request through; the server's 400 must come
    back as a 400 with the server's message (before: 502 "the inference engine failed")."""
    with ChatServer(engine, tok, GenerationHyperparameters(max_new_tokens=4), context_length=10**6) as server:
        session = server.open_session()
        status, body, _ = post_chat(server, session, {"max_tokens": 5000})
        assert status == 400, body
        assert "exceeds the context length 4096" in body["error"]["message"], body
        status, body, _ = post_chat(server, session, {"max_tokens": 2})
        assert status == 200, body


# ------------------------------------------------------------------------------------------------ failure 4


def test_frequency_penalty_works_end_to_end(chat, session, inference):
    """Before: the chat layer accepted frequency_penalty and the inference server refused it: 502. Now the server
    implements it (and presence_penalty; their exactness is in test_serve.py). The chat layer has no way to pass
    presence_penalty on (AReaL's GenerationHyperparameters has no such field), so it refuses it up front."""
    before = len(session.cache)
    status, body, _ = post_chat(chat, session, {"max_tokens": 3, "frequency_penalty": 0.5})
    assert status == 200, body
    assert len(session.cache) == before + 1
    for body in ({"frequency_penalty": 2.5}, {"presence_penalty": 0.5}):
        status, out, _ = post_chat(chat, session, body)
        assert status == 400 and out["error"]["param"] == next(iter(body)), out
    for key in ("frequency_penalty", "presence_penalty"):
        raw = dump({"input_ids": [1, 2], "sampling_params": {key: 0.5, "max_new_tokens": 2}})
        assert send(inference + "/generate", raw)[0] == 200
        raw = dump({"input_ids": [1, 2], "sampling_params": {key: 2.5}})
        status, out, _ = send(inference + "/generate", raw)
        assert status == 400 and f"{key} must be in [-2, 2]" in out["error"], out


# ------------------------------------------------------------------------------------------------ failure 5


def _while_running(work, probes: dict):
    """Run `work()` (a request with a 10 MB body) on a thread; meanwhile call each probe in turn until it finishes.
    Every probe must answer within `HEALTH_BUDGET_S` each time. Returns what `work()` returned."""
    slowest = dict.fromkeys(probes, 0.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(work)
        while not fut.done():
            for name, probe in probes.items():
                slowest[name] = max(slowest[name], probe())
        result = fut.result()
    for name, took in slowest.items():
        assert took < HEALTH_BUDGET_S, f"{name} took {took:.2f} s while a 10 MB body was being refused"
    return result


def test_a_10mb_prompt_does_not_hold_up_the_inference_server(inference, tok):
    """Before: tokenizing it on the event loop blocked /health, pause and abort for 7-10 s. Now it is refused from
    its length alone (`token_lower_bound`), within a second: the probes have nothing to wait for."""

    def probe(path, body=None):
        def run():
            status, out, took = send(inference + path, None if body is None else dump(body))
            assert status == 200, (path, out)
            return took

        return run

    probes = {
        "GET /health": probe("/health"),
        "GET /server_info": probe("/server_info"),
        "POST /abort_request": probe("/abort_request", {"rid": "no-such-request"}),
        "POST /pause_generation": probe("/pause_generation", {"mode": "in_place"}),
        "POST /continue_generation": probe("/continue_generation", {}),
    }
    before = inference_counters(inference)
    status, body, took = _while_running(lambda: send(inference + "/generate", dump({"text": BIG_TEXT})), probes)
    assert status == 400 and "longer than the context length 4096" in body["error"], body
    assert took < 2.0, f"refusing a 10 MB prompt took {took:.1f} s"
    assert inference_counters(inference) == before
    fits = "hello world, this is text " * 200  # long enough to be counted first, then tokenized as always
    status, out, _ = send(inference + "/generate", dump({"text": fits, "sampling_params": {"max_new_tokens": 1}}))
    assert status == 200 and out["meta_info"]["prompt_tokens"] == len(tok(fits)["input_ids"]), out


def test_a_10mb_message_does_not_hold_up_the_chat_endpoint(chat, session):
    def health():
        status, _, took = send(chat_url(chat) + "/health")
        assert status == 200
        return took

    before = chat.stats()["completions"]
    big = {"messages": [{"role": "user", "content": BIG_TEXT}]}
    t0 = time.perf_counter()
    status, body, _ = _while_running(lambda: post_chat(chat, session, big), {"GET /health": health})
    took = time.perf_counter() - t0
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    message = body["error"]["message"]
    assert "maximum context length is 4096 tokens. However, your messages resulted in at least" in message, body
    assert took < 2.5, f"refusing a 10 MB message took {took:.1f} s"
    assert chat.stats()["completions"] == before


def declared_too_large(url: str, path: str, size: int) -> tuple[int, str, float]:
    """Announce a body of `size` bytes and send none of it: (status, response text, seconds to the answer). A server
    that waits for the body before judging its size never answers (the socket times out)."""
    host, port = url[len("http://") :].split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    t0 = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    took = time.perf_counter() - t0
    return int(answer.split(b" ", 2)[1]), answer.decode(errors="replace"), took


def test_bodies_over_the_size_limit_get_413_before_they_are_read(inference, chat, rag):
    from areal_lite.experimental.openai.proxy.server import MAX_BODY_BYTES as CHAT_MAX
    from areal_lite.kit.rag import MAX_BODY_BYTES as RAG_MAX
    from areal_lite.kit.server.app import MAX_BODY_BYTES as SERVE_MAX

    for url, path, limit in [
        (inference, "/generate", SERVE_MAX),
        (chat_url(chat), "/v1/chat/completions", CHAT_MAX),
        (rag, "/retrieve", RAG_MAX),
    ]:
        status, text, took = declared_too_large(url, path, limit + 1)
        assert status == 413 and f"limit of {limit} bytes" in text, text
        assert took < 5, f"{url}{path} took {took:.1f} s to refuse a body it need not read"
    # a body actually sent, over the RAG server's 1 MiB
    status, body, _ = send(rag + "/retrieve", dump({"queries": ["x" * RAG_MAX]}))
    assert status == 413 and f"limit of {RAG_MAX} bytes" in body["error"], body
    for url in (inference, chat_url(chat), rag):
        assert_healthy(url + "/health")


# ------------------------------------------------------------------------------------------------ generated bodies

SURROGATES = st.characters(exclude_categories=())  # lone surrogates included: JSON can carry them as \\ud800
TEXT = st.text(SURROGATES, max_size=12)
HUGE = st.sampled_from([10**9, 2**31, 2**63, 2**64 + 1, 10**100, 10**4000, -(10**100), 1e308, -1e308, 5e-324])
# Small or beyond every limit: a valid mid-sized count (n = 3000 samples, 3000 tokens) would only make the test slow.
NUMBER = st.one_of(st.integers(-3, 8), HUGE, st.floats(allow_nan=True, allow_infinity=True))
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
JSON = st.recursive(
    SCALAR, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4), max_leaves=10
)
RAW = st.one_of(
    st.binary(max_size=40),
    st.integers(MAX_JSON_DEPTH - 5, 3000).map(nested),
    st.integers(1, 3000).map(lambda d: b"{" * d),
    st.sampled_from([b"", b"null", b"NaN", b'"\\ud800"', b"1" * 5000, b"{" + b'"a":1,' * 3 + b"}", b"\xef\xbb\xbf{}"]),
)


def generated_bodies(fields: dict, valid) -> st.SearchStrategy:
    """Raw bytes, or JSON: arbitrary, the route's own fields with plausible or arbitrary values, valid bodies, and
    valid bodies with one field replaced by anything."""
    plausible = {k: st.one_of(v, JSON) for k, v in fields.items()}
    some_fields = st.fixed_dictionaries({}, optional=plausible)
    one_changed = st.tuples(valid, st.sampled_from(sorted(fields)), JSON).map(lambda t: {**t[0], t[1]: t[2]})
    deep_field = st.tuples(st.sampled_from(sorted(fields)), st.integers(MAX_JSON_DEPTH - 3, 2000)).map(
        lambda t: b'{"' + t[0].encode() + b'": ' + nested(t[1]) + b"}"
    )
    return st.one_of(RAW, deep_field, st.one_of(JSON, some_fields, one_changed, valid, valid).map(dump))


TOKENS = st.lists(st.integers(0, 4000), min_size=1, max_size=6)
SAMPLING = st.fixed_dictionaries(
    {"max_new_tokens": st.integers(0, 4)},
    optional={
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "top_k": st.integers(-1, 50),
        "n": st.integers(1, 2),
        "stop": st.lists(TEXT, max_size=2),
        "frequency_penalty": st.floats(-2, 2),
        "presence_penalty": st.floats(-2, 2),
        "ignore_eos": st.booleans(),
    },
)
GENERATE_VALID = st.fixed_dictionaries(
    {"input_ids": TOKENS | st.lists(TOKENS, min_size=1, max_size=3), "sampling_params": SAMPLING},
    optional={"return_logprob": st.booleans(), "rid": st.text(min_size=1, max_size=8)},
)
GENERATE_FIELDS = {
    "input_ids": TOKENS | st.lists(st.lists(NUMBER, max_size=4), max_size=3),
    "text": TEXT | st.lists(TEXT, max_size=3),
    "sampling_params": st.fixed_dictionaries({}, optional={k: JSON for k in SGLANG_SAMPLING_KEYS}) | SAMPLING,
    "rid": TEXT | st.lists(TEXT, max_size=3),
    "return_logprob": st.booleans() | st.lists(st.booleans(), max_size=3),
    "return_text_in_logprobs": st.booleans(),
    "stream": st.booleans(),
    "logprob_start_len": NUMBER,
    "top_logprobs_num": NUMBER,
    "token_ids_logprob": st.lists(NUMBER, max_size=2),
    "input_embeds": JSON,
}


@SOAK
@given(raw=generated_bodies(GENERATE_FIELDS, GENERATE_VALID))
def test_generated_bodies_on_generate(inference, raw):
    before = inference_counters(inference)
    status, body, _ = send(inference + "/generate", raw)
    assert_answered(status, body, raw[:300])
    after = inference_counters(inference)
    if status >= 400:
        assert after == before, (raw[:300], body)
    else:
        rows = body if isinstance(body, list) else [body]
        made = sum(r["meta_info"]["completion_tokens"] for r in rows)
        assert after["generated_tokens"] - before["generated_tokens"] == made
        assert after["finished_requests"] - before["finished_requests"] == len(rows)
    assert_healthy(inference + "/health")


CONTROL_ROUTES = ["/pause_generation", "/continue_generation", "/abort_request", "/flush_cache",
                  "/update_weights_from_disk", "/init_weights_update_group", "/load_lora_adapter",
                  "/unload_lora_adapter"]  # fmt: skip
CONTROL_FIELDS = {
    "mode": st.sampled_from(["abort", "retract", "in_place", "sideways"]),
    "rid": TEXT,
    "abort_all": st.booleans(),
    "model_path": TEXT,
    "weight_version": TEXT,
    "abort_all_requests": st.booleans(),
    "flush_cache": st.booleans(),
    "lora_name": TEXT,
    "lora_path": TEXT,
    "pinned": st.booleans(),
}


@SOAK
@given(route=st.sampled_from(CONTROL_ROUTES), raw=generated_bodies(CONTROL_FIELDS, st.just({})))
def test_generated_bodies_on_the_control_routes(inference, route, raw):
    before = inference_counters(inference)
    try:
        status, body, _ = send(inference + route, raw)
        assert_answered(status, body, (route, raw[:300]))
    finally:
        send(inference + "/continue_generation", b"{}")  # a valid pause must not hold the next example
    assert inference_counters(inference) == before, (route, raw[:300])
    assert_healthy(inference + "/health")


MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
                                optional={"content": TEXT | JSON, "tool_call_id": TEXT, "name": TEXT,
                                          "tool_calls": JSON})  # fmt: skip
NAME = st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAME})})
CHAT_VALID = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "messages": st.just(USER) | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": TEXT}),
                                             min_size=1, max_size=2),
        "max_tokens": st.integers(1, 3),
    },
    optional={
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "n": st.integers(1, 2),
        "stop": st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=2),
        "frequency_penalty": st.floats(-2, 2),
        "logprobs": st.booleans(),
        "stream": st.booleans(),
        "store": st.booleans(),
        "chat_template_kwargs": st.dictionaries(NAME, JSON, max_size=2),
    },
)  # fmt: skip
CHAT_FIELDS = {
    "messages": st.lists(MESSAGE, max_size=3),
    "model": TEXT,
    "tools": st.lists(TOOL | JSON, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | JSON,
    "temperature": NUMBER, "top_p": NUMBER, "top_k": NUMBER, "n": NUMBER,
    "max_tokens": NUMBER, "max_completion_tokens": NUMBER,
    "stop": TEXT | st.lists(TEXT, max_size=5),
    "stream": st.booleans(), "stream_options": JSON, "logprobs": st.booleans(), "top_logprobs": NUMBER,
    "frequency_penalty": NUMBER, "presence_penalty": NUMBER, "logit_bias": JSON, "response_format": JSON,
    "chat_template_kwargs": st.dictionaries(TEXT, JSON, max_size=3), "return_token_ids": st.booleans(),
    "store": JSON, "seed": NUMBER, "user": TEXT,
}  # fmt: skip


@SOAK
@given(raw=generated_bodies(CHAT_FIELDS, CHAT_VALID))
def test_generated_bodies_on_chat_completions(chat, session, inference, raw):
    before, recorded, engine_before = chat.stats(), len(session.cache), inference_counters(inference)
    status, body, _ = post_chat(chat, session, raw)
    assert_answered(status, body, raw[:300])
    after = chat.stats()
    assert after["requests"] == before["requests"] + 1
    if status >= 400:
        assert after["errors"] == before["errors"] + 1
        assert after["completions"] == before["completions"] and len(session.cache) == recorded, raw[:300]
        assert inference_counters(inference) == engine_before, raw[:300]
    else:
        assert after["errors"] == before["errors"]
        assert after["completions"] > before["completions"]
    assert_healthy(chat_url(chat) + "/health")


RETRIEVE_FIELDS = {"queries": st.lists(TEXT, max_size=3) | TEXT, "topk": NUMBER, "return_scores": st.booleans()}
RETRIEVE_VALID = st.fixed_dictionaries(
    {"queries": st.lists(st.text(min_size=1, max_size=12).filter(str.strip), min_size=1, max_size=3)},
    optional={"topk": st.integers(1, 5), "return_scores": st.booleans()},
)


@SOAK
@given(route=st.sampled_from(["/retrieve", "/access"]), raw=generated_bodies(
    RETRIEVE_FIELDS | {"urls": st.lists(TEXT, max_size=3)}, RETRIEVE_VALID))  # fmt: skip
def test_generated_bodies_on_the_rag_server(rag, route, raw):
    before = send(rag + "/health")[1]["served"]
    status, body, _ = send(rag + route, raw)
    assert_answered(status, body, (route, raw[:300]))
    after = send(rag + "/health")[1]["served"]
    key = route.strip("/")
    assert after == (before if status >= 400 else {**before, key: before[key] + 1}), (route, raw[:300])
    assert_healthy(rag + "/health")


TEXT_CHAR = st.characters(exclude_categories=("Cs",))  # any character valid in a JSON string once parsed


@settings(max_examples=int(os.environ.get("AREAL_LITE_SOAK_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(text=st.text(min_size=0, max_size=3000) | st.builds(lambda c, n: c * n, TEXT_CHAR, st.integers(1, 5000)))
def test_the_length_bound_never_exceeds_the_real_token_count(tok, text):
    """A prompt refused from its length alone (`token_lower_bound`) would have been refused after tokenizing too.
    Texts are what a parsed body can hold: no lone surrogate, which `parse_json_bytes` refuses (tested above) and no
    tokenizer can encode (`st.characters()` draws one now and then: this test once failed on '\\ud800')."""
    from areal_lite.utils.hf_utils import count_tokens, token_lower_bound

    assert token_lower_bound(tok, text) <= count_tokens(tok, text, add_special_tokens=False)


class _CountingVocab:
    """A tokenizer as `token_lower_bound` reads it, counting its walks over the vocabulary."""

    def __init__(self, tok):
        self.tok, self.walks = tok, 0

    def get_vocab(self):
        self.walks += 1
        return self.tok.get_vocab()


def test_servers_find_the_longest_token_before_the_first_long_request(tok, tiny_model_path):
    """The walk over the vocabulary that `token_lower_bound` needs is made once, when the chat endpoint is built and
    while the inference server loads: a 10 MB request never makes it beside the event loop."""
    import argparse
    import asyncio
    from collections import Counter

    from areal_lite.experimental.openai.proxy.server import ChatCompleter
    from areal_lite.kit.server.cli import _load_unless_stopped
    from areal_lite.utils.hf_utils import longest_token, token_lower_bound

    counting = _CountingVocab(tok)
    ChatCompleter(None, counting, None, Counter(), context_length=4096)
    assert counting.walks == 1
    assert longest_token(counting) == max(len(t) for t in tok.get_vocab())
    assert token_lower_bound(counting, "x" * 10**6) == 10**6 // (4 * longest_token(tok))
    assert counting.walks == 1

    args = argparse.Namespace(model_path=tiny_model_path, device="cpu", dtype="float32", fast_path=True)
    model, loaded_tok, _ = asyncio.run(_load_unless_stopped(args, asyncio.Event()))
    vocab_walks = []
    loaded_tok.get_vocab = lambda: vocab_walks.append(1) or {}  # a walk from here on would be recorded
    assert longest_token(loaded_tok) == max(len(t) for t in tok.get_vocab())
    assert vocab_walks == []


def test_an_error_describes_a_bad_value_by_its_type_and_a_short_scalar_by_its_value_too():
    from areal_lite.utils.jsonhttp import describe

    got = [describe(v) for v in ([1, 2], {"a": 1}, 5, "x", None)]
    assert got == ["list", "dict", "int 5", 'str "x"', "NoneType null"]
    assert describe("y" * 80) == "str"  # too long to quote
