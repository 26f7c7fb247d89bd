"""The OpenAI-compatible chat endpoint (`experimental.openai.proxy.server`), driven by the official `openai` SDK.

Against the kit's real embedded server on the tiny model: models, completions, `n > 1`, streaming, 20+ malformed
bodies (each a 4xx in OpenAI's error shape, the server still serving), pause/resume, token exactness over three
turns, the agent workflow under `rollout_batch` with groups followed by one GRPO step, and the same scripted agent
through AReaL 1.0.4's own `ArealOpenAI` client (same rows). Tool calls end to end use a scripted engine, since a
random model cannot be made to write one; the OpenAI Agents SDK runs a tool agent through it, streamed and not; the
tool-call accounting runs on SmolLM2-135M itself (compact syntax).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import socket
import threading
import time

import openai
import pytest
import requests
import torch

from areal_lite import GenerationHyperparameters, ModelResponse, check_trajectory
from areal_lite.experimental.openai.proxy.protocol import ChatRequestError, parse_chat_request
from areal_lite.experimental.openai.proxy.server import ChatServer
from areal_lite.experimental.openai.proxy.workflow import OpenAIAgentWorkflow

# ------------------------------------------------------------------------------------------------ protocol (pure)


def test_parse_defaults_and_normalisation():
    req = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_tokens": 5,
            "stop": "\n",
            "user": "ignored",
            "seed": 3,
        }
    )
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]
    assert (req.n, req.stream, req.max_tokens, req.stop, req.temperature) == (1, False, 5, ["\n"], None)


def test_parse_error_names_the_field():
    with pytest.raises(ChatRequestError) as e:
        parse_chat_request({"messages": [{"role": "user", "content": "x"}], "temperature": 9})
    assert e.value.param == "temperature" and e.value.status == 400 and "[0.0, 2.0]" in str(e.value)


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def server(engine, tok):
    with ChatServer(engine, tok, GenerationHyperparameters(max_new_tokens=8), model="tiny") as server:
        yield server


@pytest.fixture
def session(server):
    session = server.open_session()
    yield session
    server.close_session(session.api_key)


def with_client(server, session, fn):
    """`await fn(client)` with an SDK client on the session, closed afterwards (from a test's own event loop)."""

    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=session.api_key, max_retries=0) as client:
            return await fn(client)

    return asyncio.run(go())


USER = [{"role": "user", "content": "Count to three."}]

# ------------------------------------------------------------------------------------------------ the endpoint


def test_models_and_one_completion(server, session):
    async def go(client):
        models = await client.models.list()
        reply = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, logprobs=True)
        return models, reply

    models, reply = with_client(server, session, go)
    assert [m.id for m in models.data] == ["tiny"]
    assert reply.object == "chat.completion" and reply.model == "tiny" and reply.id.startswith("chatcmpl-")
    [choice] = reply.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    it = session.cache[reply.id]
    resp = it.model_response
    assert reply.usage.prompt_tokens == len(resp.input_tokens) and reply.usage.completion_tokens == resp.output_len
    assert [c.logprob for c in choice.logprobs.content] == resp.output_logprobs
    assert resp.output_versions == [0] * resp.output_len and it.messages == USER


def test_n_choices_are_separate_interactions(server, session):
    reply = with_client(server, session, lambda c: c.chat.completions.create(model="t", messages=USER, n=3))
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert list(session.cache) == [f"{reply.id}-{i}" for i in range(3)]
    session.cache.set_reward(reply.id, 1.0)  # the completion id rewards every choice
    assert [it.reward for it in session.cache.values()] == [1.0, 1.0, 1.0]


def test_stream_is_served_as_events(server, session):
    async def go(client):
        stream = await client.chat.completions.create(
            model="t", messages=USER, stream=True, stream_options={"include_usage": True}
        )
        return [chunk async for chunk in stream]

    chunks = with_client(server, session, go)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [it] = session.cache.values()
    assert text == it.output_message["content"] and chunks[0].id == it.interaction_id
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == it.model_response.output_len


MALFORMED = [
    (b"{nope", "not valid JSON"),
    (b"\xff\xfe", "UTF-8"),
    (b"", "JSON object"),
    ([], "JSON object"),
    ({"model": "t"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": None}]}, "content"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text-only"),
    ({"messages": [{"role": "tool", "content": "3"}]}, "tool_call_id"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "c1", "content": "3"}]}, "must answer a call"),
    (
        {
            "messages": [
                *USER,
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}]},
                {"role": "tool", "tool_call_id": "c2", "content": "3"},
            ]
        },
        "'c2' is not among",
    ),
    ({"messages": [{"role": "assistant", "tool_calls": "add"}]}, "tool_calls"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "'n'"),
    ({"n": 100}, "'n'"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "not both"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"tools": {"name": "add"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["x"]}}}]}, "properties"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": 5}}}]}, "required"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "add"}}], "tool_choice": {"function": {"name": "x"}}}, ""),
    ({"max_token": 5}, "Unrecognized request argument supplied: max_token"),
    ({"functions": [{"name": "f"}]}, "use 'tools'"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"model": 5, "messages": USER}, "model"),
    ({"logprobs": "true"}, "logprobs"),
    ({"frequency_penalty": 5}, "frequency_penalty"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
]


def _health_ok(server) -> bool:
    return requests.get(server.base_url[: -len("/v1")] + "/health", timeout=30).status_code == 200


def _post(server, body, key, path="/v1/chat/completions", method="POST"):
    if isinstance(body, dict) and "messages" not in body and "model" not in body:
        body = {"model": "t", "messages": USER, **body}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = server.base_url[: -len("/v1")] + path
    return requests.request(method, url, data=data, headers=headers, timeout=30)


@pytest.mark.parametrize("body, says", MALFORMED, ids=[f"bad{i}" for i in range(len(MALFORMED))])
def test_malformed_bodies_get_4xx_in_openai_shape(server, session, body, says):
    r = _post(server, body, session.api_key)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"] and says in err["message"] + str(err["param"])


def test_http_errors_and_the_server_keeps_serving(server, session):
    assert _post(server, {}, "sk-unknown").status_code == 401
    r = requests.post(server.base_url + "/chat/completions", json={"messages": USER}, timeout=30)
    assert r.status_code == 401 and "open_session" in r.json()["error"]["message"]
    assert _post(server, {}, session.api_key, path="/v1/completions").status_code == 404
    r = _post(server, b"", session.api_key, method="GET")
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error" and "POST /v1/chat/completions" in r.text
    small = server.open_session(GenerationHyperparameters(max_new_tokens=4, max_tokens=16))
    r = _post(server, {"messages": [{"role": "user", "content": "word " * 40}]}, small.api_key)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    server.close_session(small.api_key)
    before = len(session.cache)
    r = _post(server, {"max_tokens": 3}, session.api_key)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert len(session.cache) == before + 1 and server.stats()["errors"] >= 5


def test_a_dropped_server_stops_serving_and_frees_its_port(engine, tok):
    """A notebook cell that starts a chat server, run again, drops the first one without stop(): once collected, its
    thread ends and its port is free (held by nothing else, it would serve for the rest of the kernel's life)."""
    before = set(threading.enumerate())
    server = ChatServer(engine, tok).start()
    assert _health_ok(server)
    thread, port = server._thread, server.port
    del server
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, but never past a listener
        sock.bind(("127.0.0.1", port))
    assert set(threading.enumerate()) <= before


def test_pause_holds_requests_until_resume(engine, server, session):
    engine.pause()
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=_post(server, {"max_tokens": 3}, session.api_key)))
    requests_before = server.stats()["requests"]
    try:
        worker.start()
        # First the request reaches the endpoint (a fixed sleep could end before it was even sent, on a loaded
        # machine); then a 3-token answer, which takes milliseconds unpaused, must still be held 0.5 s later.
        deadline = time.monotonic() + 60
        while server.stats()["requests"] == requests_before:
            assert time.monotonic() < deadline, "the request never reached the chat endpoint"
            time.sleep(0.01)
        time.sleep(0.5)
        assert worker.is_alive() and not session.cache  # waiting on the engine, not answered
    finally:
        engine.resume()
    worker.join(60)
    assert not worker.is_alive()
    assert result["r"].status_code == 200 and len(session.cache) == 1


def test_three_turns_are_token_exact(server, session, tok):
    async def go(client):
        msgs, replies = list(USER), []
        for k in range(3):
            r = await client.chat.completions.create(
                model="t", messages=msgs, logprobs=True, max_tokens=6, extra_body={"return_token_ids": True}
            )
            replies.append(r)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"And {k}?"}]
        return replies

    replies = with_client(server, session, go)
    prompts = [r.prompt_token_ids for r in replies]
    outs = [r.choices[0].token_ids for r in replies]
    for k in (1, 2):  # each prompt extends the previous prompt and the ids the server returned for it
        assert prompts[k][: len(prompts[k - 1]) + len(outs[k - 1])] == prompts[k - 1] + outs[k - 1]
    [leaf] = session.cache.export_interactions("concat").values()
    row = leaf.to_tensor_dict()
    check_trajectory(row)
    gen = row["loss_mask"][0] == 1
    assert row["input_ids"][0].tolist() == prompts[2] + outs[2]
    assert row["input_ids"][0][gen].tolist() == outs[0] + outs[1] + outs[2]
    returned = [c.logprob for r in replies for c in r.choices[0].logprobs.content]
    assert torch.equal(row["logprobs"][0][gen], torch.tensor(returned, dtype=torch.float32))
    assert int(gen.sum()) == sum(map(len, outs))  # loss 0 on everything the template and the user added


# ------------------------------------------------------------------------------------------------ tool calls


class ScriptedEngine:
    """`agenerate` writing the next scripted text, then `<|im_end|>` (for `(text, "length")`: cut without it); a
    list of strings is tokenized piece by piece, giving ids a re-tokenization of the text would not give. What a
    random model cannot be made to do. An exception in the script is raised instead."""

    def __init__(self, tok, script):
        self.tok, self.script = tok, list(script)

    async def agenerate(self, req):
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        text, reason = item if isinstance(item, tuple) else (item, "stop")
        pieces = text if isinstance(text, list) else [text]
        ids = [t for piece in pieces for t in self.tok(piece, add_special_tokens=False)["input_ids"]]
        ids += [self.tok.eos_token_id] if reason == "stop" else []
        lps = [-0.25 - 0.01 * i for i in range(len(ids))]
        return ModelResponse(list(req.input_ids), ids, lps, [7] * len(ids), reason, tokenizer=req.tokenizer)


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def test_engine_failures_and_bugs_are_answered_in_openai_shape_and_the_server_keeps_serving(tok):
    from areal_lite.infra.remote_inf_engine import EngineError

    engine = ScriptedEngine(tok, [EngineError("server 127.0.0.1:1 refused"), KeyError("oops"), "Fine."])
    with ChatServer(engine, tok) as server:
        session = server.open_session()
        failed, bug, fine = (_post(server, {}, session.api_key) for _ in range(3))
        assert (failed.status_code, failed.json()["error"]["type"]) == (502, "api_error")
        assert "the inference engine failed: server 127.0.0.1:1 refused" in failed.json()["error"]["message"]
        assert (bug.status_code, bug.json()["error"]["type"]) == (500, "server_error")
        assert "KeyError" in bug.json()["error"]["message"]
        assert fine.status_code == 200 and fine.json()["choices"][0]["message"]["content"] == "Fine."
        assert server.stats()["errors"] == 2 and len(session.cache) == 1


def test_tool_call_round_trip_keeps_the_generated_ids(tok):
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    bad = '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'
    engine = ScriptedEngine(tok, [call, "The sum is 5.", bad])
    with ChatServer(engine, tok) as server:
        session = server.open_session()

        async def go(client):
            msgs = [{"role": "user", "content": "What is 2 + 3?"}]
            first = await client.chat.completions.create(model="t", messages=msgs, tools=[ADD])
            msg = first.choices[0].message
            msgs.append(msg.model_dump(exclude_none=True))
            args = json.loads(msg.tool_calls[0].function.arguments)
            msgs.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": str(args["a"] + args["b"])})
            second = await client.chat.completions.create(model="t", messages=msgs, tools=[ADD])
            third = await client.chat.completions.create(model="t", messages=msgs[:1], tools=[ADD])
            return first, second, third

        first, second, third = with_client(server, session, go)
        stats = server.stats()
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    [tc] = first.choices[0].message.tool_calls
    assert tc.type == "function" and tc.function.name == "add" and tc.id.startswith("call_")
    assert second.choices[0].message.content == "The sum is 5." and second.choices[0].finish_reason == "stop"
    # malformed JSON: a text answer and a counted failure, not an error
    assert third.choices[0].message.content == bad and third.choices[0].message.tool_calls is None
    assert stats["tool_parse_failures"] == 1 and stats["tool_calls"] == 1
    # the template writes the call back with newlines (Hermes): drift detected, the generated ids kept
    assert session.stats["template_drifts"] == 1
    leaf = session.cache[second.id]
    assert leaf.parent is session.cache[first.id]
    row = leaf.to_tensor_dict()
    check_trajectory(row)
    text = tok.decode(row["input_ids"][0].tolist())
    assert "# Tools" in text and '"name": "add"' in text and "<tool_response>\n5\n</tool_response>" in text
    generated = tok.decode(row["input_ids"][0][row["loss_mask"][0] == 1].tolist())
    assert generated == call + "<|im_end|>The sum is 5.<|im_end|>"


# ------------------------------------------------------------------------------------------------ the workflow


class CountingAgent:
    """Two turns with the SDK; the reward is whether the second answer is longer than the first."""

    async def run(self, data, **kw):
        client = openai.AsyncOpenAI(**kw, max_retries=0)
        msgs, texts = [{"role": "user", "content": data["question"]}], []
        for _ in range(2):
            r = await client.chat.completions.create(model="t", messages=msgs, max_tokens=6)
            texts.append(r.choices[0].message.content)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Longer?"}]
        return float(len(texts[1]) > len(texts[0]))


def test_stop_strings_are_cut_where_they_first_match_and_streamed_tool_calls_have_null_content(tok):
    """The token that completes a stop string may carry more text: the content ends before the match, as OpenAI's
    does (the recorded ids keep everything generated). A streamed tool-call reply has content null, not ""."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    engine = ScriptedEngine(tok, ["Paris. It is", "Lima", call])
    with ChatServer(engine, tok) as server:
        session = server.open_session()

        async def go(client):
            cut = await client.chat.completions.create(model="t", messages=USER, stop=[" is", "."])
            kept = await client.chat.completions.create(model="t", messages=USER, stop="x")
            stream = await client.chat.completions.create(model="t", messages=USER, tools=[ADD], stream=True)
            deltas = [c.choices[0].delta async for c in stream if c.choices]
            return cut, kept, deltas

        cut, kept, deltas = with_client(server, session, go)
    assert cut.choices[0].message.content == "Paris" and cut.choices[0].finish_reason == "stop"
    assert kept.choices[0].message.content == "Lima"
    assert tok.decode(session.cache[cut.id].model_response.output_tokens, skip_special_tokens=True) == "Paris. It is"
    assert deltas[0].content is None and deltas[1].tool_calls[0].function.name == "add"


def test_logprob_bytes_join_back_characters_split_over_tokens(tok):
    """OpenAI's `bytes` of each logprob entry recombine a character that spans tokens (an emoji is 4 tokens here)."""
    engine = ScriptedEngine(tok, ["Done 🤖 ok"])
    with ChatServer(engine, tok) as server:
        session = server.open_session()
        reply = _post(server, {"messages": USER, "logprobs": True}, session.api_key).json()
    entries = reply["choices"][0]["logprobs"]["content"]
    assert len(entries) > len("Done  ok") and "�" in "".join(e["token"] for e in entries)  # split: no text alone
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8").startswith("Done 🤖 ok")


def test_tool_arguments_nested_past_the_stack_compare_as_different_text():
    from areal_lite.experimental.openai.cache import _same_json_text

    deep = "[" * 5000 + "]" * 5000
    assert not _same_json_text(deep, "[]") and _same_json_text('{"a": 1}', '{"a":1}')


def test_tool_choice_none_answers_text_and_unmet_choices_are_counted(tok):
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    engine = ScriptedEngine(tok, [call, call, "Five.", call])
    choices = ["none", "required", "required", {"type": "function", "function": {"name": "mul"}}]
    mul = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}
    with ChatServer(engine, tok) as server:
        session = server.open_session()
        replies = [_post(server, {"tools": [ADD, mul], "tool_choice": c}, session.api_key).json() for c in choices]
        stats = server.stats()
    messages = [r["choices"][0]["message"] for r in replies]
    assert messages[0]["content"] == call and "tool_calls" not in messages[0]  # "none": not parsed
    assert messages[1]["tool_calls"][0]["function"]["name"] == "add"  # "required", met
    assert messages[2]["content"] == "Five."  # "required", unmet: the model's reply as it is ...
    assert messages[3]["tool_calls"][0]["function"]["name"] == "add"  # named "mul", unmet
    assert stats["tool_choice_unmet"] == 2 and session.stats["tool_choice_unmet"] == 2  # ... and counted


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_sdk_runs_a_tool_agent_against_the_endpoint(tok, streamed):
    """The OpenAI Agents SDK (its chat-completions model) drives the endpoint: a function tool, then the answer."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # its traces would go to api.openai.com

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    with ChatServer(ScriptedEngine(tok, [call, "The sum is 5."]), tok) as server:
        session = server.open_session()

        async def go():
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key=session.api_key, max_retries=0)
            agent = Agent(name="adder", instructions="Use the tool.", tools=[add],
                          model=OpenAIChatCompletionsModel(model="t", openai_client=client))  # fmt: skip
            if not streamed:
                return await Runner.run(agent, "What is 2 + 3?")
            result = Runner.run_streamed(agent, "What is 2 + 3?")
            async for _ in result.stream_events():
                pass
            return result

        result = asyncio.run(go())
        stats = server.stats()
    assert result.final_output == "The sum is 5."
    assert stats["tool_calls"] == 1 and stats["errors"] == 0 and len(session.cache) == 2
    first, second = session.cache.values()
    assert second.parent is first  # the SDK's second request continues the first completion
    text = tok.decode(second.to_tensor_dict()["input_ids"][0].tolist())
    assert "Use the tool." in text and '"name": "add"' in text and "<tool_response>\n5\n</tool_response>" in text


def test_workflow_rolls_out_groups_and_trains_one_grpo_step(engine, tok, tiny_model_path):
    from areal_lite import FSDPPPOActor, OptimizerConfig, PPOActorConfig, concat_padded_tensors

    wf = OpenAIAgentWorkflow(CountingAgent(), tok, GenerationHyperparameters(max_new_tokens=6))
    try:
        data = [{"question": "Name a colour."}, {"question": "Name a fruit."}]
        rows = engine.rollout_batch(data, wf, group_size=2)
    finally:
        wf.close()
    batch = concat_padded_tensors(rows)
    assert batch["input_ids"].shape[0] == 4 and check_trajectory(batch)
    assert wf.stats["trained"] == 4 and len(engine.addresses) == 1
    cfg = PPOActorConfig(
        path=tiny_model_path, device="cpu", threads=1, group_size=2, optimizer=OptimizerConfig(type="sgd", lr=1e-3)
    )
    actor = FSDPPPOActor(cfg).initialize()
    try:
        batch["prox_logp"] = actor.compute_logp(batch)
        actor.compute_advantages(batch)
        stats = actor.ppo_update(batch)
    finally:
        actor.destroy()
    # A group whose two samples scored the same has zero advantages: ppo_update computes no forward for its rows
    # ("Rows without signal"), and the statistics cover the rows it computed.
    silent = (batch["advantages"] * batch["loss_mask"]).ne(0).sum(dim=1) == 0
    assert stats["silent_rows"] == int(silent.sum())
    assert stats["n_tokens"] == int(batch["loss_mask"][~silent].sum())
    assert all(math.isfinite(v) for v in stats.values() if isinstance(v, float))


def test_discount_fn_sets_the_rows_rewards(engine, tok):
    seen = []

    def halve_the_first(rewards, gamma):
        seen.append((list(rewards), gamma))
        return [0.5 * gamma] + [r or 0.0 for r in rewards[1:]]

    wf = OpenAIAgentWorkflow(
        CountingAgent(),
        tok,
        GenerationHyperparameters(max_new_tokens=6),
        "individual",
        0.8,
        discount_fn=halve_the_first,
    )
    try:
        [rows] = engine.rollout_batch([{"question": "Name a colour."}], wf)
    finally:
        wf.close()
    [(rewards, gamma)] = seen
    assert gamma == 0.8 and rewards[0] is None and rewards[1] in (0.0, 1.0)  # the agent's reward on the last one
    assert rows["rewards"].tolist() == pytest.approx([0.4, rewards[1]])


def test_tool_call_accounting_on_the_real_small_model(smollm_server, smollm_path):
    """Counts on SmolLM2-135M through the compact syntax: what the server counts is what the client received.
    Two worked examples make the model call the calculator in most samples; a 6-token budget cuts calls open
    (14 tokens), which must be counted as parse failures and answered as text, never raised. A sample may also
    leave a call open itself and end (`<calculator>59 * 63 and then some text`): a failure too, finished "stop";
    or close it and go on until the budget cuts its text: a call, finished "length"."""
    from transformers import AutoTokenizer

    from areal_lite import InferenceEngineConfig, RemoteSGLangEngine

    smol = AutoTokenizer.from_pretrained(smollm_path)
    calc = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
    msgs = []
    for k, (a, b) in enumerate([(12, 34), (56, 78)]):
        call = {
            "id": f"c{k}",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{a} * {b}"})},
        }
        msgs += [
            {"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ]
    msgs.append({"role": "user", "content": "What is 59 * 63?"})
    eng = RemoteSGLangEngine(InferenceEngineConfig(max_concurrent_rollouts=16)).initialize(addr=smollm_server.address)
    try:
        with ChatServer(eng, smol, tool_syntax="compact") as server:
            session = server.open_session()

            async def go(client):
                ask = dict(model="t", messages=msgs, tools=[calc], n=8, temperature=1.0)
                return await asyncio.gather(
                    client.chat.completions.create(**ask, max_tokens=24),
                    client.chat.completions.create(**ask, max_tokens=6),
                )

            replies = with_client(server, session, go)
            stats, recorded = server.stats(), len(session.cache)
    finally:
        eng.destroy()
    choices = [c for r in replies for c in r.choices]
    calls = [tc for c in choices for tc in c.message.tool_calls or []]

    def opened_a_call(c) -> bool:  # a call left in the text: the parse failed
        return "<calculator>" in (c.message.content or "")

    cut_open = [c for c in choices if opened_a_call(c)]
    assert stats["completions"] == recorded == 16
    assert stats["tool_calls"] == len(calls) >= 1 and stats["tool_parse_failures"] == len(cut_open) >= 1
    assert all(not c.message.tool_calls and c.finish_reason in ("length", "stop") for c in cut_open)
    cut_by_budget = [c for c in replies[1].choices if opened_a_call(c)]
    assert cut_by_budget and all(c.finish_reason == "length" for c in cut_by_budget)
    assert all(json.loads(tc.function.arguments).keys() == {"expression"} for tc in calls)
    # A call is "tool_calls" unless the budget cut the text the sample wrote after it (OpenAI's "length" then).
    assert all(c.finish_reason in ("tool_calls", "length") for c in choices if c.message.tool_calls)
    assert any(c.finish_reason == "tool_calls" for c in choices)
    assert not any(c.message.tool_calls for c in replies[1].choices)  # 6 tokens hold no whole call


# ------------------------------------------------------------------------------------------------ AReaL's client


async def _scripted_conversation(client) -> None:
    msgs = [{"role": "user", "content": "Say something."}]
    for k in range(3):
        r = await client.chat.completions.create(model="t", messages=msgs, temperature=0.0, max_completion_tokens=6)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"More {k}."}]


# Scripted turns whose re-rendering drifts (ids split where BPE would merge them), one of them cut by length (no
# end-of-turn token of its own).
DRIFTING = [["Hel", "lo", " the", "re"], (["spa", "ced out"], "length"), "Bye."]


@pytest.mark.parametrize("kind", ["real", "scripted"])
def test_same_rows_as_areal_own_client(engine, server, tok, kind, import_areal):
    ArealOpenAI = import_areal("areal.experimental.openai").ArealOpenAI

    def rows(cache_owner):
        cache_owner.set_last_reward(1.0)
        cache_owner.apply_reward_discount(1.0)
        return [v.to_tensor_dict() for v in cache_owner.export_interactions(style="concat").values()]

    theirs_engine = engine if kind == "real" else ScriptedEngine(tok, DRIFTING)
    areal_client = ArealOpenAI(engine=theirs_engine, tokenizer=tok, chat_template_type="concat", api_key="unused")
    asyncio.run(_scripted_conversation(areal_client))
    [theirs] = rows(areal_client)

    ours_server = server if kind == "real" else ChatServer(ScriptedEngine(tok, DRIFTING), tok).start()
    session = ours_server.open_session()
    try:
        with_client(ours_server, session, _scripted_conversation)
    finally:
        ours_server.close_session(session.api_key)
        if kind == "scripted":
            ours_server.stop()
    [ours] = rows(session.cache)
    for key in ("input_ids", "loss_mask", "versions", "attention_mask", "rewards"):
        assert ours[key].tolist() == theirs[key].tolist(), key
    torch.testing.assert_close(ours["logprobs"], theirs["logprobs"].float(), atol=1e-4, rtol=0)
    if kind == "scripted":  # the comparison did cover drift: the template re-rendered the answers differently
        assert session.stats["template_drifts"] >= 1


def test_a_start_that_fails_ends_its_thread_and_frees_its_port(engine, tok, monkeypatch):
    """A start whose serving fails (here aiohttp's listening socket, made to fail) raises, and leaves neither its
    thread nor its port behind; the same server then starts once the fault is gone."""
    from aiohttp import web

    def refuse(site):
        raise OSError("no listening here")

    before = set(threading.enumerate())
    server = ChatServer(engine, tok)
    with monkeypatch.context() as patched:
        patched.setattr(web.SockSite, "start", refuse)
        with pytest.raises(OSError, match="no listening here"):
            server.start()
    assert not server.running and set(threading.enumerate()) <= before
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", server.port))
    with server:
        assert _health_ok(server)
    assert set(threading.enumerate()) <= before


def test_a_start_that_times_out_leaves_nothing_behind(engine, tok, recwarn):
    """start(timeout=0) gives up before the server listens: it raises TimeoutError, and the half-started server is
    undone (no thread, no pending task, no unclosed loop), so start() can be called again."""
    before = set(threading.enumerate())
    timed_out = []
    for _ in range(5):  # a thread switch at the wrong moment could let one start finish in time
        server = ChatServer(engine, tok)
        try:
            server.start(timeout=0)
        except TimeoutError:
            timed_out.append(server)
        else:
            server.stop()
        assert not server.running and set(threading.enumerate()) <= before
    gc.collect()
    assert timed_out and not [w for w in recwarn if issubclass(w.category, (ResourceWarning, RuntimeWarning))]
    with timed_out[-1] as server:
        assert _health_ok(server)
