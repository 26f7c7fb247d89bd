"""The rollout side: `RemoteSGLangEngine`, AReaL-lite's inference engine and workflow executor behind one object.

`agenerate` talks to the servers, `submit`/`wait`/`rollout_batch`/`prepare_batch` run episodes, `pause`/`resume`/
`update_weights`/`set_version` are what the trainer calls between steps, and `explain()` says in words what the
staleness bound allows right now.

Design decisions
- Three jobs, three modules, one facade: `infra.remote_inf_engine` talks HTTP, `infra.workflow_executor` runs
  episodes under the staleness bound, and this module owns what they share (the background thread and its loop)
  and keeps AReaL 1.0.4's public API in one class, so a notebook cell moves between the two projects unchanged.
- One background thread owns one asyncio event loop; every episode and HTTP request runs on it. Synchronous methods
  hand work to it (`run_coroutine_threadsafe`) and block; nothing calls `asyncio.run`, so it works under Jupyter's
  running loop. `agenerate` also works from a foreign loop (a notebook's top-level `await`): it is forwarded.
- Pausing raises the executor's and client's flags before the servers abort requests; resuming lowers them after.
- One facade, two wire protocols: `initialize` asks the servers (`GET /v1/models`) and switches to
  `engine.vllm_client.VLLMClient` when they are vLLM, so a notebook written for `RemoteSGLangEngine` runs on
  `backend=vllm` (AReaL's would fail there). `RemotevLLMEngine` (AReaL's name) always speaks vLLM.
- `destroy()` never hangs: the servers abort this engine's requests, episodes are cancelled, the session closed and
  the thread joined, each with a time limit; the servers run on, unpaused. An engine dropped undestroyed (a cell run
  again) closes its session and thread when collected (`utils.loop_thread`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import uuid
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from areal_lite.api.cli_args import InferenceEngineConfig
from areal_lite.api.engine_api import InferenceEngine
from areal_lite.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta
from areal_lite.engine.vllm_client import VLLMClient, is_vllm
from areal_lite.infra.remote_inf_engine import (
    ADDRS_ENV,
    EngineError,
    SGLangClient,
    check_request,
    looks_like_addrs,
    parse_addrs,
)
from areal_lite.infra.staleness_manager import StalenessManager
from areal_lite.infra.workflow_executor import WorkflowExecutor
from areal_lite.utils.loop_thread import LoopThread

__all__ = ["RemoteSGLangEngine", "EngineError", "ADDRS_ENV"]

logger = logging.getLogger("areal_lite.engine")

_SHUTDOWN_TIMEOUT = 10.0  # seconds destroy() waits for cancelled episodes and the loop thread


async def _close_clients(clients: list) -> None:
    for client in clients:
        await client.close()


def _version_reader(engine: "RemoteSGLangEngine") -> Callable[[], int]:
    """`engine.get_version` through a weak reference: the client must not keep its engine alive (`LoopThread`)."""
    ref = weakref.ref(engine)

    def version() -> int:
        alive = ref()
        return alive.get_version() if alive is not None else -1

    return version


class RemoteSGLangEngine(InferenceEngine):
    """Client of one or more SGLang-compatible servers and the rollout executor (see the module docstring).
    Given vLLM servers, it speaks vLLM's protocol instead (as `RemotevLLMEngine`)."""

    _CLIENT: Optional[type] = None  # None: SGLang's protocol unless the servers answer as vLLM

    def __init__(self, config: InferenceEngineConfig):
        self.config = config
        self.engine_id: Optional[str] = None
        self._executor = WorkflowExecutor(StalenessManager.from_config(config), engine=self)
        self._client = (self._CLIENT or SGLangClient)(config, current_version=_version_reader(self))
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._initialized = False
        self._finalizer: Optional[weakref.finalize] = None
        self._clients: List[Any] = [self._client]  # what `_finalizer` closes (the client `_connect` may swap in)

    # -------------------------------------------------------------------------------------------- attributes

    @property
    def addresses(self) -> List[str]:
        return self._client.addresses

    @property
    def max_concurrent_rollouts(self) -> int:
        return self._executor.staleness.max_concurrent_rollouts

    @property
    def consumer_batch_size(self) -> int:
        return self._executor.staleness.consumer_batch_size

    @property
    def max_head_offpolicyness(self) -> int:
        return self._executor.staleness.max_head_offpolicyness

    @property
    def data_epoch(self) -> int:
        """Epochs prepare_batch's data iterator has completed (it restarts when the dataloader ends)."""
        return self._executor.data_epoch

    @property
    def paused(self) -> bool:
        return self._executor.paused

    # -------------------------------------------------------------------------------------------- lifecycle

    def initialize(
        self, engine_id: Optional[str] = None, addr: Any = None, train_data_parallel_size: Optional[int] = None
    ) -> "RemoteSGLangEngine":
        """Start the background loop and wait (up to `setup_timeout`) until every server answers GET /health.

        AReaL 1.0.4's order: the first parameter is an engine id, so pass servers by keyword:
        `engine.initialize(addr=server.address)`. Without `addr`, `AREAL_LLM_SERVER_ADDRS` is read.
        `train_data_parallel_size` is AReaL's (it splits rollouts among trainer ranks); the kit's one client ignores it.
        """
        if addr is None and looks_like_addrs(engine_id):
            raise TypeError(
                f"initialize({engine_id!r}): the first argument is engine_id (AReaL's order), not the server; "
                "write engine.initialize(addr=...) — the same call works in AReaL"
            )
        if self._initialized or self._destroyed:
            raise RuntimeError("initialize() may be called once per engine (make a new engine after destroy())")
        self.engine_id = engine_id or uuid.uuid4().hex
        self._client.addresses = parse_addrs(addr)
        runner = LoopThread("areal-lite-rollout")
        self._loop, self._thread = runner.loop, runner.thread
        # dropped without destroy(): nothing runs then (a running episode holds its engine), so closing will do
        self._finalizer = runner.release_with(self, functools.partial(_close_clients, self._clients))
        self._executor.attach(self._loop, self._thread)
        self._initialized = True
        try:
            self._run_sync(self._connect(), timeout=None)
        except BaseException:
            self.destroy()
            raise
        return self

    async def _connect(self) -> None:
        """Wait for the servers' health, then make sure the client speaks their protocol."""
        await self._client.connect()
        kinds = await asyncio.gather(*(is_vllm(self._client, a) for a in self._client.addresses))
        if any(kinds) and not all(kinds):
            mixed = [f"{a} ({'vllm' if k else 'sglang'})" for a, k in zip(self._client.addresses, kinds)]
            raise EngineError(f"one engine cannot mix vLLM and SGLang-compatible servers: {', '.join(mixed)}")
        if self._CLIENT is VLLMClient and not all(kinds):
            raise EngineError(
                f"{', '.join(self._client.addresses)} is not a vLLM server (GET /v1/models names no vLLM model): "
                "use RemoteSGLangEngine for SGLang and the embedded server"
            )
        if all(kinds) and not isinstance(self._client, VLLMClient):
            self._client = self._clients[0] = VLLMClient.take_over(self._client)
            logger.info("servers %s are vLLM: using its protocol", ",".join(self._client.addresses))

    @property
    def _destroyed(self) -> bool:
        return self._executor.closing  # closed by destroy() only

    def destroy(self) -> None:
        """Abort this engine's requests, cancel running episodes, close the session, stop the loop thread.
        Safe to call twice; the servers keep running."""
        loop, thread = self._loop, self._thread
        if thread is not None and threading.current_thread() is thread:
            raise RuntimeError("destroy() cannot be called from inside a workflow (the rollout loop itself)")
        if not self._executor.close():
            return  # destroyed already
        if self._finalizer is not None:
            self._finalizer.detach()  # the orderly teardown below replaces the garbage collector's
        # Before the aborts: an aborted request must hand back its partial output instead of resuming.
        self._client.closing = True
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
        # First the servers abort our requests, which come back with their tokens so far; whatever is left (episodes
        # included) is then cancelled, and only then is the session closed, since the cancelled code may still use it.
        await self._client.abort_inflight()
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_SHUTDOWN_TIMEOUT)
        await self._client.close()
        await self._loop.shutdown_default_executor()  # DNS threads of "localhost"-style addresses

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
        return self._executor.version

    def set_version(self, version: int) -> None:
        """The policy version of the weights the servers hold (the trainer calls it after each weight update)."""
        self._executor.set_version(version)

    def pause(self) -> None:
        """Stop starting episodes and requests, and abort the requests running on the servers (they resume later)."""
        self._require_running()
        self._executor.set_paused(True)
        self._client.paused = True  # before the servers abort: an aborted request then waits instead of re-sending
        self._run_sync(self._client.abort_all(), timeout=None)

    def resume(self) -> None:
        """Let the servers continue, then release the waiting requests and start queued episodes."""
        self._require_running()
        self._run_sync(self._client.continue_all(), timeout=None)
        self._client.paused = False
        self._executor.set_paused(False)

    # -------------------------------------------------------------------------------------------- generation

    def server_for(self, rid: str) -> Optional[str]:
        """The server a rid is pinned to (None if the rid is unknown or forgotten)."""
        return self._client.server_for(rid)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one request (n_samples must be 1), resuming across pauses. Usable from any event loop."""
        self._require_running()
        check_request(req)
        if asyncio.get_running_loop() is self._loop:
            return await self._client.generate(req)
        # A foreign loop (a notebook cell, a test's asyncio.run): the HTTP session lives on the background loop.
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._client.generate(req), self._loop))

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
        return asyncio.run_coroutine_threadsafe(self._client.weight_update(meta, k, timeout), self._loop)

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future:
        """AReaL's name for a disk `update_weights`: a Future that is done when every server loaded the version.

        With a versioned meta (`meta.with_version(k)`, AReaL's way) the servers load `meta.path`; otherwise version
        `get_version() + 1`.
        """
        if meta.type != "disk":
            raise ValueError(f"update_weights_from_disk needs a disk meta, got type {meta.type!r}")
        return self.update_weights(meta)

    # -------------------------------------------------------------------------------------------- executor

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
        return self._executor.submit(data, workflow, workflow_kwargs, should_accept_fn, group_size)

    def wait(self, count: int, timeout: Optional[float] = None, raise_timeout: bool = True) -> List[dict]:
        """The `count` earliest-submitted accepted episodes, once no episode submitted before them is still running
        (this keeps staleness within eta: see `areal_lite.infra.workflow_executor`). A list of trajectory dicts, as
        AReaL's.

        Raises a workflow's exception, TimeoutError (with counts) after `timeout` seconds (or returns [] when
        `raise_timeout=False`), or RuntimeError when the results can never come (nothing running and the queue
        empty, paused, or held by the staleness bound).
        """
        self._require_running()
        return self._executor.wait(count, timeout, raise_timeout)

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
        runs on the current weights, so evaluation at a fixed version returns -- AReaL 1.0.4 blocks there (for its
        7-day default timeout) once (1 + eta) * B episodes have started at one version.
        """
        self._require_running()
        return self._executor.rollout_batch(data, workflow, workflow_kwargs, group_size, should_accept_fn, timeout)

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
        return self._executor.prepare_batch(
            dataloader, workflow, workflow_kwargs, should_accept_fn, group_size, timeout=timeout
        )

    # -------------------------------------------------------------------------------------------- introspection

    def stats(self) -> Dict[str, Any]:
        """Counters of the executor (a snapshot)."""
        return self._executor.stats()

    def start_versions(self) -> List[int]:
        """The engine version at the start of every episode started so far, in start order."""
        return self._executor.start_versions()

    def explain(self) -> str:
        """What the staleness bound allows right now and why, in words with the numbers: `print(engine.explain())`."""
        return self._executor.explain()
