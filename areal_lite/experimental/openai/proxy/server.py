"""An OpenAI-compatible chat endpoint in front of the rollout engine, recording every completion token-exactly.

    server = ChatServer(engine, tokenizer, gconfig).start()       # http://127.0.0.1:<free port>/v1
    session = server.open_session()                               # one per episode; its api_key names it
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=session.api_key)
    reply = await client.chat.completions.create(model="areal-lite", messages=[...], tools=[...])
    cache = server.close_session(session.api_key).cache; server.stop()   # InteractionCache: rewards, export, batch

Routes: `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`.

Design decisions
- Each choice is one `engine.agenerate(ModelRequest(...))` (`n` fans out): weight versions, pause/resume and the
  staleness bound apply to agent traffic as to any workflow's.
- Own thread and loop, never `asyncio.run` (`start`); dropped unstopped (a cell run again), it stops when collected.
- Sessions are named by the Bearer token (AReaL's proxy), one per episode; an unknown key is a 401: not recordable.
- A turn continues an earlier completion from its ids (`chat_template`); choices go to `cache` unless `store=false`.
- Errors have OpenAI's shape: a bad body 400 (`protocol`), an unknown key 401, a prompt too long 400
  `context_length_exceeded` (`ChatCompleter._gconfig`), an engine's 4xx passed on, an engine failure 502, a bug 500.
- Tool calls are written in the template's format, Hermes blocks or `tool_syntax="compact"` (`tool_call_parser`);
  the client sees OpenAI `tool_calls`. Malformed or dropped calls are counted in `stats()`, never errors (`_choice`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
import uuid
import weakref
from collections import Counter
from typing import Any, Dict, List, Optional

from areal_lite.api.cli_args import GenerationHyperparameters
from areal_lite.api.io_struct import ModelRequest, ModelResponse
from areal_lite.experimental.openai.cache import Interaction, InteractionCache
from areal_lite.experimental.openai.chat_template import ChatTemplate
from areal_lite.experimental.openai.proxy.protocol import (
    ChatRequest,
    ChatRequestError,
    ChoiceResult,
    completion_body,
    error_body,
    models_body,
    parse_chat_request,
    stream_events,
)
from areal_lite.utils.hf_utils import count_tokens, longest_token, token_bytes, token_lower_bound
from areal_lite.utils.jsonhttp import json_errors_middleware, off_loop, read_json
from areal_lite.utils.loop_thread import LoopThread

__all__ = ["ChatServer", "ChatSession", "ChatCompleter"]

logger = logging.getLogger(__name__)

_ROUTES = "routes: POST /v1/chat/completions, GET /v1/models, GET /health"
_STAT_KEYS = (
    "requests",
    "completions",
    "errors",
    "tool_calls",
    "tool_parse_failures",
    "tool_calls_dropped",
    "template_drifts",
    "template_mismatches",
)
MAX_BODY_BYTES = 64 * 1024 * 1024  # a long agent conversation with tool results is large; aiohttp's default is 1 MiB
OFF_LOOP_CHARS = 4096  # longer conversations are rendered and tokenized on a worker thread: the loop serves others
_FINISH = {"stop": "stop", "length": "length", "abort": "length", "tool_calls": "tool_calls"}


def _meets_tool_choice(tool_choice: Any, tool_calls: Optional[List[Dict[str, Any]]]) -> bool:
    """Whether a reply honours "required" (some call) or a named function (a call of it); other choices always do."""
    if tool_choice == "required":
        return bool(tool_calls)
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return any(c["function"]["name"] == name for c in tool_calls or [])
    return True


class ChatSession:
    """One episode's conversation record: its api key, its `InteractionCache`, its sampling defaults, counters."""

    def __init__(self, api_key: str, gconfig: GenerationHyperparameters):
        self.api_key = api_key
        self.gconfig = gconfig
        self.cache = InteractionCache()
        self.stats: Counter = Counter()
        self.closed = False

    def __repr__(self) -> str:
        return f"ChatSession(interactions={len(self.cache)}, closed={self.closed}, stats={dict(self.stats)})"


def _request_gconfig(base: GenerationHyperparameters, req: ChatRequest, stop_ids: List[int]):
    """The session's sampling defaults overridden by the request's fields (one sample: `n` fans out)."""
    g = base.new(n_samples=1, stop_token_ids=sorted(set(base.stop_token_ids) | set(stop_ids)))
    changes: Dict[str, Any] = {}
    if req.temperature is not None:
        changes.update(temperature=req.temperature, greedy=req.temperature == 0.0)
    if req.top_p is not None:
        changes["top_p"] = req.top_p
    if req.top_k is not None:
        changes["top_k"] = req.top_k
    if req.max_tokens is not None:
        changes["max_new_tokens"] = req.max_tokens
    if req.stop is not None:
        changes["stop"] = list(req.stop)
    if req.frequency_penalty is not None:
        changes["frequency_penalty"] = req.frequency_penalty
    return g.new(**changes)


def model_context_length(tokenizer) -> Optional[int]:
    """The model's context length: `max_position_embeddings` of the config next to the tokenizer (what the embedded
    server serves by default), else the tokenizer's `model_max_length` when it is a real limit (tokenizers without
    one say 1e30); None when neither is known (the engine's own refusal is then passed on)."""
    try:
        from transformers import AutoConfig

        n = getattr(AutoConfig.from_pretrained(tokenizer.name_or_path), "max_position_embeddings", None)
        if isinstance(n, int) and n > 0:
            return n
    except (OSError, ValueError, KeyError):  # a tokenizer that does not come from a model folder
        pass
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10**7 else None


def _context_error(limit: int, prompt: int, max_tokens: Optional[int], at_least: bool = False) -> ChatRequestError:
    """OpenAI's and vLLM's words for a request that does not fit the model's context (`at_least`: `prompt` is a
    lower bound, for a prompt refused from its length alone)."""
    some = "at least " if at_least else ""
    if max_tokens is None:
        asked, param = f"your messages resulted in {some}{prompt} tokens", "messages"
        fix = "Please reduce the length of the messages."
    else:
        asked = (f"you requested {some}{prompt + max_tokens} tokens ({some}{prompt} in the messages, {max_tokens} in "
                 "the completion)")  # fmt: skip
        param, fix = "max_tokens", "Please reduce the length of the messages or completion."
    message = f"This model's maximum context length is {limit} tokens. However, {asked}. {fix}"
    return ChatRequestError(message, param, "context_length_exceeded")


class ChatCompleter:
    """Turns a validated request into recorded completions (the part of the server that is not HTTP)."""

    def __init__(self, engine, tokenizer, template: ChatTemplate, stats: Counter, context_length: Optional[int]):
        self.engine, self.tokenizer, self.template, self.stats = engine, tokenizer, template, stats
        self.context_length = context_length
        if context_length is not None:  # what `token_lower_bound` needs, found now rather than on a long request
            longest_token(tokenizer)

    def _render(self, req: ChatRequest, long: bool) -> List[int]:
        """The prompt ids of the whole conversation. A long one (over `OFF_LOOP_CHARS` characters, rendered on a
        worker thread by `prompt` so that /health keeps answering) is counted first, and refused when it cannot fit
        without building its ids (`hf_utils.count_tokens` says why)."""
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2

        args = (req.messages, req.tools, req.chat_template_kwargs)
        try:
            if long and self.context_length is not None:
                text = self.template.render_text(*args)
                at_least = token_lower_bound(self.tokenizer, text)  # megabytes are refused without tokenizing
                by_length = at_least >= self.context_length
                n = at_least if by_length else count_tokens(self.tokenizer, text, False)
                if n >= self.context_length:
                    raise _context_error(self.context_length, n, req.max_tokens, at_least=by_length)
            return self.template.render(*args)
        except TemplateError as e:  # e.g. a template that insists on alternating roles
            raise ChatRequestError(f"the model's chat template refused these messages: {e}", "messages") from None

    async def prompt(self, session: ChatSession, req: ChatRequest):
        """(prompt ids, parent interaction or None, drift) for this request."""
        long = sum(len(m.get("content") or "") for m in req.messages) > OFF_LOOP_CHARS
        full = await off_loop(long, self._render, req, long)
        parent = session.cache.find_parent(req.messages, req.tools) if req.store else None
        if parent is None:
            return full, None, False
        resp = parent.model_response
        cont = self.template.continue_from(resp.input_tokens, resp.output_tokens, full)
        if cont is None:
            self._count(session, "template_mismatches")
            logger.warning("turn after %s cannot be aligned with the template; rendered afresh", parent.interaction_id)
            return full, None, False
        if cont.drift:
            self._count(session, "template_drifts")
        return cont.input_ids, parent, cont.drift

    def _count(self, session: ChatSession, key: str, k: int = 1) -> None:
        self.stats[key] += k
        session.stats[key] += k

    def _choice(self, session: ChatSession, req: ChatRequest, resp: ModelResponse) -> ChoiceResult:
        """One generated sample as the choice the agent gets, its tool calls parsed (unless `tool_choice="none"`).

        A malformed tool call is not an error: the choice is a text answer, and `tool_parse_failures` counts it.
        "required" and a named `tool_choice` are not forced by constrained decoding (a forced token would not be the
        policy's sample): a reply without the call is counted (`tool_choice_unmet`). `parallel_tool_calls=false`
        hands the agent only the first call (vLLM's rule) and counts the rest (`tool_calls_dropped`); the interaction
        still records the whole sample, whose ids the next turn continues.
        """
        text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        finish = _FINISH.get(resp.stop_reason, "stop")
        hits = [text.find(s) for s in req.stop or [] if s and s in text] if finish == "stop" else []
        if hits:  # OpenAI leaves the stop string out of the content, and what its last token carried after it
            text = text[: min(hits)]  # the first match is where the server stopped (the ids keep all of it)
        message: Dict[str, Any] = {"role": "assistant", "content": text}
        if req.parses_tools:
            parsed = self.template.parse_tool_calls(text, req.tools)
            if parsed.error is not None:
                self._count(session, "tool_parse_failures")
                logger.info("tool call not parsed (%s); answered as text", parsed.error)
            elif parsed.tool_calls:
                self._count(session, "tool_calls", len(parsed.tool_calls))
                calls = parsed.tool_calls
                if not req.parallel_tool_calls and len(calls) > 1:
                    self._count(session, "tool_calls_dropped", len(calls) - 1)
                    calls = calls[:1]
                message = {"role": "assistant", "content": parsed.content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
            if not _meets_tool_choice(req.tool_choice, message.get("tool_calls")):
                self._count(session, "tool_choice_unmet")
        ids = list(resp.output_tokens)
        texts = [self.tokenizer.decode([t]) for t in ids] if req.logprobs else []
        raw = token_bytes(self.tokenizer, ids) if req.logprobs else []
        return ChoiceResult(message, finish, ids, list(resp.output_logprobs), texts, raw)

    def _gconfig(self, session: ChatSession, req: ChatRequest, prompt: int):
        """The request's sampling settings, after checking that it fits the model's context and the session's.

        The context is judged here, as OpenAI and vLLM do, not left to the engine (whose refusal would reach the
        client as an engine error): prompt + `max_tokens` over `context_length` is a 400 `context_length_exceeded`
        stating the limit, and a request without `max_tokens` generates at most what the context leaves."""
        g = _request_gconfig(session.gconfig, req, self.template.stop_token_ids)
        limit = self.context_length
        if limit is not None:
            if prompt >= limit or (req.max_tokens is not None and prompt + req.max_tokens > limit):
                raise _context_error(limit, prompt, req.max_tokens)
            if req.max_tokens is None:
                g = g.new(max_new_tokens=min(g.max_new_tokens, limit - prompt))
        if g.max_tokens - prompt <= 0:
            raise ChatRequestError(
                f"the prompt has {prompt} tokens and the session allows {g.max_tokens} in all (gconfig.max_tokens)",
                "messages",
                "context_length_exceeded",
            )
        return g

    async def complete(self, session: ChatSession, req: ChatRequest, model: str) -> Dict[str, Any]:
        """Generate `req.n` choices, record them in the session, return the `chat.completion` body."""
        ids, parent, drift = await self.prompt(session, req)
        g = self._gconfig(session, req, len(ids))
        reqs = [ModelRequest(input_ids=list(ids), gconfig=g, tokenizer=self.tokenizer) for _ in range(req.n)]
        resps = await asyncio.gather(*(self.engine.agenerate(r) for r in reqs))
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:29]}", int(time.time())
        choices = [self._choice(session, req, r) for r in resps]
        self._count(session, "completions", req.n)
        if req.store and not session.closed:
            for i, (resp, ch) in enumerate(zip(resps, choices)):
                key = cid if req.n == 1 else f"{cid}-{i}"
                interaction = Interaction(
                    interaction_id=key,
                    messages=[dict(m) for m in req.messages],
                    output_message_list=[ch.message],
                    model_response=resp,
                    parent=parent,
                    completion_id=cid,
                    tools=req.tools,
                    drift=drift,
                )
                session.cache.add(interaction)
        return completion_body(cid, created, model, req, ids, choices)


async def _health(request) -> Any:
    from aiohttp import web

    return web.json_response({"status": "ok"})


def _weakly(handler):
    """A route calling the bound method `handler` through a weak reference: the running app must not keep its server
    alive, or a dropped server would serve forever (its finalizer stops it)."""
    ref = weakref.WeakMethod(handler)

    async def route(request):
        from aiohttp import web

        method = ref()
        if method is None:  # between the collection and the finalizer's cleanup
            raise web.HTTPServiceUnavailable()
        return await method(request)

    return route


class ChatServer:
    """The endpoint (see the module docstring). `start()` returns self; `base_url` ends with `/v1`.

    `engine` is anything with `agenerate(ModelRequest)`: the kit's `RemoteSGLangEngine`, or AReaL's engine."""

    def __init__(
        self,
        engine,
        tokenizer,
        gconfig: Optional[GenerationHyperparameters] = None,
        model: str = "areal-lite",
        host: str = "127.0.0.1",
        port: int = 0,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        context_length: Optional[int] = None,
        tool_syntax: str = "hermes",
    ):
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.context_length = context_length if context_length is not None else model_context_length(tokenizer)
        self.gconfig = gconfig if gconfig is not None else GenerationHyperparameters(max_new_tokens=512)
        self.host, self.port = host, int(port)
        self.template = ChatTemplate(tokenizer, chat_template_kwargs, tool_syntax)
        # Every key up front: stats() copies the counter from another thread, which must never see it grow.
        self._stats: Counter = Counter(dict.fromkeys(_STAT_KEYS, 0))
        self.completer = ChatCompleter(engine, tokenizer, self.template, self._stats, self.context_length)
        self._sessions: Dict[str, ChatSession] = {}
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._runner = None
        self._finalizer: Optional[weakref.finalize] = None
        self._created = int(time.time())

    # -------------------------------------------------------------------------------------------- lifecycle

    @property
    def base_url(self) -> str:
        if self._thread is None:
            raise RuntimeError("the chat server is not running: call start() first")
        return f"http://{self.host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 30.0) -> "ChatServer":
        """Bind, start the serving thread, return when requests are accepted.

        The socket is bound here, on a port the OS picks, before aiohttp starts: no race with another process. The
        server has its own thread and loop, not the engine's: that loop is the engine's private attribute and its
        `destroy()` cancels every task on it, while `agenerate` already accepts callers from a foreign loop.
        `start`/`stop` block only on this server's loop and never call `asyncio.run`.
        """
        if self._thread is not None:
            raise RuntimeError("this chat server was started already")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except BaseException:
            sock.close()  # a port in use: say so, and hold nothing
            raise
        self.port = sock.getsockname()[1]
        runner = LoopThread("areal-lite-chat")
        self._loop, self._thread = runner.loop, runner.thread
        try:
            asyncio.run_coroutine_threadsafe(self._serve(sock), self._loop).result(timeout)
        except BaseException:
            self._undo_start(sock, timeout)
            raise
        self._finalizer = runner.release_with(self, self._runner.cleanup)
        return self

    def _undo_start(self, sock: socket.socket, timeout: float) -> None:
        """A start that failed or timed out: cancel what it began, then `stop()` (the app's cleanup, the thread);
        free the port. start() may be called again."""

        async def cancel_start() -> None:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        timeout = max(timeout, 10.0)  # a start that timed out after `timeout` gets its own time to undo
        try:
            asyncio.run_coroutine_threadsafe(cancel_start(), self._loop).result(timeout)
        finally:
            self.stop(timeout)
            sock.close()
            self._loop = self._thread = self._runner = None

    async def _serve(self, sock: socket.socket) -> None:
        from aiohttp import web

        app = web.Application(middlewares=[self._errors_middleware()], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", _weakly(self._handle_chat))
        app.router.add_get("/v1/models", _weakly(self._handle_models))
        app.router.add_get("/health", _health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and join the thread (safe to call twice; sessions stay readable)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        if self._finalizer is not None:
            self._finalizer.detach()  # this orderly stop replaces the garbage collector's
        if self._runner is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(timeout)
            except Exception as e:  # keep tearing down
                logger.warning("chat server cleanup: %s: %s", type(e).__name__, e)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if not thread.is_alive():
            loop.close()

    def __enter__(self) -> "ChatServer":
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -------------------------------------------------------------------------------------------- sessions

    def open_session(
        self, gconfig: Optional[GenerationHyperparameters] = None, api_key: Optional[str] = None
    ) -> ChatSession:
        """A new session (default sampling: `gconfig`, else the server's); its `api_key` is the client's key."""
        key = api_key or f"sk-areal-{secrets.token_hex(16)}"
        with self._lock:
            if key in self._sessions:
                raise ValueError("a session with this api_key is open already")
            session = self._sessions[key] = ChatSession(key, gconfig or self.gconfig)
        return session

    def close_session(self, api_key: str) -> ChatSession:
        """Forget the session (later requests with its key get 401) and return it with its interactions."""
        with self._lock:
            session = self._sessions.pop(api_key)
        session.closed = True
        return session

    def session(self, api_key: str) -> Optional[ChatSession]:
        with self._lock:
            return self._sessions.get(api_key)

    def stats(self) -> Dict[str, int]:
        """Counters since start: requests, completions, errors, tool_calls, tool_parse_failures, tool_calls_dropped,
        template_drifts, template_mismatches, open_sessions; and tool_choice_unmet once a reply has ignored a
        required tool call."""
        with self._lock:
            return {**self._stats, "open_sessions": len(self._sessions)}

    # -------------------------------------------------------------------------------------------- HTTP

    def _session_of(self, request) -> ChatSession:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        session = self.session(key) if key else None
        if session is None:
            raise ChatRequestError(
                "unknown or missing api_key: open a session with server.open_session() and pass its api_key "
                "to the client (one session per episode)",
                code="invalid_api_key",
                status=401,
            )
        return session

    async def _handle_chat(self, request):
        from aiohttp import web

        self._stats["requests"] += 1
        session = self._session_of(request)
        body = await read_json(request)
        req = parse_chat_request(body)
        try:
            out = await self.completer.complete(session, req, self.model)
        except ChatRequestError:
            raise
        except ValueError as e:  # refused by the engine before generating (check_request)
            raise ChatRequestError(str(e), "messages") from None
        if not req.stream:
            return web.json_response(out, dumps=lambda o: json.dumps(o, ensure_ascii=False))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for event in stream_events(out, req):
            await resp.write(event.encode("utf-8"))
        await resp.write_eof()
        return resp

    async def _handle_models(self, request):
        from aiohttp import web

        return web.json_response(models_body(self.model, self._created))

    def _errors_middleware(self):
        """The kit's JSON error rules (`jsonhttp`) with OpenAI's error body, and the endpoint's own errors."""
        from aiohttp import web

        from areal_lite.infra.remote_inf_engine import EngineError

        stats = self._stats  # not self: the app must not keep the server alive (`_weakly`)

        def render(status, message, kind, headers=None, param=None, code=None):
            stats["errors"] += 1
            return web.json_response(error_body(message, param, code, kind), status=status, headers=headers)

        def translate(e: Exception):
            if isinstance(e, ChatRequestError):
                return e.status, str(e), {"param": e.param, "code": e.code}
            if isinstance(e, EngineError) and e.status is not None and 400 <= e.status < 500:
                return e.status, f"the inference engine refused the request: {e}", {}  # the request is wrong
            if isinstance(e, EngineError):
                return 502, f"the inference engine failed: {e}", {"kind": "api_error"}
            return None

        return json_errors_middleware(_ROUTES, logger, render=render, translate=translate)
