"""areal_lite.utils.search_tool: tag parsers (example- and property-based), the results block, client errors."""

import asyncio
import socket
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_lite.utils.search_tool import (
    SearchToolError,
    call_search_tool,
    format_search_results,
    parse_access_url,
    parse_answer,
    parse_boxed,
    parse_search_query,
    parse_tag,
    rag_server_addr,
)


# ----------------------------------------------------------------------------- examples
@pytest.mark.parametrize(
    "text,expected",
    [
        (
            "<think> I would like to search for AI.</think>\n<search> Artificial Intelligence </search>",
            "Artificial Intelligence",
        ),
        ("<search>first</search> then <search>second</search>", "second"),
        ("<search>done</search><search>still typing", "done"),  # unclosed last: last complete wins
        ("<search>never closed", None),
        ("no tags at all", None),
        ("", None),
        (None, None),
        ("<search></search>", ""),
        ("<search>   \n\t  </search>", ""),
        ("<search>\n multi\nline \n</search>", "multi\nline"),
        ("<search>outer <search>inner</search>", "inner"),  # nested opener: nearest wins
        ("<search>a</search> stray </search>", "a"),
        ("</search> backwards <search>", None),
        ("<SEARCH>case</SEARCH>", None),  # tags are case-sensitive, like the stop strings
        ("<search>x</search><answer>y</answer>", "x"),
        ("<search>caf\u00e9 \u6771\u4eac</search>", "caf\u00e9 \u6771\u4eac"),
    ],
)
def test_parse_search_query(text, expected):
    assert parse_search_query(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<think> I already found the answer! </think>\n<answer> 1997 </answer>", "1997"),
        ("<answer>Paris</answer> hmm <answer>Lyon</answer>", "Lyon"),
        ("<answer>Paris</answer><answer>Ly", "Paris"),
        ("<answer>", None),
        ("</answer>", None),
        ("<answer>a, b, c</answer>", "a, b, c"),
        ("<answer><b>bold</b></answer>", "<b>bold</b>"),
    ],
)
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected


def test_parse_access_url():
    assert parse_access_url("<access> https://x.org/France </access>") == "https://x.org/France"
    assert parse_access_url("<access>https://x.org/France") is None
    assert parse_tag("<information>doc</information>", "information") == "doc"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("\\boxed{72}", "72"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{1} and then \\boxed{ 2 }", "2"),
        ("\\boxed{1} and \\boxed{2", "1"),
        ("\\boxed{", None),
        ("\\boxed{{{}", None),
        ("\\fbox{x}", "x"),
        ("$\\boxed 5$.", "5"),
        ("no box", None),
        ("\\boxed{a}\\fbox{b}", "b"),
    ],
)
def test_parse_boxed(text, expected):
    assert parse_boxed(text) == expected


# ----------------------------------------------------------------------------- properties
# Strings glued from tag fragments hit the parsers' edge cases far more often than random text.
TAGGY = st.lists(
    st.sampled_from(list("ab <>/{}\\\n") + ["<search>", "</search>", "<answer>", "</answer>", "\\boxed{", "\\fbox"]),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), TAGGY))
def test_parsers_never_raise(text):
    for fn in (parse_search_query, parse_answer, parse_access_url, parse_boxed):
        out = fn(text)
        assert out is None or isinstance(out, str)


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.text(),
    body=st.text().filter(lambda s: "<" not in s),
    suffix=st.text().filter(lambda s: "<search>" not in s),
)
def test_complete_pair_round_trips(prefix, body, suffix):
    # Whatever precedes it, a complete pair with no later opener is what the parser returns.
    assert parse_search_query(f"{prefix}<search>{body}</search>{suffix}") == body.strip()


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="{}"), max_size=30))
def test_boxed_round_trips(body):
    assert parse_boxed(f"x \\boxed{{{body}}} y") == body.strip()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.none(),
            st.text(),
            st.dictionaries(
                st.sampled_from(["title", "contents", "wikipedia_title", "text", "document", "score"]), st.text()
            ),
        )
    )
)
def test_format_search_results_never_raises(docs):
    out = format_search_results(docs)
    assert out.startswith("\n\n<information>\n") and out.endswith("\n</information>")


# ----------------------------------------------------------------------------- results block
def test_format_search_results_matches_seed_format():
    docs = [
        {"id": "1", "wikipedia_title": "France", "contents": "Capital: Paris"},
        {"document": {"title": "Spain", "contents": "Capital: Madrid"}, "score": 3.2},
    ]
    assert format_search_results(docs) == (
        '\n\n<information>\n<p title="France">\nCapital: Paris\n</p>\n\n'
        '<p title="Spain">\nCapital: Madrid\n</p>\n</information>'
    )
    assert format_search_results([]) == "\n\n<information>\n\n</information>"


# ----------------------------------------------------------------------------- client
def test_rag_server_addr(monkeypatch):
    monkeypatch.delenv("AREAL_RAG_SERVER_ADDR", raising=False)
    assert rag_server_addr() == "127.0.0.1:5001"
    monkeypatch.setenv("AREAL_RAG_SERVER_ADDR", "http://10.0.0.1:7000/")
    assert rag_server_addr() == "10.0.0.1:7000"
    assert rag_server_addr("localhost:1") == "localhost:1"


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there


def test_call_search_tool_dead_port_fails_fast_and_clearly():
    port = _dead_port()
    t0 = time.monotonic()
    with pytest.raises(SearchToolError) as err:
        asyncio.run(call_search_tool(["France"], addr=f"127.0.0.1:{port}", timeout=10))
    assert time.monotonic() - t0 < 5
    assert f"127.0.0.1:{port}" in str(err.value) and "cannot connect" in str(err.value)


def test_call_search_tool_timeout_is_reported():
    # A socket that accepts connections but never answers.
    async def go():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await call_search_tool("France", addr=f"127.0.0.1:{port}", timeout=0.5)
        finally:
            server.close()

    with pytest.raises(SearchToolError, match="did not answer within 0.5 s"):
        asyncio.run(go())


@pytest.mark.parametrize(
    "status, body, why",
    [
        (200, b'{"result": [[{"contents": "\xff\xfe"}]', "malformed answer"),  # not UTF-8, and cut short
        (500, b"\xff\xfe oops", "answered HTTP 500"),  # not UTF-8
        (200, b'{"result": ' + b"[" * 5000 + b"]" * 5000 + b"}", "malformed answer"),  # nested past the stack
    ],
)
def test_call_search_tool_garbled_answers_are_search_tool_errors(status, body, why):
    """Whatever bytes a search server sends, the caller gets a SearchToolError (an observation), never another
    exception that would end the episode."""
    from aiohttp import web

    async def go():
        app = web.Application()
        app.router.add_post("/retrieve", lambda request: web.Response(status=status, body=body))
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        try:
            await call_search_tool("France", addr=f"127.0.0.1:{port}", timeout=10)
        finally:
            await runner.cleanup()

    with pytest.raises(SearchToolError, match=why):
        asyncio.run(go())
