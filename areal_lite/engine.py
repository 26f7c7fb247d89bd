"""The rollout side: a client of SGLang-compatible servers and the executor running workflows under a staleness bound.

`RemoteSGLangEngine` is AReaL-lite's inference engine and its workflow executor in one object: `agenerate` talks
to the servers, `submit`/`wait`/`rollout_batch`/`prepare_batch` run episodes, `pause`/`resume`/`update_weights`/
`set_version` are what the trainer calls between steps.

Design decisions
- One background thread owns one asyncio event loop, and every episode and every HTTP request runs on it. Notebook
  cells, scripts and trainers call the synchronous methods (`wait`, `rollout_batch`, `pause`, ...) from their own
  thread; those hand work to the loop with `run_coroutine_threadsafe` and block on the result. Nothing here ever
  calls `asyncio.run`, so it all works under Jupyter's already-running loop.
- `agenerate` is usable from any loop. aiohttp sessions are bound to the loop that made them, so instead of one
  session per caller loop (which cannot be closed cleanly from `destroy()` when that loop is blocked or gone) a call
  from a foreign loop (e.g. a notebook's top-level `await`) is forwarded to the background loop and awaited there
  with `asyncio.wrap_future`. There is exactly one session and one connection pool, closed by `destroy()`;
  cancelling the caller cancels the request.
- The executor is event-driven, not polled: `submit`, a finished episode, `set_version`, `resume` and consuming
  results each schedule a "pump" on the loop, which starts queued episodes while
      capacity = min(max_concurrent_rollouts - running, (eta + v + 1) * B - (accepted + running)) > 0
  (v = current version, B = consumer_batch_size, eta = max_head_offpolicyness; `accepted` counts every accepted
  episode so far, consumed or not). Versions count from v0, the version at which this engine started its first
  episode: 0 in a fresh run, so the rule is AReaL's exactly; an engine made for a run resumed at version k would
  otherwise start (k + 1) * B episodes at once, all k versions stale by the time they are consumed.
  `max_concurrent_rollouts=None` means B, as in AReaL. Episodes of a `rollout_batch` are synchronous: they are
  generated with the current weights and consumed at once, so their staleness is 0 by construction; only the
  concurrency limit applies to them, and they count neither as `accepted` nor as `running` in the bound (AReaL runs
  them through the bound too, so an evaluation larger than (eta + 1) * B can never start). `queue_size`, when set,
  also stops new starts while finished-but-unconsumed results + running episodes reach it (backpressure).
  Callers block on a `threading.Condition` that every state change notifies.
- Results are returned in submission order: `wait(n)` takes the n earliest-submitted accepted episodes, and waits
  for an earlier episode still running rather than pass it. That is what makes the bound a guarantee: an episode
  that started at version v had fewer than (eta + v + 1) * B episodes accepted or running ahead of it, so it is
  consumed by step v + eta at the latest. Taking whatever finished first (AReaL sorts the finished ones by creation
  time, then shuffles) lets a slow episode be passed over step after step and arrive more than eta versions stale.
  `rollout_batch` returns its own episodes in input order, without rejected ones, and never takes results of
  `submit`/`prepare_batch`.
- Fail loudly instead of hanging. A workflow exception is re-raised (same object, so its traceback) in the thread
  that calls `wait`/`rollout_batch`/`prepare_batch`. When nothing can make progress -- nothing running, and the
  queue is empty, or blocked by the staleness bound, or paused -- waiting raises with the reason (typically: call
  `set_version()` after each training step) instead of sleeping forever.
- Interrupt and resume: `pause()` sets the pause flag, then asks every server to abort running requests. An
  aborted request waits (polling `pause_poll_interval`) until `resume()`, then is re-sent as prompt + tokens so far
  with the remaining `max_new_tokens` (and `min_new_tokens`) budget; tokens, logprobs and versions accumulate.
  An abort the engine did not cause (not paused) is resumed the same way; if it keeps coming back with no new
  token, that is a server fault and raises after `request_retries` tries with backoff. Known limit: a stop string
  split across the interruption point is not detected (the server only sees the new text).
- Versions: each output token carries the server's `meta_info.weight_version` when it is an integer, otherwise
  the engine's version *when the chunk was sent*. Weights only change while requests are paused/aborted (or the
  server waits for running requests before loading), so the send-time version is exact; the return-time version
  would race with the trainer's `set_version()` that follows `pause()`.
- `ttft` is approximate: requests are not streamed, so it is the time until the first response that carried at
  least one token. `latency` is wall time including pauses.
- Retries: connection errors and HTTP 5xx are retried with exponential backoff, at most `request_retries` times and
  within `request_timeout` seconds per HTTP call (each resumed chunk gets a fresh budget; time spent paused is not
  counted). HTTP 4xx means the request is wrong: `EngineError` with the server's message, at once.
- `destroy()` never hangs: it asks the servers to abort this engine's requests (they come back with their partial
  output, `stop_reason="abort"` -- the only way to get that stop reason), cancels the episodes, closes the session
  and joins the thread, each step with a time limit. The servers themselves are left running and unpaused.
- rid affinity: requests with the same `rid` go to the same server (its prefix cache holds the conversation);
  new rids are spread round-robin. If a rid is already in flight (a group of samples sharing one request object),
  the wire rid gets a unique suffix so the server never sees duplicates.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import itertools
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence

import aiohttp
import torch

from .config import InferenceEngineConfig, sampling_params
from .io_struct import ModelRequest, ModelResponse, WeightUpdateMeta

__all__ = ["RemoteSGLangEngine", "EngineError", "ADDRS_ENV"]

logger = logging.getLogger("areal_lite.engine")

ADDRS_ENV = "AREAL_LLM_SERVER_ADDRS"
_RID_CACHE = 4096  # rids remembered for server affinity (oldest forgotten first)
_BACKOFF_START, _BACKOFF_MAX = 0.1, 5.0  # seconds between retries of a failed request
_SHUTDOWN_TIMEOUT = 10.0  # seconds destroy() waits for cancelled episodes and the loop thread
_ABORT_GRACE = 2.0  # seconds destroy() gives aborted requests to come back with their partial output


class EngineError(RuntimeError):
    """A server refused or failed a request. `status` is the HTTP status (None: no answer), `address` the server."""

    def __init__(self, message: str, status: Optional[int] = None, address: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.address = address


# ------------------------------------------------------------------------------------------------ small helpers


def _import_from_string(path: str) -> Any:
    """`pkg.module.Name` or `pkg.module:Name` -> the object (AReaL accepts workflows named this way)."""
    import importlib

    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not name:
        raise ValueError(f"cannot import {path!r}: write 'package.module.Name'")
    return getattr(importlib.import_module(module), name)


def _parse_addrs(addr: Any) -> List[str]:
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


def _looks_like_addrs(value: Any) -> bool:
    """A server address ("host:port") or a list of them, passed where AReaL expects an engine id."""
    if isinstance(value, (list, tuple)):
        return bool(value)
    return isinstance(value, str) and value.rsplit(":", 1)[-1].isdigit() and ":" in value


def _rows_of(batch: Any) -> List[Any]:
    """A dataloader batch must be a list of rows (areal_lite.data collates that way)."""
    if isinstance(batch, (list, tuple)):
        return list(batch)
    raise TypeError(
        f"prepare_batch: the dataloader yielded a {type(batch).__name__}; it must yield lists of rows "
        "(use areal_lite.data.make_dataloader or collate_fn=lambda rows: rows)"
    )


def _check_result(result: Any, workflow: Any) -> Optional[Dict[str, torch.Tensor]]:
    """The workflow contract: None (rejected) or a dict of tensors with a 2-D `input_ids`."""
    name = type(workflow).__name__
    if result is None:
        return None
    if not isinstance(result, dict):
        raise TypeError(f"{name}.arun_episode returned {type(result).__name__}; expected dict[str, Tensor] or None")
    bad = [k for k, v in result.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"{name}.arun_episode returned non-tensor values for keys {bad}")
    ids = result.get("input_ids")
    if ids is None or ids.dim() != 2:
        raise TypeError(f"{name}.arun_episode must return 'input_ids' of shape [rows, length]; got keys {list(result)}")
    return result


@dataclasses.dataclass(eq=False)
class _Batch:
    """The collector of one `rollout_batch` call."""

    size: int
    results: Dict[int, Optional[dict]] = dataclasses.field(default_factory=dict)
    error: Optional[BaseException] = None


@dataclasses.dataclass(eq=False)
class _Episode:
    seq: int  # submission order; "oldest" means smallest seq
    data: Any
    workflow: Any
    should_accept: Optional[Callable[[dict], bool]]
    batch: Optional[_Batch] = None
    index: int = 0  # position in its rollout_batch
    task: Optional[asyncio.Task] = None
    start_version: Optional[int] = None


# ------------------------------------------------------------------------------------------------ the engine


class RemoteSGLangEngine:
    """Client of one or more SGLang-compatible servers and the rollout executor (see the module docstring)."""

    def __init__(self, config: InferenceEngineConfig):
        if config.consumer_batch_size < 1:
            raise ValueError(f"consumer_batch_size must be >= 1, got {config.consumer_batch_size}")
        if config.max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0, got {config.max_head_offpolicyness}")
        if config.max_concurrent_rollouts is not None and config.max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1 or None, got {config.max_concurrent_rollouts}")
        if config.queue_size is not None and config.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1 or None, got {config.queue_size}")
        self.config = config
        self.addresses: List[str] = []
        self.engine_id: Optional[str] = None
        self.max_concurrent_rollouts = config.max_concurrent_rollouts or config.consumer_batch_size
        self.consumer_batch_size = config.consumer_batch_size
        self.max_head_offpolicyness = config.max_head_offpolicyness

        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._initialized = False
        self._closing = False  # destroy() started: stop starting things, let waiters fail
        self._destroyed = False

        # Executor state; every field below is guarded by self._cond.
        self._cond = threading.Condition()
        self._version = 0
        self._paused = False
        self._seq = itertools.count()
        self._pending: Deque[_Episode] = collections.deque()
        self._running: Dict[int, _Episode] = {}
        self._ready: Dict[int, dict] = {}  # finished, accepted, not yet taken by wait(): seq -> result
        self._errors: List[tuple] = []  # (seq, exception, episode) of failed submit()/prepare_batch() episodes
        self._counts = collections.Counter()  # accepted, rejected, failed, cancelled, consumed
        self._start_versions: List[int] = []
        self._base_version: Optional[int] = None  # v0: the version when the first episode started

        # Loop-thread-only state.
        self._rid_to_addr: "collections.OrderedDict[str, str]" = collections.OrderedDict()
        self._rr = 0
        self._inflight: Dict[str, str] = {}  # wire rid -> server, for agenerate calls in progress
        self._nccl_group_ready = False

        # prepare_batch's persistent data iterator.
        self._data_source: Any = None
        self._data_iter: Optional[Iterator] = None
        self.data_epoch = 0

    # -------------------------------------------------------------------------------------------- lifecycle

    def initialize(
        self, engine_id: Optional[str] = None, addr: Any = None, train_data_parallel_size: Optional[int] = None
    ) -> "RemoteSGLangEngine":
        """Start the background loop and wait (up to `setup_timeout`) until every server answers GET /health.

        AReaL 1.0.4's order: the first parameter is an engine id, so pass servers by keyword:
        `engine.initialize(addr=server.address)`. Without `addr`, `AREAL_LLM_SERVER_ADDRS` is read.
        `train_data_parallel_size` is AReaL's (it splits rollouts among trainer ranks); the kit's one client ignores it.
        """
        if addr is None and _looks_like_addrs(engine_id):
            raise TypeError(
                f"initialize({engine_id!r}): the first argument is engine_id (AReaL's order), not the server; "
                "write engine.initialize(addr=...) — the same call works in AReaL"
            )
        if self._initialized or self._destroyed:
            raise RuntimeError("initialize() may be called once per engine (make a new engine after destroy())")
        self.engine_id = engine_id or uuid.uuid4().hex
        self.addresses = _parse_addrs(addr)
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, args=(started,), name="areal-lite-rollout", daemon=True)
        self._thread.start()
        started.wait()
        self._initialized = True
        try:
            self._run_sync(self._setup(), timeout=None)
        except BaseException:
            self.destroy()
            raise
        return self

    def _run_loop(self, started: threading.Event) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(started.set)
        self._loop.run_forever()

    async def _setup(self) -> None:
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

    def destroy(self) -> None:
        """Abort this engine's requests, cancel running episodes, close the session, stop the loop thread.
        Safe to call twice; the servers keep running."""
        loop, thread = self._loop, self._thread
        if thread is not None and threading.current_thread() is thread:
            raise RuntimeError("destroy() cannot be called from inside a workflow (the rollout loop itself)")
        with self._cond:
            if self._destroyed:
                return
            self._destroyed = True
            self._closing = True
            self._cond.notify_all()
        if loop is None or thread is None:
            return
        if thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            try:
                fut.result(timeout=_SHUTDOWN_TIMEOUT + 5)
            except Exception as e:  # keep tearing down: a failing cleanup must not leave the thread behind
                logger.warning("engine shutdown: %s: %s", type(e).__name__, e)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=_SHUTDOWN_TIMEOUT)
        if thread.is_alive():
            logger.warning("rollout thread did not stop within %.0fs", _SHUTDOWN_TIMEOUT)
        else:
            loop.close()

    async def _shutdown(self) -> None:
        # First ask the servers to abort our requests: they come back with their tokens so far and, since we are
        # closing, agenerate returns them marked "abort" instead of resending. Whatever is left is then cancelled.
        if self._inflight and self._session is not None:
            aborts = [self._abort_on_server(addr, rid) for rid, addr in list(self._inflight.items())]
            await asyncio.gather(*aborts, return_exceptions=True)
            deadline = time.monotonic() + _ABORT_GRACE
            while self._inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_SHUTDOWN_TIMEOUT)
        if self._session is not None:
            await self._session.close()
        await self._loop.shutdown_default_executor()  # DNS threads of "localhost"-style addresses

    async def _abort_on_server(self, addr: str, rid: str) -> None:
        # One short attempt, no retries: the server may be the reason we are shutting down.
        timeout = aiohttp.ClientTimeout(total=_ABORT_GRACE)
        async with self._session.post(f"http://{addr}/abort_request", json={"rid": rid}, timeout=timeout) as resp:
            await resp.read()

    def __enter__(self) -> "RemoteSGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _require_running(self) -> None:
        if self._destroyed:
            raise RuntimeError("the engine was destroyed; create a new RemoteSGLangEngine")
        if not self._initialized:
            raise RuntimeError("call engine.initialize(addr=...) first")

    def _run_sync(self, coro, timeout: Optional[float]):
        """Run `coro` on the background loop and block this thread until it is done."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "this blocking method cannot be called from inside a workflow (it would deadlock the rollout loop)"
            )
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    # -------------------------------------------------------------------------------------------- versions, pause

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """The policy version of the weights the servers hold (the trainer calls it after each weight update)."""
        with self._cond:
            self._version = int(version)
            self._cond.notify_all()
        self._schedule_pump()

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Stop starting episodes and requests, and abort the requests running on the servers (they resume later)."""
        self._require_running()
        with self._cond:
            # Set before the servers abort, so an aborted request sees the flag and waits instead of re-sending.
            self._paused = True
            self._cond.notify_all()
        self._run_sync(self._post_all("/pause_generation", {"mode": "abort"}), timeout=None)

    def resume(self) -> None:
        """Let the servers continue, then release the waiting requests and start queued episodes."""
        self._require_running()
        self._run_sync(self._post_all("/continue_generation", {}), timeout=None)
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        self._schedule_pump()

    async def _post_all(self, endpoint: str, body: dict) -> List[Any]:
        return list(await asyncio.gather(*(self._request("POST", a, endpoint, body) for a in self.addresses)))

    # -------------------------------------------------------------------------------------------- HTTP

    async def _request(self, method: str, addr: str, endpoint: str, body: Optional[dict] = None) -> Any:
        """One HTTP call with retries on connection errors and 5xx; 4xx raises EngineError at once."""
        budget, retries = self.config.request_timeout, max(0, self.config.request_retries)
        deadline = time.monotonic() + budget
        delay, last, attempts = _BACKOFF_START, "no attempt made", 0
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
            else:
                if status < 400:
                    return _decode_body(raw)
                msg = _error_message(raw)
                if status < 500:
                    raise EngineError(f"{url} rejected the request (HTTP {status}): {msg}", status, addr)
                last = f"HTTP {status}: {msg}"
            if attempt < retries:
                await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(2 * delay, _BACKOFF_MAX)
        raise EngineError(f"{method} {url} failed after {attempts} attempt(s) within {budget:g}s: {last}", address=addr)

    def _choose_server(self, rid: str) -> str:
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

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one request (n_samples must be 1), resuming across pauses. Usable from any event loop."""
        self._require_running()
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
                f"the prompt has {len(req.input_ids)} tokens: gconfig.max_tokens={max_tokens} "
                "leaves no room to generate"
            )
        if asyncio.get_running_loop() is self._loop:
            return await self._agenerate(req)
        # A foreign loop (a notebook cell, a test's asyncio.run): the HTTP session lives on the background loop.
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._agenerate(req), self._loop))

    async def _wait_unpaused(self) -> bool:
        """Sleep while paused; False if the engine is being destroyed."""
        while self._paused and not self._closing:
            await asyncio.sleep(self.config.pause_poll_interval)
        return not self._closing

    async def _agenerate(self, req: ModelRequest) -> ModelResponse:
        g = req.gconfig
        prompt = [int(t) for t in req.input_ids]
        # AReaL's rule: max_tokens bounds prompt + output, so a request generates at most what is left of it.
        budget = min(int(g.max_new_tokens), int(getattr(g, "max_tokens", 1 << 62)) - len(prompt))
        min_new = int(getattr(g, "min_new_tokens", 0))
        addr = self._choose_server(req.rid)
        wire_rid = req.rid if req.rid not in self._inflight else f"{req.rid}-{uuid.uuid4().hex[:8]}"
        self._inflight[wire_rid] = addr
        tokens: List[int] = []
        logprobs: List[float] = []
        versions: List[int] = []
        start = time.perf_counter()
        ttft = float("inf")
        stop_reason = "abort"
        idle_aborts, delay = 0, _BACKOFF_START
        try:
            while True:
                if not await self._wait_unpaused():
                    break  # destroyed while paused: return what we have, marked "abort"
                remaining = budget - len(tokens)
                if remaining <= 0:
                    stop_reason = "length"
                    break
                params = sampling_params(g, max_new_tokens=remaining)
                params["min_new_tokens"] = max(0, min(min_new - len(tokens), remaining))
                payload = {
                    "input_ids": prompt + tokens,
                    "sampling_params": params,
                    "return_logprob": True,
                    "rid": wire_rid,
                    "stream": False,
                }
                sent_version = self._version
                result = await self._request("POST", addr, "/generate", payload)
                chunk, lps, finish, message, server_version = self._parse_generate(result, addr)
                version = server_version if server_version is not None else sent_version
                tokens += chunk
                logprobs += lps
                versions += [version] * len(chunk)
                if chunk and ttft == float("inf"):
                    ttft = time.perf_counter() - start
                if finish in ("stop", "length"):
                    stop_reason = finish
                    break
                if finish != "abort":
                    raise EngineError(f"{addr} returned an unknown finish_reason {finish!r}", address=addr)
                # "abort": paused for a weight update; resume with what we have. An abort we did not cause (not
                # paused) that made no progress is a server problem: back off, and give up after request_retries.
                if chunk or self._paused:
                    idle_aborts, delay = 0, _BACKOFF_START
                    continue
                idle_aborts += 1
                if idle_aborts > self.config.request_retries:
                    raise EngineError(
                        f"{addr} aborted the request {idle_aborts} times without generating and without a pause: "
                        f"{message}",
                        address=addr,
                    )
                await asyncio.sleep(delay)
                delay = min(2 * delay, _BACKOFF_MAX)
        except asyncio.CancelledError:
            if not self._closing:
                raise
            # destroy() cancelled us: hand back the partial response instead of an exception in the caller.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        finally:
            self._inflight.pop(wire_rid, None)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=stop_reason,
            tokenizer=getattr(req, "tokenizer", None),
            latency=time.perf_counter() - start,
            ttft=ttft,
            rid=req.rid,
        )

    @staticmethod
    def _parse_generate(result: Any, addr: str):
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

    # -------------------------------------------------------------------------------------------- weights

    def update_weights(self, meta: WeightUpdateMeta, timeout: Optional[float] = None) -> Future:
        """Make the servers load version k = get_version() + 1. Returns a Future that yields k.

        Disk: waits until `meta.dir_for(k)` exists (the trainer renames it into place when complete), then POSTs
        /update_weights_from_disk to every server. NCCL: /init_weights_update_group once, then
        /update_weights_from_distributed (GPU only). Call it between `pause()` and `resume()`; `set_version(k)`
        after the future is done. `timeout` (default `request_timeout`) bounds the wait for the folder.
        """
        self._require_running()
        k = self.get_version() + 1 if meta.version is None else meta.version
        timeout = self.config.request_timeout if timeout is None else timeout
        if meta.type == "disk":
            coro = self._update_from_disk(meta.dir_for(k), k, timeout)
        elif meta.is_broadcast:
            coro = self._update_from_distributed(meta, _nccl_specs(meta), k)
        else:
            raise ValueError(f"WeightUpdateMeta.type must be 'disk', 'xccl' or 'nccl', got {meta.type!r}")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future:
        """AReaL's name for a disk `update_weights`: a Future that is done when every server loaded the version.

        With a versioned meta (`meta.with_version(k)`, AReaL's way) the servers load `meta.path`; otherwise version
        `get_version() + 1`.
        """
        if meta.type != "disk":
            raise ValueError(f"update_weights_from_disk needs a disk meta, got type {meta.type!r}")
        return self.update_weights(meta)

    async def _update_from_disk(self, path: str, version: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while not os.path.isdir(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"update_weights: {path} did not appear within {timeout:g}s (version {version})")
            await asyncio.sleep(max(0.01, self.config.pause_poll_interval))
        body = {"model_path": path, "weight_version": str(version), "abort_all_requests": False, "flush_cache": True}
        answers = await self._post_all("/update_weights_from_disk", body)
        for addr, ans in zip(self.addresses, answers):
            if isinstance(ans, dict) and ans.get("success") is False:
                raise EngineError(f"{addr} failed to load weights from {path}: {ans.get('message')}", address=addr)
        logger.info("servers now hold weights version %d from %s", version, path)
        return version

    async def _update_from_distributed(self, meta: WeightUpdateMeta, specs: dict, version: int) -> int:
        tp = int(getattr(meta, "tp_size", 1) or 1)
        if not self._nccl_group_ready:
            world = 1 + tp * len(self.addresses)  # rank 0 is the trainer
            await asyncio.gather(
                *(
                    self._request(
                        "POST",
                        addr,
                        "/init_weights_update_group",
                        {
                            "master_address": meta.nccl_master_address,
                            "master_port": int(meta.nccl_master_port),
                            "rank_offset": 1 + i * tp,
                            "world_size": world,
                            "group_name": meta.nccl_group_name,
                            "backend": "nccl",
                        },
                    )
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
        answers = await self._post_all("/update_weights_from_distributed", body)
        for addr, ans in zip(self.addresses, answers):
            if isinstance(ans, dict) and ans.get("success") is False:
                raise EngineError(f"{addr} failed the NCCL weight update: {ans.get('message')}", address=addr)
        return version

    # -------------------------------------------------------------------------------------------- executor

    def _async_running_locked(self) -> int:
        return sum(1 for ep in self._running.values() if ep.batch is None)

    def _capacity_locked(self) -> int:
        """How many more *asynchronous* episodes (submit/prepare_batch) may start now."""
        running = len(self._running)
        cap = min(self.max_concurrent_rollouts - running, self._headroom_locked())
        if self.config.queue_size is not None:
            cap = min(cap, self.config.queue_size - (len(self._ready) + running))
        return cap

    def _bound_locked(self) -> int:
        """(eta + v - v0 + 1) * B: how many episodes may have been accepted or be running by version v."""
        v0 = self._version if self._base_version is None else self._base_version
        return (self.max_head_offpolicyness + self._version - v0 + 1) * self.consumer_batch_size

    def _headroom_locked(self) -> int:
        """Episodes the staleness bound still allows to start at the current version."""
        return self._bound_locked() - (self._counts["accepted"] + self._async_running_locked())

    def _bound_text_locked(self) -> str:
        eta, v, B = self.max_head_offpolicyness, self._version, self.consumer_batch_size
        v0 = self._version if self._base_version is None else self._base_version
        return f"(eta + v - v0 + 1) * B = ({eta} + {v} - {v0} + 1) * {B} = {self._bound_locked()}"

    def _schedule_pump(self) -> None:
        loop = self._loop
        if loop is None or self._closing or loop.is_closed():
            return
        if threading.current_thread() is self._thread:
            self._pump()
        else:
            try:
                loop.call_soon_threadsafe(self._pump)
            except RuntimeError:  # loop closed between the check and the call (destroy racing)
                pass

    def _pump(self) -> None:
        """Start queued episodes while the capacity rule allows (runs on the loop thread)."""
        with self._cond:
            started = False
            if self._paused or self._closing:
                return
            waiting = collections.deque()
            while self._pending and len(self._running) < self.max_concurrent_rollouts:
                ep = self._pending.popleft()
                if ep.batch is None:
                    if self._capacity_locked() <= 0:
                        waiting.append(ep)  # held by the staleness bound; synchronous episodes may still pass
                        continue
                    if self._base_version is None:
                        self._base_version = self._version
                    self._start_versions.append(self._version)
                ep.start_version = self._version
                self._running[ep.seq] = ep
                ep.task = self._loop.create_task(self._run_episode(ep), name=f"episode-{ep.seq}")
                started = True
            waiting.extend(self._pending)
            self._pending = waiting
            if started:
                self._cond.notify_all()

    async def _run_episode(self, ep: _Episode) -> None:
        status, payload = "failed", None
        try:
            result = _check_result(await ep.workflow.arun_episode(self, ep.data), ep.workflow)
            if result is None or (ep.should_accept is not None and not ep.should_accept(result)):
                status = "rejected"
            else:
                status, payload = "accepted", result
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception as e:
            status, payload = "failed", e
            if hasattr(e, "add_note"):
                e.add_note(
                    f"(raised by {type(ep.workflow).__name__}.arun_episode on the rollout thread, "
                    f"episode {ep.seq}, data {str(ep.data)[:200]})"
                )
        finally:
            if status == "failed" and payload is None:  # a BaseException such as KeyboardInterrupt
                payload = RuntimeError(f"episode {ep.seq} stopped abnormally")
            self._finish(ep, status, payload)
            self._pump()

    def _finish(self, ep: _Episode, status: str, payload: Any) -> None:
        with self._cond:
            self._running.pop(ep.seq, None)
            # synchronous (rollout_batch) episodes are tallied apart: they are not part of the staleness bound
            self._counts[status if ep.batch is None or status != "accepted" else "sync_accepted"] += 1
            if ep.batch is not None:
                if status == "failed" and ep.batch.error is None:
                    ep.batch.error = payload
                ep.batch.results[ep.index] = payload if status == "accepted" else None
            elif status == "accepted":
                self._ready[ep.seq] = payload
            elif status == "failed":
                self._errors.append((ep.seq, payload, ep))
            self._cond.notify_all()

    def _resolve_workflow(self, workflow: Any, workflow_kwargs: Optional[dict], group_size: int) -> Any:
        """AReaL's forms: a workflow instance, a workflow class + `workflow_kwargs`, or an import path string
        ("pkg.module.Name" or "pkg.module:Name"); `group_size > 1` runs it that many times per data row."""
        if isinstance(workflow, str):
            workflow = _import_from_string(workflow)
        if isinstance(workflow, type):
            if workflow_kwargs is None:
                raise ValueError(f"workflow_kwargs is required when workflow is a class ({workflow.__name__})")
            workflow = workflow(**workflow_kwargs)
        elif workflow_kwargs is not None:
            logger.warning("workflow_kwargs is ignored when workflow is already an instance")
        fn = getattr(workflow, "arun_episode", None)
        if fn is None or not inspect.iscoroutinefunction(fn):
            raise TypeError(
                f"workflow must be an object with `async def arun_episode(self, engine, data)`; got {workflow!r}"
            )
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        if group_size > 1:
            from .workflow import GroupedWorkflow  # the workflow module never imports the engine: no cycle

            # AReaL's rule: group_size decides, whatever the workflow's gconfig.n_samples says
            workflow = GroupedWorkflow(workflow, group_size=group_size, check_n_samples=False)
        return workflow

    def _enqueue_locked(self, data: Any, workflow: Any, should_accept, batch=None, index=0) -> _Episode:
        ep = _Episode(next(self._seq), data, workflow, should_accept, batch, index)
        self._pending.append(ep)
        return ep

    def submit(
        self,
        data: Any,
        workflow: Any,
        workflow_kwargs: Optional[dict] = None,
        should_accept_fn: Optional[Callable[[dict], bool]] = None,
        group_size: int = 1,
        task_id: Optional[int] = None,
        callback_addr: Optional[str] = None,
        is_eval: bool = False,
        proxy_addr: Optional[str] = None,
    ) -> int:
        """Queue one episode (a group of `group_size` rows); it starts when the capacity rule allows. Returns its
        task id. Collect results with `wait`. (`task_id`, `callback_addr`, `is_eval` and `proxy_addr` are AReaL's
        distributed-controller options: the kit assigns ids itself and refuses the other two.)"""
        self._require_running()
        if callback_addr is not None or proxy_addr is not None:
            raise NotImplementedError("callback_addr/proxy_addr belong to AReaL's distributed controller")
        workflow = self._resolve_workflow(workflow, workflow_kwargs, group_size)
        with self._cond:
            ep = self._enqueue_locked(data, workflow, should_accept_fn)
        self._schedule_pump()
        return ep.seq

    def wait(self, count: int, timeout: Optional[float] = None, raise_timeout: bool = True) -> List[dict]:
        """The `count` earliest-submitted accepted episodes, once no episode submitted before them is still running
        (see the module docstring: this keeps staleness within eta). A list of trajectory dicts, as AReaL's.

        Raises a workflow's exception, TimeoutError (with counts) after `timeout` seconds (or returns [] when
        `raise_timeout=False`), or RuntimeError when the results can never come (nothing running and the queue
        empty, paused, or held by the staleness bound).
        """
        self._require_running()
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count == 0:
            return []
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                results = self._take_locked(count)
                if results is not None:
                    break
                self._raise_if_stuck_locked(count, "wait")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if not raise_timeout:
                        return []
                    raise TimeoutError(f"wait({count}) timed out after {timeout:g}s: {self._describe_locked()}")
                self._cond.wait(remaining)
        self._schedule_pump()  # consuming may lift the queue_size backpressure
        return results

    def _take_locked(self, count: int) -> Optional[List[dict]]:
        if self._errors:
            self._errors.sort(key=lambda item: item[0])
            _, exc, _ = self._errors.pop(0)
            raise exc
        if self._closing:
            raise RuntimeError("the engine was destroyed while waiting for rollouts")
        if len(self._ready) < count:
            return None
        seqs = sorted(self._ready)[:count]
        if self._blocking_locked(seqs[-1]):
            return None  # an earlier episode may still be accepted: it goes first
        self._counts["consumed"] += count
        return [self._ready.pop(s) for s in seqs]

    def _blocking_locked(self, last_seq: int) -> bool:
        """Whether an asynchronous episode submitted before `last_seq` is still running."""
        return any(ep.batch is None and seq < last_seq for seq, ep in self._running.items())

    def _describe_locked(self) -> str:
        c = self._counts
        return (
            f"ready {len(self._ready)}, running {len(self._running)}, queued {len(self._pending)}, "
            f"accepted {c['accepted']}, rejected {c['rejected']}, failed {c['failed']}, version {self._version}"
        )

    def _raise_if_stuck_locked(self, count: int, who: str) -> None:
        """Raise if no event can ever produce the missing results (only another thread could unblock us)."""
        if self._paused and len(self._ready) >= count:
            raise RuntimeError(
                f"{who}({count}) cannot finish: the engine is paused: call engine.resume() (earlier episodes still "
                f"running must finish first). State: {self._describe_locked()}"
            )
        if self._running:
            return
        why = None
        if not self._pending:
            why = "nothing is running or queued (rejected episodes do not count; submit more)"
        elif self._paused:
            why = "the engine is paused: call engine.resume()"
        elif self._headroom_locked() <= 0:
            why = (
                f"the staleness bound is reached: {self._bound_text_locked()} episodes may start by version "
                f"{self._version}, and {self._counts['accepted']} were accepted. "
                "Call engine.set_version(v + 1) after each training step (or raise max_head_offpolicyness)"
            )
        elif self.config.queue_size is not None and self._capacity_locked() <= 0:
            why = f"queue_size={self.config.queue_size} is smaller than the {count} results asked for"
        if why is not None:
            raise RuntimeError(f"{who}({count}) cannot finish: {why}. State: {self._describe_locked()}")

    def rollout_batch(
        self,
        data: Sequence[Any],
        workflow: Any,
        workflow_kwargs: Optional[dict] = None,
        group_size: int = 1,
        *,
        should_accept_fn: Optional[Callable[[dict], bool]] = None,
        timeout: Optional[float] = None,
    ) -> List[dict]:
        """Run one episode (a group of `group_size` rows) per data row and wait for all of them (synchronous RL).

        Returns a list of trajectory dicts in input order, rejected episodes left out (AReaL's return type; join
        them with `concat_padded_tensors`). The first workflow exception cancels the rest of the batch and is raised
        here -- AReaL 1.0.4 logs it and returns an empty list. The staleness bound does not apply: every episode
        runs on the current weights, so evaluation at a fixed version returns -- AReaL 1.0.4 blocks forever there
        once (1 + eta) * B episodes have started at one version.
        """
        self._require_running()
        workflow = self._resolve_workflow(workflow, workflow_kwargs, group_size)
        rows = list(data)
        if not rows:
            return []
        batch = _Batch(size=len(rows))
        with self._cond:
            for i, row in enumerate(rows):
                self._enqueue_locked(row, workflow, should_accept_fn, batch, i)
        self._schedule_pump()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            with self._cond:
                while len(batch.results) < batch.size and batch.error is None:
                    if self._closing:
                        raise RuntimeError("the engine was destroyed during rollout_batch")
                    if self._paused and not self._running:
                        raise RuntimeError("rollout_batch cannot finish: the engine is paused; call engine.resume()")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"rollout_batch timed out after {timeout:g}s with {len(batch.results)} of "
                            f"{batch.size} episodes finished: {self._describe_locked()}"
                        )
                    self._cond.wait(remaining)
                if batch.error is not None:
                    raise batch.error
                self._counts["consumed"] += sum(r is not None for r in batch.results.values())
        except BaseException:
            self._cancel_batch(batch)
            raise
        return [batch.results[i] for i in range(batch.size) if batch.results[i] is not None]

    def _cancel_batch(self, batch: _Batch) -> None:
        """Drop a failed/abandoned rollout_batch: unqueue its episodes and cancel its running ones."""
        with self._cond:
            self._pending = collections.deque(ep for ep in self._pending if ep.batch is not batch)
            tasks = [ep.task for ep in self._running.values() if ep.batch is batch and ep.task is not None]
        if tasks and self._loop is not None and not self._loop.is_closed():
            for t in tasks:
                self._loop.call_soon_threadsafe(t.cancel)

    def prepare_batch(
        self,
        dataloader: Iterable,
        workflow: Any,
        workflow_kwargs: Optional[dict] = None,
        should_accept_fn: Optional[Callable[[dict], bool]] = None,
        group_size: int = 1,
        dynamic_bs: bool = False,
        *,
        timeout: Optional[float] = None,
    ) -> List[dict]:
        """Asynchronous RL: keep the pipeline fed from `dataloader` and return the `consumer_batch_size`
        earliest-submitted accepted episodes (as `wait`), a list of trajectory dicts. The data iterator persists
        across calls (a new epoch starts when one ends).

        The queue is topped up to min(staleness headroom, max_concurrent_rollouts) + B rows: enough to refill every
        free slot while the trainer is busy, plus one batch to start the moment `set_version()` raises the bound.
        `dynamic_bs` (AReaL: return what is ready instead of exactly B) is not supported and raises.
        """
        self._require_running()
        if dynamic_bs:
            raise NotImplementedError("dynamic_bs=True is not supported by the kit's engine")
        workflow = self._resolve_workflow(workflow, workflow_kwargs, group_size)
        B = self.consumer_batch_size
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._top_up(dataloader, workflow, should_accept_fn)
            with self._cond:
                while True:
                    results = self._take_locked(B)
                    if results is not None:
                        break
                    if len(self._pending) < self._top_up_target_locked():
                        break  # a rejection freed room: draw more data first
                    self._raise_if_stuck_locked(B, "prepare_batch")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"prepare_batch timed out after {timeout:g}s: {self._describe_locked()}")
                    self._cond.wait(remaining)
            if results is not None:
                self._schedule_pump()
                return results

    def _top_up_target_locked(self) -> int:
        return min(max(self._headroom_locked(), 0), self.max_concurrent_rollouts) + self.consumer_batch_size

    def _top_up(self, dataloader: Iterable, workflow: Any, should_accept) -> None:
        while True:
            with self._cond:
                if len(self._pending) >= self._top_up_target_locked():
                    break
            rows = _rows_of(self._next_batch(dataloader))  # outside the lock: loading data may be slow
            with self._cond:
                for row in rows:
                    self._enqueue_locked(row, workflow, should_accept)
            self._schedule_pump()

    def _next_batch(self, dataloader: Iterable) -> Any:
        if self._data_source is not dataloader or self._data_iter is None:
            self._data_source, self._data_iter, self.data_epoch = dataloader, iter(dataloader), 0
        try:
            return next(self._data_iter)
        except StopIteration:
            self._data_iter = iter(dataloader)
            self.data_epoch += 1
            try:
                return next(self._data_iter)
            except StopIteration:
                raise ValueError("prepare_batch: the dataloader yields no batches") from None

    # -------------------------------------------------------------------------------------------- introspection

    def stats(self) -> Dict[str, Any]:
        """Counters of the executor (a snapshot)."""
        with self._cond:
            c = self._counts
            return {
                "version": self._version,
                "base_version": self._base_version,
                "paused": self._paused,
                "queued": len(self._pending),
                "running": len(self._running),
                "ready": len(self._ready),
                "started": len(self._start_versions),
                "accepted": c["accepted"],
                "sync_accepted": c["sync_accepted"],
                "rejected": c["rejected"],
                "failed": c["failed"],
                "cancelled": c["cancelled"],
                "consumed": c["consumed"],
                "capacity": self._capacity_locked(),
            }

    def start_versions(self) -> List[int]:
        """The engine version at the start of every episode started so far, in start order."""
        with self._cond:
            return list(self._start_versions)


def _nccl_specs(meta: WeightUpdateMeta) -> dict:
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
        "WeightUpdateMeta.from_disk(path)."
    )
