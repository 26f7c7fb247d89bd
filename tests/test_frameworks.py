"""Agents written with LangChain drive the chat endpoint: tool messages, streaming, parallel tool calls.

The OpenAI Agents SDK is covered in `test_chat.py`; this file is the second framework, with its own request shapes:
`langchain-openai`'s `ChatOpenAI` (`bind_tools`, `ToolMessage`s with their `tool_call_id`, `astream` with
`stream_usage`, `parallel_tool_calls` true and false, `content: null` beside `tool_calls`).

Design decisions
- Real servers, real framework: a `ChatServer` on 127.0.0.1 over HTTP, LangChain's own client and tool objects. The
  engine behind it is `test_chat.ScriptedEngine`: a random tiny model cannot be made to write a `<tool_call>`.
- "Recorded token-exactly" is checked against the reference: the same conversation sent with the `openai` SDK
  (the client the endpoint's own tests trust) on another session of the same server must export the same training
  row, id for id, logprob for logprob; and the generated part of that row must be exactly what the engine wrote.
- No network, shown rather than assumed: a guard refuses every connection and name lookup that is not this machine
  while LangChain runs, LangSmith tracing is switched off by environment, and tiktoken (which LangChain uses only to
  count tokens, never on the invoke/stream path) gets an empty cache folder, so touching it would need the network
  and fail the test.
- One event loop and one server per test: LangChain caches its async HTTP client per base URL, and a client bound to
  a closed loop fails on reuse.
- The request bodies are read where the endpoint parses them (a spy that calls the real parser), so the tests
  prove that LangChain really sent the field under test, not only that the answer looked right.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket

import openai
import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from test_chat import ScriptedEngine

from areal_lite import check_trajectory
from areal_lite.experimental.openai.proxy import server as chat_server
from areal_lite.experimental.openai.proxy.server import ChatServer


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


TOOLS = {"add": add}
QUESTION = "What is 2 + 3, and 4 + 5?"
ONE_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
TWO_CALLS = ONE_CALL + '<tool_call>{"name": "add", "arguments": {"a": 4, "b": 5}}</tool_call>'
ANSWER = "2 + 3 = 5 and 4 + 5 = 9."


def _local(host) -> bool:
    """Whether a connection or lookup stays on this machine (None: a Unix socket's path, not a host)."""
    if host in ("localhost", None):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:  # a name other than localhost: a lookup that would leave the machine
        return False


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """LangChain with no way out: tracing off, an empty tiktoken cache, and only loopback connections allowed."""
    for var in ("LANGCHAIN_TRACING_V2", "LANGCHAIN_TRACING", "LANGSMITH_TRACING", "LANGSMITH_TRACING_V2"):
        monkeypatch.setenv(var, "false")
    for var in ("LANGSMITH_API_KEY", "LANGCHAIN_API_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    attempts = []
    connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def guard(address):
        host = address[0] if isinstance(address, tuple) else None
        if not _local(host):
            attempts.append(address)
            raise OSError(f"test_frameworks: network access to {address!r} refused")

    def guarded_connect(self, address):
        guard(address)
        return connect(self, address)

    def guarded_connect_ex(self, address):
        guard(address)
        return connect_ex(self, address)

    def guarded_getaddrinfo(host, *args, **kw):
        guard((host.decode() if isinstance(host, bytes) else host, 0))
        return getaddrinfo(host, *args, **kw)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", guarded_connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    # The guard bites (a guard that let these through would make the final check vacuous): both a lookup and a
    # bare connect to an outside address (TEST-NET-3) are refused before any packet leaves.
    for reach in (lambda: socket.create_connection(("example.com", 443)), lambda: probe.connect(("203.0.113.1", 443))):
        with socket.socket() as probe, pytest.raises(OSError, match="network access"):
            reach()
    attempts.clear()
    yield attempts
    assert attempts == [], f"something tried to reach the network: {attempts}"


@pytest.fixture
def bodies(monkeypatch):
    """The JSON bodies the endpoint parsed, in order (the real parser still parses them)."""
    seen = []
    parse = chat_server.parse_chat_request

    def spy(body):
        seen.append(body)
        return parse(body)

    monkeypatch.setattr(chat_server, "parse_chat_request", spy)
    return seen


def chat_model(server, session, **bind) -> ChatOpenAI:
    """LangChain's OpenAI chat model on a session of the endpoint, with the `add` tool bound."""
    llm = ChatOpenAI(model="t", base_url=server.base_url, api_key=session.api_key, max_retries=0)
    return llm.bind_tools([add], **bind)


async def run_agent(llm, stream: bool = False, stream_usage: bool = False):
    """LangChain's tool-calling loop: ask, run every tool call the model made, send `ToolMessage`s back, until an
    answer without calls. Returns the messages and, per turn, the streamed chunks (empty lists when not streamed)."""
    messages, chunks = [HumanMessage(QUESTION)], []
    while True:
        if stream:
            turn = [c async for c in llm.astream(messages, stream_usage=stream_usage)]
            ai = sum(turn[1:], turn[0])
        else:
            turn, ai = [], await llm.ainvoke(messages)
        messages.append(ai)
        chunks.append(turn)
        if not ai.tool_calls:
            return messages, chunks
        for call in ai.tool_calls:  # a ToolMessage with the call's id
            messages.append(await TOOLS[call["name"]].ainvoke(call))


async def run_openai_sdk(server, session, parallel: bool = True):
    """The same agent written against the `openai` SDK: the reference recording."""
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key=session.api_key, max_retries=0) as client:
        tools = [convert_to_openai_tool(add)]  # the schema LangChain sends, so both runs render the same prompt
        msgs = [{"role": "user", "content": QUESTION}]
        while True:
            r = await client.chat.completions.create(
                model="t", messages=msgs, tools=tools, parallel_tool_calls=parallel
            )
            msg = r.choices[0].message
            msgs.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                return msgs
            for c in msg.tool_calls:
                result = add.invoke(json.loads(c.function.arguments))
                msgs.append({"role": "tool", "tool_call_id": c.id, "content": str(result)})


def leaf_row(session):
    [leaf] = session.cache.export_interactions("concat").values()
    row = leaf.to_tensor_dict()
    check_trajectory(row)
    return row


def generated_text(tokenizer, row) -> str:
    return tokenizer.decode(row["input_ids"][0][row["loss_mask"][0] == 1].tolist())


def assert_same_rows(ours, reference):
    for key in ("input_ids", "loss_mask", "logprobs", "versions", "attention_mask"):
        assert ours[key].tolist() == reference[key].tolist(), key


# ------------------------------------------------------------------------------------------------ the tests


def test_langchain_tool_agent_is_recorded_token_exactly(tok, offline, bodies):  # noqa: F811
    """bind_tools → a tool call → LangChain's ToolMessage back with its tool_call_id → the answer; the endpoint
    records the two turns as one continued trajectory, the same row the openai SDK's run gives."""
    with ChatServer(ScriptedEngine(tok, [ONE_CALL, ANSWER, ONE_CALL, ANSWER]), tok) as server:
        lc, ref = server.open_session(), server.open_session()

        async def go():
            out = await run_agent(chat_model(server, lc))
            await run_openai_sdk(server, ref)
            return out

        (messages, _), stats = asyncio.run(go()), server.stats()
    human, ai, tool_msg, final = messages
    [call] = ai.tool_calls
    assert (call["name"], call["args"]) == ("add", {"a": 2, "b": 3}) and call["id"].startswith("call_")
    assert isinstance(tool_msg, ToolMessage) and tool_msg.tool_call_id == call["id"] and tool_msg.content == "5"
    assert final.content == ANSWER and final.response_metadata["finish_reason"] == "stop"
    # what LangChain sent for the second turn: its ToolMessage and the call it echoed back (content null)
    sent = bodies[1]["messages"]
    assert sent[1]["content"] is None and sent[1]["tool_calls"][0]["id"] == call["id"]
    assert sent[2] == {"role": "tool", "content": "5", "tool_call_id": call["id"]}
    assert stats["errors"] == 0 and stats["tool_calls"] == 2 and stats["template_mismatches"] == 0
    first, second = lc.cache.values()
    assert second.parent is first  # the second request continues the first completion
    assert final.usage_metadata["output_tokens"] == second.model_response.output_len
    row = leaf_row(lc)
    assert generated_text(tok, row) == ONE_CALL + "<|im_end|>" + ANSWER + "<|im_end|>"
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(row["input_ids"][0].tolist())
    assert_same_rows(row, leaf_row(ref))


def test_langchain_streaming_gives_the_same_calls_answer_and_recording(tok, offline, bodies):  # noqa: F811
    """`astream` (with `stream_usage`, so `stream_options` is sent) on a reply with two tool calls: the chunks
    assemble into the calls `ainvoke` gets, with their indices and ids, the answer streams as the same text, and
    the recorded row is the non-streamed run's."""
    script = [TWO_CALLS, ANSWER] * 2
    with ChatServer(ScriptedEngine(tok, script), tok) as server:
        plain, streamed = server.open_session(), server.open_session()

        async def go():
            a = await run_agent(chat_model(server, plain))
            b = await run_agent(chat_model(server, streamed), stream=True, stream_usage=True)
            return a, b

        ((m_plain, _), (m_stream, chunks)), stats = asyncio.run(go()), server.stats()
    assert [b["stream"] for b in bodies] == [False, False, True, True]
    assert bodies[2]["stream_options"] == {"include_usage": True}
    ai_plain, ai_stream = m_plain[1], m_stream[1]
    assert isinstance(ai_stream, AIMessageChunk)
    calls = [(c["name"], c["args"]) for c in ai_stream.tool_calls]
    assert calls == [(c["name"], c["args"]) for c in ai_plain.tool_calls] == [("add", {"a": 2, "b": 3}),
                                                                              ("add", {"a": 4, "b": 5})]  # fmt: skip
    pieces = [p for c in chunks[0] for p in c.tool_call_chunks]
    assert [p["index"] for p in pieces] == [0, 1] and all(p["id"].startswith("call_") for p in pieces)
    assert [json.loads(p["args"]) for p in pieces] == [{"a": 2, "b": 3}, {"a": 4, "b": 5}]
    assert [m.tool_call_id for m in m_stream[2:4]] == [c["id"] for c in ai_stream.tool_calls]
    assert [m.content for m in m_stream[2:4]] == ["5", "9"]
    assert "".join(c.content for c in chunks[1]) == m_stream[-1].content == m_plain[-1].content == ANSWER
    first, second = streamed.cache.values()
    assert second.parent is first and stats["errors"] == 0
    assert ai_stream.usage_metadata["output_tokens"] == first.model_response.output_len
    assert_same_rows(leaf_row(streamed), leaf_row(plain))


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one_call"])
def test_langchain_parallel_tool_calls_round_trip(tok, offline, bodies, parallel):  # noqa: F811
    """`parallel_tool_calls` reaches the endpoint and is honoured. True: both calls of one assistant message reach
    LangChain, both ToolMessages go back in one request, and the turn continues the first. False (what LangChain's
    `with_structured_output` sends): only the first call is handed out (vLLM's rule), the other is counted as
    dropped, and the next turn still continues the recorded sample, whose generated ids keep both calls."""
    with ChatServer(ScriptedEngine(tok, [TWO_CALLS, ANSWER] * 2), tok) as server:
        lc, ref = server.open_session(), server.open_session()

        async def go():
            out = await run_agent(chat_model(server, lc, parallel_tool_calls=parallel))
            await run_openai_sdk(server, ref, parallel=parallel)
            return out

        (messages, _), stats = asyncio.run(go()), server.stats()
    assert bodies[0]["parallel_tool_calls"] is parallel and bodies[1]["parallel_tool_calls"] is parallel
    ai, final = messages[1], messages[-1]
    served = [(c["name"], c["args"]) for c in ai.tool_calls]
    expected = [("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})][: 2 if parallel else 1]
    assert served == expected and final.content == ANSWER
    assert len({c["id"] for c in ai.tool_calls}) == len(expected)  # distinct ids, one ToolMessage each
    echoed = bodies[1]["messages"]
    assert [m["tool_call_id"] for m in echoed if m["role"] == "tool"] == [c["id"] for c in ai.tool_calls]
    assert stats["tool_calls"] == 4 and stats["tool_calls_dropped"] == (0 if parallel else 2)
    assert lc.stats["tool_calls_dropped"] == (0 if parallel else 1)
    first, second = lc.cache.values()
    assert second.parent is first and len(first.output_message["tool_calls"]) == len(expected)
    row = leaf_row(lc)
    assert generated_text(tok, row) == TWO_CALLS + "<|im_end|>" + ANSWER + "<|im_end|>"  # the sample, whole
    text = tok.decode(row["input_ids"][0].tolist())
    assert text.count("<tool_response>") == len(expected)
    assert_same_rows(row, leaf_row(ref))
