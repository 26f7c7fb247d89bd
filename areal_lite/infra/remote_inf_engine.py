"""The HTTP client of SGLang-compatible servers: requests, rid routing, interrupt/resume, weight-update calls.

`SGLangClient` is what `RemoteSGLangEngine.agenerate`, `pause`, `resume` and `update_weights` use underneath. It
knows servers, requests and versions, nothing of workflows or the staleness bound (`infra.workflow_executor`).
Every coroutine here runs on the engine's one background event loop.

Design decisions
- One aiohttp session, made on the background loop and closed by `close()`: a session is bound to the loop that
  made it, so the engine forwards calls from other loops here rather than open one per caller loop.
- Retries: connection errors and 5xx are retried with backoff (`request`); a 4xx is an `EngineError` at once, with
  the server's message: retrying a wrong request only delays the message the learner needs to read.
- Interrupt and resume (`_generate_chunks`): `paused` goes up before `abort_all()`; an aborted request waits, then
  is re-sent as prompt + tokens so far with the remaining budget, so a weight update mid-generation loses nothing.
- Versions: each token carries the server's `weight_version`, else the engine's version when its chunk was sent
  (exact: weights change only while requests are paused or drained; the version at return would race).
- rid affinity (`choose_server`): the same rid goes to the same server, whose prefix cache holds the conversation.
- LoRA (`rollout.use_lora`) uses AReaL's wire shapes: `lora_path = <lora_name>-v<k>` (`lora_path`, `load_lora`).
- Shutting down (`closing`, `abort_inflight`): aborted requests return their partial output, `stop_reason="abort"`;
  the servers are left running and unpaused.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import time
import uuid
from typing import Any, Callable, Coroutine, Dict, List, Optional

import aiohttp

from areal_lite.api.cli_args import InferenceEngineConfig
from areal_lite.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta, get_versioned_lora_name

__all__ = ["ADDRS_ENV", "EngineError", "SGLangClient", "parse_addrs", "sampling_params"]

logger = logging.getLogger("areal_lite.engine")  # one logger name for the whole rollout side

ADDRS_ENV = "AREAL_LLM_SERVER_ADDRS"
_RID_CACHE = 4096  # rids remembered for server affinity (oldest forgotten first)
_BACKOFF_START, _BACKOFF_MAX = 0.1, 5.0  # seconds between retries of a failed request
_ABORT_GRACE = 2.0  # seconds a shutdown gives aborted requests to come back with their partial output
# Seconds between looks for a weight folder the trainer is writing: a stat call, while every server waits paused
# (AReaL's pause_poll_interval, 50 ms, adds half of it to a synchronous step on average: 0.4 s over the demo's 16).
_FOLDER_POLL = 0.005


class EngineError(RuntimeError):
    """A server refused or failed a request. `status` is the HTTP status of its last answer (None: no server
    answered), `address` the server, `reason` the error message of a 4xx answer's body as the server wrote it."""

    def __init__(
        self, message: str, status: Optional[int] = None, address: Optional[str] = None, reason: Optional[str] = None
    ):
        super().__init__(message)
        self.status = status
        self.address = address
        self.reason = reason


# ------------------------------------------------------------------------------------------------ small helpers


async def _unanswered_means_replaced(load: Coroutine[Any, Any, None]) -> None:
    """Await a weight load; when no server answers, say the likely cause: the trainer syncs an old engine."""
    try:
        await load
    except EngineError as e:
        if e.status is not None:  # a server answered: its own message says it all
            raise
        hint = (
            "no server answers there. If it was replaced (a server cell run again starts a new server and engine), "
            "the trainer still syncs this old engine: run actor.connect_engine(engine, meta) again"
        )
        raise EngineError(f"{e}; {hint}", address=e.address) from e


def parse_addrs(addr: Any) -> List[str]:
    """ "host:port", "host:port,host:port", a list of them, or None (read `AREAL_LLM_SERVER_ADDRS`) -> a list."""
    if addr is None:
        addr = os.environ.get(ADDRS_ENV, "")
        if not addr.strip():
            raise ValueError(f"no server address: pass initialize(addr='host:port') or set {ADDRS_ENV}=host:port,...")
    if isinstance(addr, str):
        addr = addr.split(",")
    out = []
    for a in addr:
        a = str(a).strip()
        for prefix in ("http://", "https://"):
            if a.startswith(prefix):
                a = a[len(prefix) :]
        a = a.rstrip("/")
        if not a:
            continue
        if ":" not in a:
            raise ValueError(f"server address {a!r} must look like host:port")
        out.append(a)
    if not out:
        raise ValueError(f"no server address in {addr!r}")
    return out


def looks_like_addrs(value: Any) -> bool:
    """A server address ("host:port") or a list of them, passed where AReaL expects an engine id."""
    if isinstance(value, (list, tuple)):
        return bool(value)
    return isinstance(value, str) and value.rsplit(":", 1)[-1].isdigit() and ":" in value


def _decode_body(raw: bytes) -> Any:
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _error_message(raw: bytes) -> str:
    body = _decode_body(raw)
    if isinstance(body, dict):
        for key in ("error", "message", "detail"):
            if key in body:
                value = body[key]
                if isinstance(value, dict) and "message" in value:
                    value = value["message"]
                return str(value)
    text = body if isinstance(body, str) else json.dumps(body)
    return text[:500] or "(empty body)"


def _parse_version(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def sampling_params(g: Any, max_new_tokens: Optional[int] = None) -> Dict[str, Any]:
    """SGLang `sampling_params` for one sample from a kit or AReaL `GenerationHyperparameters` (read by attribute).

    Token ids in and out: the client never needs detokenized text, so special tokens are kept and stop strings are
    not trimmed (`no_stop_trim`), which keeps `output_ids` exactly what was sampled.
    """
    greedy = bool(getattr(g, "greedy", False))
    top_k = int(getattr(g, "top_k", -1))
    if greedy or top_k <= 0 or top_k >= int(1e8):
        top_k = -1
    if getattr(g, "use_beam_search", False):
        raise ValueError("use_beam_search is not supported by the SGLang-compatible servers")
    params: Dict[str, Any] = {
        "max_new_tokens": int(g.max_new_tokens if max_new_tokens is None else max_new_tokens),
        "min_new_tokens": int(getattr(g, "min_new_tokens", 0)),
        "temperature": 0.0 if greedy else float(g.temperature),
        "top_p": 1.0 if greedy else float(getattr(g, "top_p", 1.0)),
        "top_k": top_k,
        "stop_token_ids": [int(t) for t in (getattr(g, "stop_token_ids", None) or [])],
        "ignore_eos": bool(getattr(g, "ignore_eos", False)),
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "n": 1,
    }
    if getattr(g, "frequency_penalty", 0.0):
        params["frequency_penalty"] = float(g.frequency_penalty)
    if getattr(g, "stop", None):
        params["stop"] = list(g.stop)
    return params


def _parse_generate(result: Any, addr: str):
    """/generate's answer -> (tokens, logprobs, finish_reason, message, weight_version or None)."""
    if isinstance(result, list) and len(result) == 1:
        result = result[0]
    try:
        meta = result["meta_info"]
        entries = meta["output_token_logprobs"]
        tokens = [int(e[1]) for e in entries]
        logprobs = [float(e[0]) for e in entries]
        reason = meta.get("finish_reason")
        finish = reason.get("type") if isinstance(reason, dict) else reason
        message = reason.get("message", "") if isinstance(reason, dict) else ""
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise EngineError(
            f"{addr}/generate answered without meta_info.output_token_logprobs/finish_reason "
            f"({type(e).__name__}: {e}); body starts {str(result)[:200]!r}",
            address=addr,
        ) from None
    return tokens, logprobs, finish, message, _parse_version(meta.get("weight_version"))


def check_request(req: ModelRequest) -> None:
    """Refuse, before anything is sent, a request that cannot be served (one sample, a prompt, room to generate)."""
    if req.gconfig.n_samples != 1:
        raise ValueError(
            f"agenerate takes one sample per request (gconfig.n_samples={req.gconfig.n_samples}); "
            "a grouped workflow fans out G requests with gconfig.new(n_samples=1)"
        )
    if not req.input_ids:
        raise ValueError("ModelRequest.input_ids is empty: tokenize the prompt first")
    max_tokens = getattr(req.gconfig, "max_tokens", None)
    if max_tokens is not None and max_tokens - len(req.input_ids) <= 0:
        raise ValueError(
            f"the prompt has {len(req.input_ids)} tokens: gconfig.max_tokens={max_tokens} leaves no room to generate"
        )


def nccl_specs(meta: WeightUpdateMeta) -> dict:
    """names/dtypes/shapes of the parameters to broadcast, from `meta` (set by the actor on the GPU route)."""
    names, dtypes, shapes = meta.names, meta.dtypes, meta.shapes
    if names and dtypes and shapes:
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("WeightUpdateMeta names/dtypes/shapes must have the same length")
        return {
            "names": list(names),
            "dtypes": [str(d).replace("torch.", "") for d in dtypes],
            "shapes": [list(s) for s in shapes],
        }
    raise NotImplementedError(
        "NCCL weight update needs the parameter names, dtypes and shapes: call actor.prepare_nccl_meta(meta) "
        "(it sets meta.names/meta.dtypes/meta.shapes) before update_weights(). The NCCL route is GPU-only; on CPU use "
        "WeightUpdateMeta.from_disk(path=...)."
    )


@dataclasses.dataclass
class _Generation:
    """What one `generate` call has received so far, across its resumed chunks."""

    start: float
    tokens: List[int] = dataclasses.field(default_factory=list)
    logprobs: List[float] = dataclasses.field(default_factory=list)
    versions: List[int] = dataclasses.field(default_factory=list)
    ttft: float = float("inf")
    stop_reason: str = "abort"  # what a cancelled or shut-down request reports


# ------------------------------------------------------------------------------------------------ the client


class SGLangClient:
    """Talks to the servers (see the module docstring). Not thread-safe: use it from the engine's loop only, except
    the `paused`/`closing` flags, which the engine sets from the caller's thread (plain attribute writes)."""

    LORA_LOAD, LORA_UNLOAD = "/load_lora_adapter", "/unload_lora_adapter"  # SGLang's adapter routes (`load_lora`)

    def __init__(self, config: InferenceEngineConfig, current_version: Callable[[], int]):
        self.config = config
        self.addresses: List[str] = []
        self.paused = False  # set before abort_all(), cleared after continue_all(): aborted requests wait meanwhile
        self.closing = False  # shutting down: aborted requests return what they have instead of resuming
        self._current_version = current_version
        self._session: Optional[aiohttp.ClientSession] = None
        self._rid_to_addr: "collections.OrderedDict[str, str]" = collections.OrderedDict()
        self._rr = 0
        self._inflight: Dict[str, str] = {}  # wire rid -> server, for generate calls in progress
        self._nccl_group_ready = False

    # -------------------------------------------------------------------------------------------- session

    async def connect(self) -> None:
        """Open the session and wait (up to `setup_timeout`) until every server answers GET /health."""
        # limit=0: the servers, not the client pool, decide how many requests run at once.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await asyncio.gather(*(self._wait_healthy(a) for a in self.addresses))

    async def _wait_healthy(self, addr: str) -> None:
        deadline = time.monotonic() + self.config.setup_timeout
        last = "no answer yet"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineError(
                    f"server {addr} did not become healthy within {self.config.setup_timeout:.0f}s "
                    f"(GET http://{addr}/health: {last})",
                    address=addr,
                )
            try:
                timeout = aiohttp.ClientTimeout(total=min(5.0, remaining))
                async with self._session.get(f"http://{addr}/health", timeout=timeout) as resp:
                    await resp.read()
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    async def abort_inflight(self) -> None:
        """Ask the servers to abort this client's requests and give them `_ABORT_GRACE` seconds to come back."""
        if not self._inflight or self._session is None:
            return
        aborts = [self._abort_on_server(addr, rid) for rid, addr in list(self._inflight.items())]
        await asyncio.gather(*aborts, return_exceptions=True)
        deadline = time.monotonic() + _ABORT_GRACE
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def probe(self, addr: str, endpoint: str) -> tuple:
        """One short GET, no retries: (HTTP status, decoded body), or (None, error text) when nothing answered."""
        try:
            async with self._session.get(f"http://{addr}{endpoint}", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status, _decode_body(await r.read())
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            return None, f"{type(e).__name__}: {e}"

    async def _abort_on_server(self, addr: str, rid: str) -> None:
        # One short attempt, no retries: the server may be the reason we are shutting down.
        timeout = aiohttp.ClientTimeout(total=_ABORT_GRACE)
        async with self._session.post(f"http://{addr}/abort_request", json={"rid": rid}, timeout=timeout) as resp:
            await resp.read()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # -------------------------------------------------------------------------------------------- HTTP

    async def request(self, method: str, addr: str, endpoint: str, body: Optional[dict] = None) -> Any:
        """One HTTP call with retries on connection errors and 5xx; 4xx raises EngineError at once.

        At most `request_retries` retries, with exponential backoff, within `request_timeout` seconds for the call
        (each resumed chunk of a generation is its own call; time spent paused is not counted)."""
        budget, retries = self.config.request_timeout, max(0, self.config.request_retries)
        deadline = time.monotonic() + budget
        delay, last, attempts, last_status = _BACKOFF_START, "no attempt made", 0, None
        url = f"http://{addr}{endpoint}"
        for attempt in range(retries + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            attempts += 1
            try:
                timeout = aiohttp.ClientTimeout(total=remaining)
                async with self._session.request(method, url, json=body, timeout=timeout) as resp:
                    raw = await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, OSError) as e:  # refused, reset, disconnected, timed out
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                last_status = None
            else:
                if status < 400:
                    return _decode_body(raw)
                msg = _error_message(raw)
                if status < 500:
                    raise EngineError(f"{url} rejected the request (HTTP {status}): {msg}", status, addr, msg)
                last, last_status = f"HTTP {status}: {msg}", status
            if attempt < retries:
                await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(2 * delay, _BACKOFF_MAX)
        raise EngineError(
            f"{method} {url} failed after {attempts} attempt(s) within {budget:g}s: {last}", last_status, addr
        )

    async def post_all(self, endpoint: str, body: dict) -> List[Any]:
        """POST the same body to every server at once; the answers in `addresses` order."""
        return list(await asyncio.gather(*(self.request("POST", a, endpoint, body) for a in self.addresses)))

    async def abort_all(self) -> None:
        """Abort the requests running on every server (set `paused` first: they wait for `continue_all`)."""
        await self.post_all("/pause_generation", {"mode": "abort"})

    async def continue_all(self) -> None:
        """Let every server run requests again (clear `paused` after this: the held requests re-send)."""
        await self.post_all("/continue_generation", {})

    # -------------------------------------------------------------------------------------------- routing

    def choose_server(self, rid: str) -> str:
        """The server pinned to `rid`, or the next one round-robin for a new rid (which is then pinned)."""
        addr = self._rid_to_addr.get(rid)
        if addr is not None:
            self._rid_to_addr.move_to_end(rid)
            return addr
        addr = self.addresses[self._rr % len(self.addresses)]
        self._rr += 1
        self._rid_to_addr[rid] = addr
        if len(self._rid_to_addr) > _RID_CACHE:
            self._rid_to_addr.popitem(last=False)
        return addr

    def server_for(self, rid: str) -> Optional[str]:
        """The server a rid is pinned to (None if the rid is unknown or forgotten)."""
        return self._rid_to_addr.get(rid)

    # -------------------------------------------------------------------------------------------- generation

    async def generate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one checked request (`check_request`), resuming across aborts until stop or length.

        A rid already in flight (a group of samples sharing one request object) gets a unique suffix on the wire, so
        the server never sees duplicates. `ttft` is approximate: requests are not streamed, so it is the time until
        the first response that carried a token. `latency` is wall time, pauses included."""
        addr = self.choose_server(req.rid)
        wire_rid = req.rid if req.rid not in self._inflight else f"{req.rid}-{uuid.uuid4().hex[:8]}"
        self._inflight[wire_rid] = addr
        out = _Generation(start=time.perf_counter())
        try:
            await self._generate_chunks(req, addr, wire_rid, out)
        except asyncio.CancelledError:
            if not self.closing:
                raise
            # The shutdown cancelled us: hand back the partial response instead of an exception in the caller.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        finally:
            self._inflight.pop(wire_rid, None)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=out.tokens,
            output_logprobs=out.logprobs,
            output_versions=out.versions,
            stop_reason=out.stop_reason,
            tokenizer=getattr(req, "tokenizer", None),
            latency=time.perf_counter() - out.start,
            ttft=out.ttft,
            rid=req.rid,
        )

    async def generate_once(
        self, addr: str, wire_rid: str, input_ids: List[int], g: Any, max_new_tokens: int, min_new_tokens: int
    ) -> tuple:
        """One generation call, no resuming: (tokens, logprobs, finish_reason, message, weight_version or None).
        The one place that knows the wire format of a generation (`VLLMClient` speaks /v1/completions here)."""
        params = sampling_params(g, max_new_tokens=max_new_tokens)
        params["min_new_tokens"] = min_new_tokens
        payload = {
            "input_ids": input_ids,
            "sampling_params": params,
            "return_logprob": True,
            "rid": wire_rid,
            "stream": False,
        }
        if self.config.use_lora:
            payload["lora_path"] = self.lora_path(g)
        return _parse_generate(await self.request("POST", addr, "/generate", payload), addr)

    def lora_path(self, g: Any) -> str:
        """The adapter a request asks for: AReaL's `<gconfig.lora_name>-v<current version>`."""
        name = getattr(g, "lora_name", "") or self.config.lora_name
        if not name:
            raise ValueError("rollout.use_lora needs an adapter name: set gconfig.lora_name (AReaL's rule)")
        return get_versioned_lora_name(name, self._current_version())

    async def _wait_unpaused(self) -> bool:
        """Sleep while paused; False if the client is shutting down."""
        while self.paused and not self.closing:
            await asyncio.sleep(self.config.pause_poll_interval)
        return not self.closing

    async def _generate_chunks(self, req: ModelRequest, addr: str, wire_rid: str, out: _Generation) -> None:
        """Send the request, then re-send the rest after every abort; sets `out.stop_reason` when it ends.

        An aborted request waits (polling `pause_poll_interval`) until `paused` is cleared, then is re-sent as
        prompt + tokens so far with the remaining `max_new_tokens` (and `min_new_tokens`) budget; tokens, logprobs
        and versions accumulate. The engine raises `paused` *before* the abort, so an aborted request always sees it
        and waits instead of re-sending to the old weights. An abort nobody asked for is resumed the same way; one
        that keeps coming back with no new token is a server fault and raises after `request_retries` tries.
        Known limit: a stop string split across the interruption point is not detected (the server sees only the new
        text)."""
        g = req.gconfig
        prompt = [int(t) for t in req.input_ids]
        # AReaL's rule: max_tokens bounds prompt + output, so a request generates at most what is left of it.
        budget = min(int(g.max_new_tokens), int(getattr(g, "max_tokens", 1 << 62)) - len(prompt))
        min_new = int(getattr(g, "min_new_tokens", 0))
        idle_aborts, delay = 0, _BACKOFF_START
        while True:
            if not await self._wait_unpaused():
                return  # shut down while paused: return what we have, marked "abort"
            remaining = budget - len(out.tokens)
            if remaining <= 0:
                out.stop_reason = "length"
                return
            sent_version = self._current_version()
            min_left = max(0, min(min_new - len(out.tokens), remaining))
            chunk, lps, finish, message, server_version = await self.generate_once(
                addr, wire_rid, prompt + out.tokens, g, remaining, min_left
            )
            out.tokens += chunk
            out.logprobs += lps
            out.versions += [server_version if server_version is not None else sent_version] * len(chunk)
            if chunk and out.ttft == float("inf"):
                out.ttft = time.perf_counter() - out.start
            if finish in ("stop", "length"):
                out.stop_reason = finish
                return
            if finish != "abort":
                raise EngineError(f"{addr} returned an unknown finish_reason {finish!r}", address=addr)
            # "abort": paused for a weight update; resume with what we have. An abort we did not cause (not paused)
            # that made no progress is a server problem: back off, and give up after request_retries.
            if chunk or self.paused:
                idle_aborts, delay = 0, _BACKOFF_START
                continue
            idle_aborts += 1
            if idle_aborts > self.config.request_retries:
                raise EngineError(
                    f"{addr} aborted the request {idle_aborts} times without generating and without a pause: {message}",
                    address=addr,
                )
            await asyncio.sleep(delay)
            delay = min(2 * delay, _BACKOFF_MAX)

    # -------------------------------------------------------------------------------------------- weights

    def weight_update(self, meta: WeightUpdateMeta, version: int, timeout: float) -> Coroutine[Any, Any, int]:
        """The coroutine that makes every server load `version` as `meta` says; it returns `version`.

        A plain function returning a coroutine, so that a wrong meta raises here, in the caller's thread, before
        anything is scheduled. `timeout` bounds the wait for a disk folder.
        """
        if meta.type == "disk" and meta.use_lora:
            if not meta.lora_name:
                raise ValueError("a LoRA weight update needs WeightUpdateMeta.lora_name (AReaL's rule)")
            return self._update_from_disk(meta.dir_for(version), version, timeout, meta)
        if meta.type == "disk":
            return self._update_from_disk(meta.dir_for(version), version, timeout)
        if meta.is_broadcast:
            return self._update_from_distributed(meta, nccl_specs(meta), version)
        raise ValueError(f"WeightUpdateMeta.type must be 'disk', 'xccl' or 'nccl', got {meta.type!r}")

    async def _update_from_disk(
        self, path: str, version: int, timeout: float, lora: Optional[WeightUpdateMeta] = None
    ) -> int:
        # The trainer renames the folder into place when it is complete, so its existence means "ready".
        deadline = time.monotonic() + timeout
        while not os.path.isdir(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"update_weights: {path} did not appear within {timeout:g}s (version {version})")
            await asyncio.sleep(_FOLDER_POLL)
        load = self.load_lora(path, version, lora) if lora is not None else self.load_from_disk(path, version)
        await _unanswered_means_replaced(load)
        logger.info("servers now hold weights version %d from %s", version, path)
        return version

    async def load_from_disk(self, path: str, version: int) -> None:
        """Every server loads the complete weights folder `path` as `version` (and drops its prefix cache)."""
        body = {"model_path": path, "weight_version": str(version), "abort_all_requests": False, "flush_cache": True}
        answers = await self.post_all("/update_weights_from_disk", body)
        for addr, ans in zip(self.addresses, answers):
            if isinstance(ans, dict) and ans.get("success") is False:
                raise EngineError(f"{addr} failed to load weights from {path}: {ans.get('message')}", 200, addr)

    async def load_lora(self, path: str, version: int, meta: WeightUpdateMeta) -> None:
        """Every server loads the adapter folder `path` as `<lora_name>-v<version>`; then, best effort, unloads the
        version `lora_keep_versions` back (the embedded server holds one adapter: it is gone already)."""
        body = {"lora_name": get_versioned_lora_name(meta.lora_name, version), "lora_path": path}
        answers = await self.post_all(self.LORA_LOAD, body)
        for addr, ans in zip(self.addresses, answers):
            if isinstance(ans, dict) and ans.get("success") is False:
                msg = f"{addr} failed to load LoRA adapter {path}: {ans.get('error_message')}"
                raise EngineError(msg, 200, addr)
        keep = int(meta.lora_keep_versions)
        if keep > 0 and version - keep >= 0:
            stale = {"lora_name": get_versioned_lora_name(meta.lora_name, version - keep)}
            for addr in self.addresses:
                try:
                    await self.request("POST", addr, self.LORA_UNLOAD, stale)
                except EngineError as e:  # AReaL's best_effort: the adapter may be gone already
                    logger.debug("unloading %s on %s: %s", stale["lora_name"], addr, e)

    async def _update_from_distributed(self, meta: WeightUpdateMeta, specs: dict, version: int) -> int:
        if not self._nccl_group_ready:  # the group is made once, then reused by every update
            world = 1 + len(self.addresses)  # rank 0 is the trainer, then one rank per server
            group = {
                "master_address": meta.nccl_master_address,
                "master_port": int(meta.nccl_master_port),
                "world_size": world,
                "group_name": meta.nccl_group_name,
                "backend": "nccl",
            }
            await asyncio.gather(
                *(
                    self.request("POST", addr, "/init_weights_update_group", dict(group, rank_offset=1 + i))
                    for i, addr in enumerate(self.addresses)
                )
            )
            self._nccl_group_ready = True
        body = dict(
            specs,
            group_name=meta.nccl_group_name,
            flush_cache=True,
            abort_all_requests=False,
            weight_version=str(version),
        )
        answers = await self.post_all("/update_weights_from_distributed", body)
        for addr, ans in zip(self.addresses, answers):
            if isinstance(ans, dict) and ans.get("success") is False:
                raise EngineError(f"{addr} failed the NCCL weight update: {ans.get('message')}", 200, addr)
        return version
