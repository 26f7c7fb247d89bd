"""The rollout executor: episodes, their queue, and the staleness bound that decides when one may start.

`WorkflowExecutor` runs workflows (`await workflow.arun_episode(engine, data)`) on the engine's background event
loop and owns what `submit`/`wait`/`rollout_batch`/`prepare_batch` do; `StalenessManager` holds the counters and
the rule (`areal_lite.infra.staleness_manager`). Neither talks HTTP: a workflow reaches the servers via the engine.

Design decisions
- Episodes of a `rollout_batch` are synchronous: generated with the current weights and consumed at once, so their
  staleness is 0; only the concurrency limit applies to them. (AReaL runs them through the bound too, so an
  evaluation larger than (eta + 1) * B can never start.)
- Event-driven, not polled: `submit`, a finished episode, `set_version`, `set_paused(False)` and consuming results
  each schedule a "pump" that starts queued episodes while the capacity allows. All state sits under one
  `threading.Condition`, notified on every change.
- Results come in submission order (`wait`): an episode still running is waited for, never passed, which makes the
  bound a guarantee (`_take_locked`). AReaL takes whatever finished first, so a slow episode can be passed over step
  after step. `rollout_batch` returns its own episodes in input order, without rejected ones.
- Fail loudly instead of hanging: a workflow's exception is re-raised (same object) in the waiting thread; when
  nothing can make progress, waiting raises with the reason (`_raise_if_stuck_locked`) instead of sleeping forever.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib
import inspect
import itertools
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence

import torch

from areal_lite.api.engine_api import InferenceEngine
from areal_lite.infra.staleness_manager import StalenessManager
from areal_lite.utils.trajectory import misshapen_keys

__all__ = ["WorkflowExecutor", "resolve_workflow"]

logger = logging.getLogger("areal_lite.engine")  # one logger name for the whole rollout side


# ------------------------------------------------------------------------------------------------ workflows


def _import_from_string(path: str) -> Any:
    """`pkg.module.Name` or `pkg.module:Name` -> the object (AReaL accepts workflows named this way)."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not name:
        raise ValueError(f"cannot import {path!r}: write 'package.module.Name'")
    return getattr(importlib.import_module(module), name)


def resolve_workflow(workflow: Any, workflow_kwargs: Optional[dict], group_size: int) -> Any:
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
        from areal_lite.workflow.grouped import (
            GroupedWorkflow,  # the workflow module never imports the executor: no cycle
        )

        # AReaL's rule: group_size decides, whatever the workflow's gconfig.n_samples says. The rows sorted: a seeded
        # run repeats whatever order the server received the group's identical requests in (grouped.py)
        workflow = GroupedWorkflow(workflow, group_size=group_size, check_n_samples=False, sort_rows=True)
    return workflow


def _rows_of(batch: Any) -> List[Any]:
    """A dataloader batch must be a list of rows (`areal_lite.utils.dataloader` collates that way)."""
    if isinstance(batch, (list, tuple)):
        return list(batch)
    raise TypeError(
        f"prepare_batch: the dataloader yielded a {type(batch).__name__}; it must yield lists of rows "
        "(use areal_lite.utils.dataloader.make_dataloader or collate_fn=lambda rows: rows)"
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
    _check_lengths(result, name)
    return result


def _check_lengths(result: Dict[str, torch.Tensor], name: str) -> None:
    """Every per-token key as long as `input_ids` in every row, every per-row key one value a row.

    Refused here, where the episode is made: padded into a batch, a token list appended twice (or a logprob
    forgotten) would only surface later as an index error in the trainer that names neither the row nor the key.
    """
    rows, length = result["input_ids"].shape
    wrong = misshapen_keys(result)
    if wrong:
        shapes = ", ".join(f"{k} {list(s)}" for k, s in wrong.items())
        raise ValueError(
            f"{name}.arun_episode returned tensors that disagree in length: input_ids is {[rows, length]} "
            f"(rows {list(range(rows))}) but {shapes}; every per-token key must be [rows, len(input_ids)] "
            "(a token list extended twice, or a logprob or mask entry missing for some tokens?)"
        )


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
    batch: Optional[_Batch] = None  # None: asynchronous (submit/prepare_batch), under the staleness bound
    index: int = 0  # position in its rollout_batch
    task: Optional[asyncio.Task] = None


class _DataFeed:
    """prepare_batch's data iterator: it persists across calls, and a new epoch starts when one ends."""

    def __init__(self) -> None:
        self.source: Any = None
        self.iterator: Optional[Iterator] = None
        self.epoch = 0

    def next_batch(self, dataloader: Iterable) -> Any:
        if self.source is not dataloader or self.iterator is None:
            self.source, self.iterator, self.epoch = dataloader, iter(dataloader), 0
        try:
            return next(self.iterator)
        except StopIteration:
            self.iterator = iter(dataloader)
            self.epoch += 1
            try:
                return next(self.iterator)
            except StopIteration:
                raise ValueError("prepare_batch: the dataloader yields no batches") from None


# ------------------------------------------------------------------------------------------------ the loop side


class _EpisodeRunner:
    """The loop side of the executor: the shared state, starting queued episodes and recording how they end.

    Split from `WorkflowExecutor` by thread: `_pump`, `_run_episode` and `_finish` run on the engine's loop, while
    the subclass's methods block the caller's thread; both sides meet only under `self._cond`.
    """

    def __init__(self, staleness: StalenessManager, engine: InferenceEngine):
        self.staleness = staleness
        self._engine = engine  # handed to every workflow's arun_episode: workflows generate through it
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        # Every field below, and self.staleness, is guarded by self._cond.
        self._cond = threading.Condition()
        self.paused = False  # no episode starts while paused
        self.closing = False  # the engine is being destroyed: start nothing, let waiters fail
        self._seq = itertools.count()
        self._pending: Deque[_Episode] = collections.deque()
        self._running: Dict[int, _Episode] = {}
        self._ready: Dict[int, dict] = {}  # finished, accepted, not yet taken by wait(): seq -> result
        self._errors: List[tuple] = []  # (seq, exception) of failed submit()/prepare_batch() episodes
        self._counts = collections.Counter()  # rejected, failed, cancelled, consumed, sync_accepted
        self._start_versions: List[int] = []

    def attach(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        """The loop (and the thread running it) that episodes run on; nothing starts before this."""
        self._loop, self._thread = loop, thread

    @property
    def version(self) -> int:
        return self.staleness.version

    # -------------------------------------------------------------------------------------------- state changes

    def set_version(self, version: int) -> None:
        with self._cond:
            self.staleness.version = int(version)
            if not self._start_versions:  # nothing started yet: a resumed run counts from here (AReaL's recovery)
                self.staleness.on_version_recovered(int(version))
            self._cond.notify_all()
        self._schedule_pump()

    def set_paused(self, paused: bool) -> None:
        with self._cond:
            self.paused = paused
            self._cond.notify_all()
        if not paused:
            self._schedule_pump()

    def close(self) -> bool:
        """Stop starting episodes and wake every waiter (they raise). False if it was already closed."""
        with self._cond:
            if self.closing:
                return False
            self.closing = True
            self._cond.notify_all()
        return True

    def _enqueue_locked(self, data: Any, workflow: Any, should_accept, batch=None, index=0) -> _Episode:
        ep = _Episode(next(self._seq), data, workflow, should_accept, batch, index)
        self._pending.append(ep)
        if batch is None:
            self.staleness.on_rollout_enqueued()
        return ep

    # -------------------------------------------------------------------------------------------- episodes

    def _schedule_pump(self) -> None:
        """Run `_pump` on the loop: at once when already there, else as the loop's next callback."""
        loop = self._loop
        if loop is None or self.closing or loop.is_closed():
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
            if self.paused or self.closing:
                return
            started = False
            held: Deque[_Episode] = collections.deque()
            while self._pending and self.staleness.free_slots() > 0:
                ep = self._pending.popleft()
                synchronous = ep.batch is not None
                if not synchronous:
                    if self.staleness.capacity() <= 0:
                        held.append(ep)  # held by the staleness bound; synchronous episodes may still pass
                        continue
                    self._start_versions.append(self.staleness.version)
                self.staleness.on_started(synchronous)
                self._running[ep.seq] = ep
                ep.task = self._loop.create_task(self._run_episode(ep), name=f"episode-{ep.seq}")
                started = True
            held.extend(self._pending)
            self._pending = held
            if started:
                self._cond.notify_all()

    async def _run_episode(self, ep: _Episode) -> None:
        status, payload = "failed", None
        try:
            result = _check_result(await ep.workflow.arun_episode(self._engine, ep.data), ep.workflow)
            if result is None or (ep.should_accept is not None and not ep.should_accept(result)):
                status = "rejected"
            else:
                status, payload = "accepted", result
        except (asyncio.CancelledError, GeneratorExit):  # cancelled, or closed with the loop
            status = "cancelled"
            raise
        except BaseException as e:  # SystemExit or KeyboardInterrupt too: re-raised, they would stop the loop itself
            error = e if isinstance(e, Exception) else RuntimeError(f"the workflow raised {type(e).__name__}: {e}")
            status, payload = "failed", error
            error.add_note(
                f"(raised by {type(ep.workflow).__name__}.arun_episode on the rollout thread, "
                f"episode {ep.seq}, data {str(ep.data)[:200]})"
            )
        finally:
            self._finish(ep, status, payload)
            self._pump()

    def _finish(self, ep: _Episode, status: str, payload: Any) -> None:
        synchronous = ep.batch is not None
        with self._cond:
            self._running.pop(ep.seq, None)
            self.staleness.on_finished(synchronous, accepted=status == "accepted")
            # Accepted asynchronous episodes are counted by the StalenessManager (they are part of its bound);
            # accepted synchronous (rollout_batch) ones are tallied apart, since they are not.
            if status != "accepted":
                self._counts[status] += 1
            elif synchronous:
                self._counts["sync_accepted"] += 1
            if synchronous:
                if status == "failed" and ep.batch.error is None:
                    ep.batch.error = payload
                ep.batch.results[ep.index] = payload if status == "accepted" else None
            elif status == "accepted":
                self._ready[ep.seq] = payload
            elif status == "failed":
                self._errors.append((ep.seq, payload))
            self._cond.notify_all()

    def _cancel_batch(self, batch: _Batch) -> None:
        """Drop a failed/abandoned rollout_batch: unqueue its episodes and cancel its running ones."""
        with self._cond:
            self._pending = collections.deque(ep for ep in self._pending if ep.batch is not batch)
            tasks = [ep.task for ep in self._running.values() if ep.batch is batch and ep.task is not None]
        if tasks and self._loop is not None and not self._loop.is_closed():
            for t in tasks:
                self._loop.call_soon_threadsafe(t.cancel)

    def _describe_locked(self) -> str:
        c = self._counts
        return (
            f"ready {len(self._ready)}, running {len(self._running)}, queued {len(self._pending)}, "
            f"accepted {self.staleness.accepted_since_recovery()}, rejected {c['rejected']}, failed {c['failed']}, "
            f"version {self.staleness.version}"
        )

    # -------------------------------------------------------------------------------------------- introspection

    def stats(self) -> Dict[str, Any]:
        with self._cond:
            c, s = self._counts, self.staleness
            return {
                "version": s.version,
                "base_version": self._start_versions[0] if self._start_versions else None,
                "paused": self.paused,
                "queued": len(self._pending),
                "running": len(self._running),
                "ready": len(self._ready),
                "started": len(self._start_versions),
                "accepted": s.accepted_since_recovery(),
                "sync_accepted": c["sync_accepted"],
                "rejected": c["rejected"],
                "failed": c["failed"],
                "cancelled": c["cancelled"],
                "consumed": c["consumed"],
                "capacity": s.capacity(),
            }

    def start_versions(self) -> List[int]:
        with self._cond:
            return list(self._start_versions)

    def explain(self) -> str:
        """The StalenessManager's explanation, plus what the executor holds back (queue, pause)."""
        with self._cond:
            text = self.staleness.explain()
            text += f"\nQueued: {len(self._pending)} episode(s); ready to be consumed: {len(self._ready)}."
            if self.paused:
                text += "\nThe engine is paused: nothing starts until resume()."
            return text


# ------------------------------------------------------------------------------------------------ the executor


class WorkflowExecutor(_EpisodeRunner):
    """Runs episodes on the engine's loop under the StalenessManager's rule (see the module docstring); these are
    the methods the engine's `submit`/`wait`/`rollout_batch`/`prepare_batch` call, from the caller's thread."""

    def __init__(self, staleness: StalenessManager, engine: InferenceEngine):
        super().__init__(staleness, engine)
        self._feed = _DataFeed()  # used only by prepare_batch in the caller's thread, never on the loop: no lock

    @property
    def data_epoch(self) -> int:
        return self._feed.epoch

    # -------------------------------------------------------------------------------------------- submit / wait

    def submit(self, data: Any, workflow: Any, workflow_kwargs=None, should_accept_fn=None, group_size=1) -> int:
        workflow = resolve_workflow(workflow, workflow_kwargs, group_size)
        with self._cond:
            ep = self._enqueue_locked(data, workflow, should_accept_fn)
        self._schedule_pump()
        return ep.seq

    def wait(self, count: int, timeout: Optional[float] = None, raise_timeout: bool = True) -> List[dict]:
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
        """The `count` oldest accepted results, or None while fewer are ready or an older episode still runs.

        Why not whatever finished first: an episode that started at version v had fewer than (eta + v - v0 + 1) * B
        episodes accepted or running ahead of it, so taken in submission order it is consumed by step v + eta at the
        latest. Taking the finished ones first (AReaL sorts them by creation time, then shuffles) lets a slow episode
        be passed over step after step and arrive more than eta versions stale."""
        if self._errors:
            self._errors.sort(key=lambda item: item[0])
            _, exc = self._errors.pop(0)
            raise exc
        if self.closing:
            raise RuntimeError("the engine was destroyed while waiting for rollouts")
        if len(self._ready) < count:
            return None
        seqs = sorted(self._ready)[:count]
        if self._blocking_locked(seqs[-1]):
            return None  # an earlier episode may still be accepted: it goes first
        self._counts["consumed"] += count
        self.staleness.on_consumed(count)
        return [self._ready.pop(s) for s in seqs]

    def _blocking_locked(self, last_seq: int) -> bool:
        """Whether an asynchronous episode submitted before `last_seq` is still running."""
        return any(ep.batch is None and seq < last_seq for seq, ep in self._running.items())

    def _raise_if_stuck_locked(self, count: int, who: str) -> None:
        """Raise if no event can ever produce the missing results (only another thread could unblock us): nothing
        running, and the queue empty, or blocked by the staleness bound (typically: call `set_version()` after each
        training step), or paused."""
        if self.paused and len(self._ready) >= count:
            raise RuntimeError(
                f"{who}({count}) cannot finish: the engine is paused: call engine.resume() (earlier episodes still "
                f"running must finish first). State: {self._describe_locked()}"
            )
        if self._running:
            return
        why = None
        s = self.staleness
        if not self._pending:
            why = "nothing is running or queued (rejected episodes do not count; submit more)"
        elif self.paused:
            why = "the engine is paused: call engine.resume()"
        elif s.headroom() <= 0:
            why = (
                f"the staleness bound is reached: {s.bound_text()} episodes may start by version "
                f"{s.version}, and {s.accepted_since_recovery()} were accepted. "
                "Call engine.set_version(v + 1) after each training step (or raise max_head_offpolicyness)"
            )
        elif s.queue_size is not None and s.capacity() <= 0:
            why = f"queue_size={s.queue_size} is smaller than the {count} results asked for"
        if why is not None:
            raise RuntimeError(f"{who}({count}) cannot finish: {why}. State: {self._describe_locked()}")

    # -------------------------------------------------------------------------------------------- rollout_batch

    def rollout_batch(
        self,
        data: Sequence[Any],
        workflow: Any,
        workflow_kwargs: Optional[dict] = None,
        group_size: int = 1,
        should_accept_fn: Optional[Callable[[dict], bool]] = None,
        timeout: Optional[float] = None,
    ) -> List[dict]:
        workflow = resolve_workflow(workflow, workflow_kwargs, group_size)
        rows = list(data)
        if not rows:
            return []
        batch = _Batch(size=len(rows))
        with self._cond:
            for i, row in enumerate(rows):
                self._enqueue_locked(row, workflow, should_accept_fn, batch, i)
        self._schedule_pump()
        try:
            self._wait_batch(batch, timeout)
        except BaseException:
            self._cancel_batch(batch)
            raise
        return [batch.results[i] for i in range(batch.size) if batch.results[i] is not None]

    def _wait_batch(self, batch: _Batch, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(batch.results) < batch.size and batch.error is None:
                if self.closing:
                    raise RuntimeError("the engine was destroyed during rollout_batch")
                if self.paused and not self._running:
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

    # -------------------------------------------------------------------------------------------- prepare_batch

    def prepare_batch(
        self,
        dataloader: Iterable,
        workflow: Any,
        workflow_kwargs: Optional[dict] = None,
        should_accept_fn: Optional[Callable[[dict], bool]] = None,
        group_size: int = 1,
        timeout: Optional[float] = None,
    ) -> List[dict]:
        workflow = resolve_workflow(workflow, workflow_kwargs, group_size)
        B = self.staleness.consumer_batch_size
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
        """Queue min(headroom, max_concurrent_rollouts) + B rows: enough to refill every free slot while the
        trainer is busy, plus one batch to start the moment `set_version()` raises the bound."""
        s = self.staleness
        return min(max(s.headroom(), 0), s.max_concurrent_rollouts) + s.consumer_batch_size

    def _top_up(self, dataloader: Iterable, workflow: Any, should_accept) -> None:
        while True:
            with self._cond:
                if len(self._pending) >= self._top_up_target_locked():
                    break
            rows = _rows_of(self._feed.next_batch(dataloader))  # outside the lock: loading data may be slow
            with self._cond:
                for row in rows:
                    self._enqueue_locked(row, workflow, should_accept)
            self._schedule_pump()
