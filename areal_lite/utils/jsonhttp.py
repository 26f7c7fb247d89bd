"""JSON over HTTP for the kit's servers (the embedded inference server and the RAG server).

Both servers promise the same thing to a client that sends bad input: a 4xx answer whose body is
`{"error": "<what was wrong and what to send instead>"}`, and a server that stays up. This module is that promise,
written once:
- `BadRequest` is raised by body parsers with a message meant for the client; the middleware turns it into a 400.
- aiohttp's own errors (404 unknown route, 405 wrong method, 413 body too large, 503 from a handler) become JSON
  with the same shape; 404/405 list the server's routes so the client can see what exists.
- Any other exception is a bug in the server: it is logged with its traceback and answered with a 500, and the
  server keeps serving the next request.
- A server with its own error body (the chat endpoint answers in OpenAI's shape) passes a renderer and a translation
  of its own exceptions; the rules above stay the same.
aiohttp is imported inside the functions, so importing this module (and the packages that do) stays light.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable, Optional, Tuple

__all__ = ["BadRequest", "describe", "json_error", "json_errors_middleware", "read_json", "read_json_object"]


class BadRequest(ValueError):
    """A request the server cannot serve as sent; the message says what to send instead (answered with a 400)."""


def describe(v: Any) -> str:
    """A short description of a JSON value for error messages: its Python type and, when short, the value."""
    text = json.dumps(v) if isinstance(v, (str, int, float, bool, type(None))) else type(v).__name__
    return f"{type(v).__name__} {text}" if len(text) < 60 else type(v).__name__


def json_error(status: int, error: str, headers: Optional[dict] = None, **extra: Any):
    """An aiohttp JSON response `{"error": error, **extra}` with `status`."""
    from aiohttp import web

    return web.json_response({"error": error, **extra}, status=status, headers=headers)


async def read_json(request) -> Any:
    """The request body parsed as JSON; None for an empty body. Raises BadRequest for anything unreadable."""
    raw = await request.read()  # aiohttp raises 413 past the app's client_max_size
    if not raw.strip():
        return None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRequest("the request body is not UTF-8") from None
    except ValueError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


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
