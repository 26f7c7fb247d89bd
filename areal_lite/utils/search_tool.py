"""Agent tools: tag parsers, the `<information>` block, and the search-tool HTTP client.

Design decisions:
- Tag parsers return the content of the *last complete* `<tag>...</tag>` pair, stripped. A trailing
  unclosed tag is ignored (the model is still writing it, or was cut off), so
  `"<search>a</search><search>b"` gives `"a"`; no complete pair at all gives None. With nested
  openers (`"<search>x <search>y</search>"`) the innermost, i.e. the opener nearest the closer, wins.
  An empty pair gives `""`, not None: "the model asked for nothing" differs from "it asked nothing".
- Parsers are total: any string (or None) in, str/None out; they never raise (property-tested).
- `parse_boxed` scans braces by hand because regexes cannot match nested `{}`; `reward/math_answer.py` reuses it.
- `format_search_results` writes the block the search prompt promises the model
  (`<p title="...">` paragraphs inside `<information>`), reading `wikipedia_title`/`contents`, falling
  back to `title`/`text`, and unwrapping the `{"document": ..., "score": ...}` shape.
- `call_search_tool` opens one aiohttp session per call unless given one, so it works from any
  event loop (the notebook's and the rollout executor's background loop). Every failure becomes a
  `SearchToolError` naming the address and the reason, instead of a bare aiohttp exception.
"""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp

__all__ = [
    "DEFAULT_RAG_ADDR",
    "SearchToolError",
    "parse_tag",
    "parse_search_query",
    "parse_answer",
    "parse_access_url",
    "parse_boxed",
    "format_search_results",
    "call_search_tool",
    "rag_server_addr",
]

DEFAULT_RAG_ADDR = "127.0.0.1:5001"


# ----------------------------------------------------------------------------- tag parsing
def parse_tag(text: str | None, tag: str) -> str | None:
    """Content of the last complete `<tag>...</tag>` in `text`, stripped; None if there is none."""
    if not isinstance(text, str):
        return None
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    # Walk openers from the end; the first one followed by a closer starts the last complete pair.
    # An earlier opener's closer must lie before the later opener (else the later one would have
    # matched), so each search is bounded by the previous opener and the walk stays linear.
    hi = len(text)
    while True:
        start = text.rfind(open_t, 0, hi)
        if start == -1:
            return None
        end = text.find(close_t, start + len(open_t), hi)
        if end != -1:
            return text[start + len(open_t) : end].strip()
        hi = start


def parse_search_query(text: str | None) -> str | None:
    """The query of the last complete `<search>...</search>`."""
    return parse_tag(text, "search")


def parse_answer(text: str | None) -> str | None:
    """The answer of the last complete `<answer>...</answer>`."""
    return parse_tag(text, "answer")


def parse_access_url(text: str | None) -> str | None:
    """The url of the last complete `<access>...</access>` (generation stops at `</access>`, so the tag is closed)."""
    return parse_tag(text, "access")


def _braced_at(text: str, i: int) -> str | None:
    """If text[i] == '{', the content up to its matching '}', else None (unbalanced → None)."""
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def parse_boxed(text: str | None, commands: tuple[str, ...] = ("\\boxed", "\\fbox")) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`), nested braces allowed, stripped.

    An unclosed last box is skipped in favour of an earlier complete one (same rule as the tags);
    None if no box closes. `\\boxed 5` (no braces, a LaTeX-legal form) yields the next token.
    """
    if not isinstance(text, str):
        return None
    hits = []
    for cmd in commands:
        pos = text.find(cmd)
        while pos != -1:
            hits.append((pos, cmd))
            pos = text.find(cmd, pos + 1)
    for pos, cmd in sorted(hits, reverse=True):
        rest = pos + len(cmd)
        if rest < len(text) and text[rest] == "{":
            inner = _braced_at(text, rest)
            if inner is not None:
                return inner.strip()
        elif rest < len(text) and text[rest] == " ":
            token = text[rest:].split(None, 1)
            if token:
                return token[0].rstrip("$.,")
    return None


# ----------------------------------------------------------------------------- results block
def _doc_fields(item) -> tuple[str, str]:
    """(title, contents) of a retrieval result, whatever shape the server used."""
    if isinstance(item, dict) and "document" in item and isinstance(item["document"], dict):
        item = item["document"]
    if not isinstance(item, dict):
        return "", "" if item is None else str(item)
    title = item.get("wikipedia_title") or item.get("title") or ""
    contents = item.get("contents")
    if contents is None:
        contents = item.get("text", "")
    return str(title), str(contents)


def format_search_results(docs) -> str:
    """The `<information>` block appended to the trajectory after a search: one `<p title="...">` per passage."""
    paragraphs = []
    for item in docs or []:
        title, contents = _doc_fields(item)
        paragraphs.append('<p title="{}">\n{}\n</p>'.format(title, contents))
    return "\n\n<information>\n" + "\n\n".join(paragraphs) + "\n</information>"


# ----------------------------------------------------------------------------- HTTP client
class SearchToolError(RuntimeError):
    """The retrieval server could not answer: unreachable, timed out, refused the request, or garbled."""


def rag_server_addr(addr: str | None = None) -> str:
    """`host:port` of the RAG server: explicit > env AREAL_RAG_SERVER_ADDR > 127.0.0.1:5001."""
    addr = addr or os.environ.get("AREAL_RAG_SERVER_ADDR") or DEFAULT_RAG_ADDR
    addr = addr.strip().rstrip("/")
    for scheme in ("http://", "https://"):
        if addr.startswith(scheme):
            addr = addr[len(scheme) :]
    return addr


async def _post_retrieve(session, url, payload, addr, timeout):
    try:
        async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body = (await resp.read()).decode("utf-8", errors="replace")  # a garbled reply is a bad answer, not a crash
            status = resp.status
    except asyncio.TimeoutError as e:
        raise SearchToolError(f"RAG server at {addr} did not answer within {timeout:g} s") from e
    except aiohttp.ClientConnectorError as e:
        raise SearchToolError(
            f"cannot connect to RAG server at {addr} ({e.os_error or e}): none runs there. Start one with "
            "`python -m areal_lite.kit.rag --corpus PATH --port N` and set AREAL_RAG_SERVER_ADDR; in a notebook, a "
            "server cell run again starts it on a new address: run again the cells that use it"
        ) from e
    except aiohttp.ClientError as e:
        raise SearchToolError(f"request to RAG server at {addr} failed: {type(e).__name__}: {e}") from e
    if status != 200:
        try:
            message = json.loads(body).get("error", body)
        except (ValueError, AttributeError):
            message = body
        raise SearchToolError(f"RAG server at {addr} answered HTTP {status}: {str(message)[:500]}")
    return body


async def call_search_tool(
    queries: list[str] | str,
    topk: int = 3,
    return_scores: bool = False,
    addr: str | None = None,
    timeout: float = 30.0,
    session: aiohttp.ClientSession | None = None,
) -> list[list[dict]]:
    """POST /retrieve and return one list of docs per query (`{"document", "score"}` items with scores).

    Raises SearchToolError (with the address and the reason) on any failure.
    """
    if isinstance(queries, str):
        queries = [queries]
    queries = list(queries)
    addr = rag_server_addr(addr)
    url = f"http://{addr}/retrieve"
    payload = {"queries": queries, "topk": topk, "return_scores": return_scores}
    if session is None:
        async with aiohttp.ClientSession() as own:
            body = await _post_retrieve(own, url, payload, addr, timeout)
    else:
        body = await _post_retrieve(session, url, payload, addr, timeout)
    try:
        result = json.loads(body)["result"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: JSON nested too deeply
        raise SearchToolError(f"RAG server at {addr} sent a malformed answer: {body[:200]!r}") from e
    if not isinstance(result, list) or len(result) != len(queries) or not all(isinstance(r, list) for r in result):
        raise SearchToolError(
            f"RAG server at {addr} sent {type(result).__name__} for {len(queries)} queries; "
            "expected one list of docs per query"
        )
    return result
