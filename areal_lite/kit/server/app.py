"""The HTTP side of the server: aiohttp routes with SGLang's paths, request and response shapes (`ROUTES`).

Design decisions
- Handlers are thin: read the body (`utils.jsonhttp`), validate it (`protocol`), hand the work to the `Scheduler`
  and wait on its future, render the answer (`protocol`). They run on the event loop and never touch the model, so
  a long decode never blocks a health check or a pause.
- Nor does long text: a /generate whose text prompts total more than `OFF_LOOP_CHARS` characters is validated and
  tokenized on a worker thread, and answers of more than `OFF_LOOP_TOKENS` tokens are decoded and serialized there;
  smaller ones are handled inline. The tokenizer is only read, never reconfigured, so threads may share it.
- One error contract for every route, shared with the kit's other servers (`jsonhttp.json_errors_middleware`): a bad
  body gets 400 `{"error": "..."}`, an unknown route 404, a wrong method 405 (both listing the routes), a route hit
  while the model loads 503 (`/model_info`: nulls), a bug 500; the server keeps serving in every case.
- The server binds before the model loads (`/health` answers 503 until it is ready), so a launcher can tell
  "still loading" from "crashed". `ServerState.scheduler` is None until then.
- A client that disconnects cancels its handler (`handler_cancellation`, set in `cli`), which aborts its rows.
- rids in flight are unique: a request reusing one gets a 400 rather than make `/abort_request` ambiguous.
- LoRA (`lora.py`): `/load_lora_adapter` and `/unload_lora_adapter` take SGLang's bodies and answer SGLang's
  `{"success", "error_message", "loaded_adapters"}`; a /generate whose `lora_path` names an adapter that is not
  loaded is refused with 400 before anything is queued.
- NCCL weight updates are not served: their routes answer 400, pointing to `/update_weights_from_disk`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import uuid
from typing import Any, Optional

from aiohttp import web

from areal_lite.kit.server.protocol import (
    DEFAULT_WEIGHT_VERSION,
    GenerationState,
    PromptSpec,
    SamplingParams,
    check_control_fields,
    parse_abort_body,
    parse_generate_body,
    parse_load_lora_body,
    parse_lora_paths,
    parse_pause_body,
    parse_unload_lora_body,
    parse_update_weights_body,
    render_generate_response,
)
from areal_lite.kit.server.scheduler import Scheduler
from areal_lite.utils.hf_utils import count_tokens, token_lower_bound
from areal_lite.utils.jsonhttp import (
    BadRequest,
    json_error,
    json_errors_middleware,
    off_loop,
    read_json,
    read_json_object,
)

log = logging.getLogger("areal_lite.kit.server")  # one logger for the server

MAX_BODY_BYTES = 256 * 1024 * 1024  # a batch of long prompts as JSON token ids is large; aiohttp's default is 1 MiB
OFF_LOOP_CHARS = 4096  # longer text prompts are tokenized on a worker thread, so the event loop serves others
OFF_LOOP_TOKENS = 4096  # generated tokens of one request above which its answer is rendered on a worker thread


class ServerState:
    """What the HTTP handlers share: the scheduler once the model is loaded, and the rids in flight."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.scheduler: Optional[Scheduler] = None
        self.tokenizer: Any = None
        self.model_path = args.model_path
        self.inflight: set[str] = set()


STATE = web.AppKey("state", ServerState)


def _state(request: web.Request) -> ServerState:
    return request.app[STATE]


def _scheduler_or_503(request: web.Request) -> Scheduler:
    scheduler = _state(request).scheduler
    if scheduler is None:
        raise web.HTTPServiceUnavailable(text="model is loading")
    return scheduler


async def run_states(state: ServerState, states: list[GenerationState]) -> None:
    """Hand rows to the scheduler and wait until all are finished. A client that disconnects aborts them."""
    scheduler = state.scheduler
    assert scheduler is not None
    loop = asyncio.get_running_loop()
    futures = []
    for s in states:
        fut = loop.create_future()
        futures.append(fut)

        def done(row: GenerationState, fut=fut) -> None:  # runs on the scheduler thread
            def resolve() -> None:
                if not fut.done():
                    fut.set_result(row)

            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

        s.on_done = done
        state.inflight.add(s.rid)
    try:
        scheduler.submit(states)
        await asyncio.gather(*futures)
    except asyncio.CancelledError:
        for s in states:
            if s.finish is None:
                scheduler.abort(rid=s.rid)
        raise
    finally:
        for s in states:
            state.inflight.discard(s.rid)


# ----------------------------------------------------------------------------------------------------------------
# handlers


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if _state(request).scheduler is not None else 503)


async def health_generate(request: web.Request) -> web.Response:
    state = _state(request)
    scheduler = state.scheduler
    if scheduler is None:
        return web.Response(status=503)
    if len(scheduler.batch) or scheduler.paused:  # busy (or gated): the scheduler is alive, skip the probe
        return web.Response(status=200)
    params = SamplingParams(max_new_tokens=1, temperature=0)
    probe = scheduler.new_state(PromptSpec(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], params, False), 0)
    try:
        await asyncio.wait_for(run_states(state, [probe]), timeout=30)
    except asyncio.TimeoutError:
        return web.Response(status=503)
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    state = _state(request)
    scheduler = state.scheduler
    cfg = scheduler.model.config if scheduler else None
    return web.json_response(
        {
            "model_path": scheduler.weights.model_path if scheduler else state.model_path,
            "served_model_name": state.model_path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": scheduler.weights.version if scheduler else DEFAULT_WEIGHT_VERSION,
            "max_context_length": scheduler.context_length if scheduler else None,
            "vocab_size": scheduler.vocab_size if scheduler else None,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        }
    )


async def server_info(request: web.Request) -> web.Response:
    scheduler = _scheduler_or_503(request)
    args = dict(vars(_state(request).args))
    return web.json_response({"server": "areal-lite-embedded", "args": args, **scheduler.stats()})


def _text_chars(body: Any) -> int:
    """How many characters of text prompts a /generate body carries (0 for token ids or a malformed body)."""
    text = body.get("text") if isinstance(body, dict) else None
    texts = text if isinstance(text, list) else [text]
    return sum(len(t) for t in texts if isinstance(t, str))


def _tokenize(tok: Any, context_length: int) -> Any:
    """Text -> prompt ids for `parse_generate_body`. A long text that cannot fit comes back as `range(n)`, n its
    token count: the parser reads only its length before refusing it (`hf_utils.count_tokens` says why)."""

    def tokenize(text: str):
        if len(text) > OFF_LOOP_CHARS:
            at_least = token_lower_bound(tok, text)
            if at_least >= context_length:  # refused from its length alone, without tokenizing megabytes
                raise BadRequest(f"a text prompt of {len(text)} characters is longer than the context length "
                                 f"{context_length}: it has at least {at_least} tokens")  # fmt: skip
            n = count_tokens(tok, text)
            if n >= context_length:
                return range(n)
        return tok(text)["input_ids"]

    return tokenize if tok is not None else None


def _render(states: list[GenerationState], tokenizer: Any, text_in_lp: bool, as_list: bool) -> str:
    out = [render_generate_response(s, tokenizer, text_in_lp) for s in states]
    return json.dumps(out if as_list else out[0])


async def generate(request: web.Request) -> web.Response:
    state = _state(request)
    scheduler = _scheduler_or_503(request)
    body = await read_json(request)
    tok = state.tokenizer
    is_batch, specs, text_in_lp = await off_loop(
        _text_chars(body) > OFF_LOOP_CHARS,
        parse_generate_body,
        body,
        vocab_size=scheduler.vocab_size,
        context_length=scheduler.context_length,
        tokenize=_tokenize(tok, scheduler.context_length),
    )
    for lora_path in set(parse_lora_paths(body, len(specs))):
        problem = scheduler.weights.lora.check_request(lora_path)  # a plain read of the scheduler's active adapter
        if problem:
            raise BadRequest(problem)
    states = [scheduler.new_state(spec, j) for spec in specs for j in range(spec.params.n)]
    clash = [s.rid for s in states if s.rid in state.inflight]
    if clash:
        raise BadRequest(f"rid {clash[0]!r} is already in flight; request ids must be unique")
    await run_states(state, states)
    big = sum(len(s.output) for s in states) > OFF_LOOP_TOKENS
    text = await off_loop(big, _render, states, tok, text_in_lp, is_batch or len(states) > 1)
    return web.Response(text=text, content_type="application/json")


async def pause_generation(request: web.Request) -> web.Response:
    mode = parse_pause_body(await read_json_object(request))
    return web.json_response(await asyncio.wrap_future(_scheduler_or_503(request).pause(mode)))


async def continue_generation(request: web.Request) -> web.Response:
    check_control_fields("/continue_generation", await read_json_object(request))
    return web.json_response(await asyncio.wrap_future(_scheduler_or_503(request).continue_generation()))


async def abort_request(request: web.Request) -> web.Response:
    rid, abort_all = parse_abort_body(await read_json_object(request))
    await asyncio.wrap_future(_scheduler_or_503(request).abort(rid=rid, abort_all=abort_all))
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    if request.method == "POST":  # SGLang reads no body here: any field in one is refused rather than ignored
        check_control_fields("/flush_cache", await read_json_object(request))
    if await asyncio.wrap_future(_scheduler_or_503(request).flush_cache()):
        return web.Response(text="Cache flushed.\n", content_type="text/plain")
    return web.Response(
        status=400, content_type="text/plain",
        text="Cache not flushed: there are running or waiting requests (this server has no prefix cache).\n",
    )  # fmt: skip


async def update_weights_from_disk(request: web.Request) -> web.Response:
    update = parse_update_weights_body(await read_json_object(request))
    result = await asyncio.wrap_future(_scheduler_or_503(request).update_weights(update))
    if not result["success"]:  # SGLang's body, plus the kit's "error" (every 4xx of this server has one)
        return json_error(400, result["message"], **result)
    return web.json_response(result)


async def load_lora_adapter(request: web.Request) -> web.Response:
    return await _lora_update(request, parse_load_lora_body(await read_json_object(request)))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    return await _lora_update(request, parse_unload_lora_body(await read_json_object(request)))


async def _lora_update(request: web.Request, update: Any) -> web.Response:
    """A LoRA load or unload through the scheduler; a failure answers 400 with SGLang's fields and the kit's "error"."""
    result = await asyncio.wrap_future(_scheduler_or_503(request).update_weights(update))
    if not result["success"]:
        return json_error(400, result["error_message"], **result)
    return web.json_response(result)


async def not_supported(request: web.Request) -> web.Response:
    await read_json_object(request)
    msg = f"{request.path} is not supported by the embedded server (use disk: /update_weights_from_disk)"
    return json_error(400, msg, success=False, message=msg)


ROUTES = [
    ("GET", "/health", health),
    ("GET", "/health_generate", health_generate),
    ("GET", "/model_info", model_info),
    ("GET", "/get_model_info", model_info),
    ("GET", "/server_info", server_info),
    ("GET", "/get_server_info", server_info),
    ("POST", "/generate", generate),
    ("POST", "/pause_generation", pause_generation),
    ("POST", "/continue_generation", continue_generation),
    ("POST", "/abort_request", abort_request),
    ("GET", "/flush_cache", flush_cache),
    ("POST", "/flush_cache", flush_cache),
    ("POST", "/update_weights_from_disk", update_weights_from_disk),
    ("POST", "/load_lora_adapter", load_lora_adapter),
    ("POST", "/unload_lora_adapter", unload_lora_adapter),
    ("POST", "/init_weights_update_group", not_supported),
    ("POST", "/update_weights_from_distributed", not_supported),
    ("POST", "/update_weights_from_tensor", not_supported),
]
ROUTES_HELP = "routes: " + ", ".join(f"{method} {path}" for method, path, _ in ROUTES)


def build_app(state: ServerState) -> web.Application:
    """The aiohttp application: SGLang's routes over `state`, every error answered as JSON."""
    app = web.Application(middlewares=[json_errors_middleware(ROUTES_HELP, log)], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    for method, path, handler in ROUTES:
        if method == "GET":  # GET routes answer HEAD too, except /flush_cache: a HEAD request must change nothing
            app.router.add_get(path, handler, allow_head=handler is not flush_cache)
        else:
            app.router.add_route(method, path, handler)
    return app
