"""JSON over HTTP for the kit's servers (the embedded inference server, the RAG server and the chat endpoint).

Every server promises the same thing to a client that sends bad input: a 4xx answer whose body is
`{"error": "<what was wrong and what to send instead>"}`, and a server that stays up. This module is that promise,
written once:
- `BadRequest` is raised by body parsers with a message meant for the client; the middleware turns it into a 400.
- aiohttp's own errors (404, 405, 413, 503) become JSON of the same shape; 404/405 list the server's routes.
- Any other exception is a bug: logged with its traceback, answered with a 500, and the next request is served.
- A server with its own error body (the chat endpoint: OpenAI's) passes a renderer (`json_errors_middleware`).
aiohttp is imported inside the functions, so importing this module (and the packages that do) stays light.

Bounded input, judged before it is parsed (SGLang and vLLM answer 4xx to any of these; `parse_json_bytes`):
- Size: each server sets `client_max_size`; a larger declared Content-Length is a 413 before a byte is read.
- Nesting: at most `MAX_JSON_DEPTH` levels, measured on the raw bytes: Python's json module recurses once per level,
  and a deep value would exhaust the stack of whatever walks it next (a template renderer, a validator).
- Text: UTF-8, and no lone UTF-16 surrogate (valid JSON, but not text: a tokenizer fails on it later, as a 500).
- CPU time: work that can take more than a few ms (a body over `OFF_LOOP_BYTES`, long text) runs on a worker
  thread (`off_loop`), so the event loop keeps answering /health, pause and abort.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, Callable, Optional, Tuple, TypeVar

__all__ = [
    "BadRequest",
    "MAX_JSON_DEPTH",
    "OFF_LOOP_BYTES",
    "describe",
    "json_error",
    "json_errors_middleware",
    "off_loop",
    "parse_json_bytes",
    "read_json",
    "read_json_object",
]

MAX_JSON_DEPTH = 100  # a chat request with a nested JSON schema in a tool reaches ~20; /generate needs 3
OFF_LOOP_BYTES = 64 * 1024  # larger bodies are parsed on a worker thread, so the event loop serves others meanwhile

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # brackets inside strings are text
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

T = TypeVar("T")


class BadRequest(ValueError):
    """A request the server cannot serve as sent; the message says what to send instead (answered with a 400)."""


def describe(v: Any) -> str:
    """A short description of a JSON value for error messages: its Python type and, when short, the value."""
    if not isinstance(v, (str, int, float, bool, type(None))):
        return type(v).__name__  # a list or an object: its type says enough
    text = json.dumps(v)
    return f"{type(v).__name__} {text}" if len(text) < 60 else type(v).__name__


def json_error(status: int, error: str, headers: Optional[dict] = None, **extra: Any):
    """An aiohttp JSON response `{"error": error, **extra}` with `status`."""
    from aiohttp import web

    return web.json_response({"error": error, **extra}, status=status, headers=headers)


async def off_loop(big: bool, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, on a worker thread when `big` (CPU work of more than a few ms must not hold up the
    event loop), inline otherwise (a thread hop costs more than small work). The json module holds the GIL while
    it parses: what keeps that pause short is the size limit, and the thread keeps the loop running around it."""
    if big:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def too_large(limit: int, size: Optional[int] = None):
    """The 413 for a body over `limit` bytes (`size`: its declared length, None when it was not declared)."""
    from aiohttp import web

    what = f"the request body ({size} bytes)" if size is not None else "the request body"
    return web.HTTPRequestEntityTooLarge(
        max_size=limit,
        actual_size=size if size is not None else limit + 1,
        text=f"{what} exceeded this server's limit of {limit} bytes; send less per request (fewer prompts, "
        "shorter texts)",
    )


def _json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest, read from the bytes without parsing them."""
    import numpy as np

    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    # '[' and '{' have bit 1 set, ']' and '}' do not: +1 for an opener, -1 for a closer
    steps = (np.frombuffer(brackets, dtype=np.uint8) & 2).astype(np.int32) - 1
    return int(steps.cumsum().max())


def _too_deep(depth: Optional[int] = None) -> BadRequest:
    found = f"{depth} levels" if depth is not None else "deeper than this server reads"
    return BadRequest(
        f"the request body nests JSON arrays/objects {found} deep; at most {MAX_JSON_DEPTH} levels are accepted"
    )


def parse_json_bytes(raw: bytes) -> Any:
    """A request body parsed as JSON under the rules of the module docstring (None for an empty body).

    The depth is measured on the raw bytes (strings removed, brackets counted with numpy), which costs nothing for
    the usual body with fewer brackets than the limit; RecursionError is caught as well, as a second line. Lone
    surrogates are refused as Pydantic's and orjson's readers refuse them."""
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the request body is not UTF-8") from None
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:  # fewer brackets than the limit cannot nest deeper
        depth = _json_depth(raw)
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(depth)
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:
        why = str(e)
        if "integer string conversion" in why:  # Python reads ints of at most 4300 digits from text
            why = "it has an integer of more than 4300 digits"
        raise BadRequest(f"the request body is not valid JSON: {why}") from None
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(
                "the request body has a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), which is "
                "not text; send valid Unicode"
            ) from None
    return value


async def read_json(request) -> Any:
    """The request body parsed as JSON (`parse_json_bytes`); None for an empty body. Raises BadRequest."""
    from aiohttp import web

    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # a chunked body, past the limit
        raise too_large(request.client_max_size) from None
    return await off_loop(len(raw) > OFF_LOOP_BYTES, parse_json_bytes, raw)


async def read_json_object(request, empty_ok: bool = True) -> dict:
    """The request body as a JSON object; `{}` for an empty body when `empty_ok`."""
    body = await read_json(request)
    if body is None and empty_ok:
        return {}
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {describe(body)}")
    return body


def json_errors_middleware(
    routes_help: str,
    log: logging.Logger,
    render: Optional[Callable[..., Any]] = None,
    translate: Optional[Callable[[Exception], Optional[Tuple[int, str, dict]]]] = None,
):
    """aiohttp middleware answering every error as JSON (see the module docstring); `routes_help` lists routes.

    A server with another error shape (the OpenAI-compatible endpoint) keeps the rules and changes only the body:
    `render(status, message, kind, headers=..., **fields)` builds the response, where `kind` is
    "invalid_request_error" for a 4xx and "server_error" for a 500 (default: `{"error": message}`); `translate(exc)`
    maps the server's own exceptions to `(status, message, fields)` (`fields` may set "kind"), or None to apply the
    rules below.
    """
    from aiohttp import web

    def plain(status: int, message: str, kind: str, headers: Optional[dict] = None, **fields: Any):
        return json_error(status, message, headers=headers)

    render = render or plain

    @web.middleware
    async def json_errors(request, handler):
        try:
            declared, limit = request.content_length, request.client_max_size
            if declared is not None and limit and declared > limit:  # refused before a byte of it is read
                raise too_large(limit, declared)
            return await handler(request)
        except BadRequest as e:
            return render(400, str(e), "invalid_request_error")
        except web.HTTPException as e:
            if e.status < 400:  # redirects and the like are not errors
                raise
            if e.status == 404:
                msg = f"no route {request.method} {request.path}; {routes_help}"
            elif e.status == 405:
                msg = f"method {request.method} not allowed on {request.path}; {routes_help}"
            else:
                msg = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            return render(e.status, msg, "invalid_request_error", headers=headers)
        except asyncio.CancelledError:  # the client went away: not an error of ours
            raise
        except Exception as e:
            answer = translate(e) if translate is not None else None
            if answer is not None:
                status, msg, fields = answer
                fields = dict(fields)
                kind = fields.pop("kind", "invalid_request_error" if status < 500 else "server_error")
                return render(status, msg, kind, **fields)
            # A bug must not take the server down; say what happened.
            log.exception("error while handling %s %s", request.method, request.path)
            return render(500, f"internal server error: {type(e).__name__}: {e}", "server_error")

    return json_errors
