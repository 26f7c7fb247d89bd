"""The scheduler: one thread that owns the model and runs continuous batching.

Design decisions
- Two threads, one owner. The asyncio event loop (HTTP) parses, validates and answers; it never touches the model.
  The scheduler thread owns the model, the KV cache and the sampling state, and builds the runner, so it alone runs
  torch's parallel regions (`_run`). Requests and commands reach it through one ordered event queue: no locks.
- Commands are explicit: each thread-safe method (`pause`, `abort`, `update_weights`, `submit`, ...) enqueues the
  handler that runs it on the scheduler thread (`_on_pause`, ...), so every path can be followed by name.
- Continuous batching: each iteration handles events, admits waiting requests up to `max_running_requests`
  (prefilled together, in groups of at most `max_prefill_tokens`), then runs one decode step. Rows join and leave
  between steps. The runner computes (`fastpath.make_runner`); the scheduler only decides who runs.
- An idle server gathers a burst before its first prefill (`_gather_burst`): a GRPO client sends one request per
  sample, all at once. A running batch never waits.
- Pause (SGLang's semantics): mode "abort" returns in-flight requests at once with their tokens so far; "in_place"
  and "retract" freeze the running batch. Requests arriving while paused are held until `continue_generation`.
- Weight updates, LoRA loads included, as in SGLang: at once while paused, else once the running batch drained
  (`_maybe_apply_update`), so a response comes from one weight version.
- A failing step (a bug, out of memory) aborts the running and waiting rows and the loop goes on: the server stays up.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import traceback
from typing import Any, Callable, Optional

import torch

from areal_lite.kit.server.batch import RunningBatch, prefill_distinct, prefill_groups
from areal_lite.kit.server.fastpath import make_runner
from areal_lite.kit.server.protocol import GenerationState, PromptSpec
from areal_lite.kit.server.sampling import RowSeeds, sample_and_append
from areal_lite.kit.server.weights import ServedWeights, eos_ids

log = logging.getLogger("areal_lite.kit.server")  # one logger for the server

COUNTERS = (
    "max_running_batch", "decode_steps", "prefill_batches", "prompt_tokens", "generated_tokens", "finished_requests",
    "aborted_requests", "weight_updates",
)  # fmt: skip
_DEFERRED = object()  # a command handler's result meaning "its future is resolved later by the scheduler"
ADMIT_QUIET = 0.01  # seconds without a new request that end an idle server's burst (`_gather_burst`)
ADMIT_MAX = 0.1  # the longest an idle server holds a burst's first request back


def _abort_reason(message: str, status_code: Optional[int] = None, err_type: Optional[str] = None) -> dict:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


class Scheduler:
    """Owns the model; runs the continuous-batching loop on its own thread. Thread-safe entry points: `start`,
    `stop`, `submit`, the commands (`pause`, `continue_generation`, `abort`, `flush_cache`, `update_weights`),
    `new_state` and `stats`. Every other method runs on the scheduler thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_path: str,
        max_running_requests: int = 32,
        max_prefill_tokens: int = 8192,
        context_length: int = 4096,
        random_seed: int = 1,
        threads: int = 1,
        return_original_logprob: bool = False,
        decode_log_interval: int = 40,
        fast_path: bool = True,
        admit_quiet: float = ADMIT_QUIET,
        admit_max: float = ADMIT_MAX,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.context_length = context_length
        self.threads = threads
        self.return_original_logprob = return_original_logprob
        self.admit_quiet, self.admit_max = admit_quiet, admit_max
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.eos_ids = frozenset(eos_ids(model, tokenizer))
        self.seeds = RowSeeds(random_seed)
        self.weights = ServedWeights(model, model_path)  # their version, LoRA adapter and pending update

        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._later: list = []  # events taken from the queue by `_gather_burst`, handled after its prefill
        self._thread: Optional[threading.Thread] = None
        self._fast_path = fast_path
        # Scheduler-thread state. The runner is built by `start`, on the scheduler thread (see `_run`).
        self.runner: Any = None
        self.batch = RunningBatch()
        self.waiting: list[GenerationState] = []  # admitted to the server, not yet prefilled
        self.held: list[GenerationState] = []  # arrived while paused; start on continue
        self.paused = False
        self._stopping = False
        # Counters, read by /server_info (plain ints: reads from another thread are fine).
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._throughput = ThroughputLog(decode_log_interval)

    # ---- thread-safe API --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler thread; returns once it has built the runner (raising what building raised)."""
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="areal-lite-scheduler", daemon=True)
        self._thread.start()
        built.result()

    def stop(self) -> None:
        self._enqueue(self._on_stop)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, states: list[GenerationState]) -> None:
        """Queue rows for generation; each row's `on_done` is called (on the scheduler thread) when it finishes."""
        self._enqueue(self._on_submit, states)

    def pause(self, mode: str = "abort") -> concurrent.futures.Future:
        return self._enqueue(self._on_pause, mode)

    def continue_generation(self) -> concurrent.futures.Future:
        return self._enqueue(self._on_continue)

    def abort(self, rid: str = "", abort_all: bool = False) -> concurrent.futures.Future:
        """Abort the rows of request `rid` (a client's rid also matches its n > 1 samples), or all of them."""
        return self._enqueue(self._on_abort, rid, abort_all)

    def flush_cache(self) -> concurrent.futures.Future:
        return self._enqueue(self._on_flush_cache)

    def update_weights(self, request: Any) -> concurrent.futures.Future:
        """A `WeightUpdate` or a `LoraUpdate` (load or unload), applied between batches (see the module docstring)."""
        # This handler keeps the future and resolves it once the update has happened (maybe several steps later).
        fut: concurrent.futures.Future = concurrent.futures.Future()
        return self._enqueue(self._on_update_weights, request, fut, fut=fut)

    def new_state(self, spec: PromptSpec, sample: int) -> GenerationState:
        """The row of sample number `sample` of a validated prompt."""
        sp = spec.params
        stop_ids = frozenset() if sp.ignore_eos else self.eos_ids | frozenset(sp.stop_token_ids)
        rid = spec.rid if sp.n == 1 else f"{spec.rid}_{sample}"
        return GenerationState(rid, spec.rid, spec.input_ids, sp, spec.return_logprob, stop_ids, sample=sample)

    def stats(self) -> dict:
        return dict(
            self.counters,
            num_running=len(self.batch),
            num_waiting=len(self.waiting),
            num_held=len(self.held),
            paused=self.paused,
            weight_version=self.weights.version,
            lora_adapter=self.weights.lora.active,
        )

    def _enqueue(
        self, handler: Callable[..., Any], *args: Any, fut: Optional[concurrent.futures.Future] = None
    ) -> concurrent.futures.Future:
        """Queue `handler(*args)` for the scheduler thread; the future resolves to its result."""
        fut = fut if fut is not None else concurrent.futures.Future()
        self._events.put((handler, args, fut))
        return fut

    # ---- the loop ---------------------------------------------------------------------------------------------

    def _run(self, built: concurrent.futures.Future) -> None:
        # torch's intra-op thread count is per calling thread for OpenMP: set it here, on the thread that computes.
        torch.set_num_threads(self.threads)
        # The runner is built here too (its weight packing is parallel), so that this is the only thread of the
        # process that ever runs a parallel region. GNU OpenMP keeps a team of workers for every thread that has,
        # and once its workers outnumber the CPUs they stop spinning between regions and sleep, so each of the
        # hundreds of small regions of a decode step waits for a wake-up, a cost the demo's rollouts would pay at
        # every token.
        try:
            self.runner = make_runner(self.model, fast=self._fast_path)
            self.batch = RunningBatch(self.runner.new_kv(self.max_running))
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        while not self._stopping:
            try:
                self._iteration()
            except Exception as e:  # a bug or OOM must not kill the server: fail the batch, keep serving
                log.error("scheduler error: %s\n%s", e, traceback.format_exc())
                self._abort(lambda s: True, f"internal server error: {type(e).__name__}: {e}", include_held=False)
        self._abort(lambda s: True, "server shutting down", include_held=True)

    def _can_admit(self) -> bool:
        return bool(self.waiting) and not self.paused and self.weights.pending is None

    def _iteration(self) -> None:
        self._maybe_apply_update()  # the running batch may have just drained
        busy = (len(self.batch) > 0 and not self.paused) or self._can_admit() or bool(self._later)
        self._handle_events(block=not busy)  # idle: sleep until something arrives
        if self._stopping:
            return
        self._maybe_apply_update()
        if self._can_admit() and len(self.batch) == 0:
            self._gather_burst()
        if self._can_admit() and len(self.batch) < self.max_running:
            take = self.max_running - len(self.batch)
            newcomers, self.waiting = self.waiting[:take], self.waiting[take:]
            self._prefill(newcomers)
        if len(self.batch) > 0 and not self.paused:
            self._decode_step()

    def _handle_events(self, block: bool) -> None:
        events, self._later = self._later, []
        self._dispatch(events + ([self._events.get()] if block else []) + self._drain())

    def _drain(self) -> list:
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def _gather_burst(self) -> None:
        """With nothing running, handle events until none came for `admit_quiet` s (at most `admit_max` s), so a
        burst of requests is prefilled together.

        A GRPO client sends a batch as one request per sample, within milliseconds. Had the first been prefilled
        alone, the others would need a second prefill, their prompt computed again, and start a decode step later.
        Why 10 ms (100 at most): on 2 cores a burst's requests arrive ms apart, and a straggler costs a second prefill,
        far more than the wait (bench/eval_cost.py and bench/rollout_throughput.py print each run's prefill batches).
        A command arriving in the window (an abort, a pause) ends it and is handled after the prefill, as it would
        have been without the wait. Sampling is batch-invariant, so the tokens are the same either way."""
        deadline = time.monotonic() + self.admit_max
        while len(self.waiting) < self.max_running:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                first = self._events.get(timeout=min(self.admit_quiet, left))
            except queue.Empty:
                return
            events = [first] + self._drain()
            n = next((i for i, (handler, _, _) in enumerate(events) if handler != self._on_submit), len(events))
            self._dispatch(events[:n])
            if n < len(events):  # a command: the burst ends, and the command waits for the prefill
                self._later = events[n:]
                return

    def _dispatch(self, events: list) -> None:
        for handler, args, fut in events:
            try:
                result = handler(*args)
            except Exception as e:  # a failed command answers its caller and leaves the server running
                log.error("command %s failed: %s\n%s", handler.__name__, e, traceback.format_exc())
                if not fut.done():
                    fut.set_exception(e)
                continue
            if result is not _DEFERRED and not fut.done():
                fut.set_result(result)
            if self._stopping:  # the server is shutting down: later events are dropped
                return

    # ---- command handlers (scheduler thread) ------------------------------------------------------------------

    def _on_stop(self) -> None:
        self._stopping = True

    def _on_submit(self, states: list[GenerationState]) -> None:
        for s in states:  # in arrival order, on this thread: the streams do not depend on the HTTP side's timing
            self.seeds.assign(s)
        (self.held if self.paused else self.waiting).extend(states)

    def _on_abort(self, rid: str, abort_all: bool) -> int:
        if abort_all:
            return self._abort(lambda s: True, "Aborted by abort_request (abort_all).", include_held=True)
        return self._abort(lambda s: s.rid == rid or s.parent == rid, "Aborted by abort_request.", include_held=True)

    def _on_pause(self, mode: str) -> dict:
        self.paused = True
        if mode == "abort":
            # In-flight requests (running or queued) return now with what they have; later arrivals are held.
            self._abort(lambda s: True, "Aborted by pause_generation.", include_held=False)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def _on_continue(self) -> dict:
        self.paused = False
        self.waiting.extend(self.held)
        self.held = []
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _on_flush_cache(self) -> bool:
        return len(self.batch) + len(self.waiting) == 0  # no prefix cache: "flushed" means nothing is in flight

    def _on_update_weights(self, request: Any, fut: concurrent.futures.Future) -> Any:
        if request.abort_all_requests:
            self._abort(lambda s: True, "Aborted by update_weights_from_disk.", include_held=False)
        refused = self.weights.request(request, fut)  # a second update while one waits is refused
        if refused is not None:
            return refused
        # As SGLang: immediate while paused; otherwise wait for the running batch to drain (admission stops).
        self._maybe_apply_update()
        return _DEFERRED

    def _maybe_apply_update(self) -> None:
        """Apply the pending weight update if it may run now: while paused, or once the running batch drained (new
        requests wait meanwhile; `abort_all_requests` aborts the batch first). So a response comes from one weight
        version, its `meta_info.weight_version`; the exception, as in SGLang, is a batch frozen by an "in_place" or
        "retract" pause, which resumes under the new weights."""
        if self.weights.pending is None or (len(self.batch) > 0 and not self.paused):
            return
        if self.weights.apply(self.runner):
            self.counters["weight_updates"] += 1

    # ---- finishing rows ---------------------------------------------------------------------------------------

    def _abort(self, match: Callable[[GenerationState], bool], message: str, include_held: bool) -> int:
        """Finish every matching row now with finish_reason abort (tokens made so far are kept)."""
        reason = _abort_reason(message)
        count = 0
        pools = [self.waiting] + ([self.held] if include_held else [])
        for pool in pools:
            for s in [s for s in pool if match(s)]:
                pool.remove(s)
                self._finish(s, reason)
                count += 1
        keep = []
        for i, s in enumerate(self.batch.seqs):
            if match(s):
                self._finish(s, reason)
                count += 1
            else:
                keep.append(i)
        with torch.inference_mode():
            self.batch.keep(keep)
        return count

    def _finish(self, state: GenerationState, reason: dict) -> None:
        state.finish = reason
        state.finished_at = time.perf_counter()
        state.weight_version = self.weights.version
        self.counters["aborted_requests" if reason["type"] == "abort" else "finished_requests"] += 1
        if state.on_done is not None:
            state.on_done(state)

    # ---- model steps ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _prefill(self, newcomers: list[GenerationState]) -> None:
        """Run the prompts of the newcomers (in groups bounded by max_prefill_tokens), then join the batch."""
        ready = []
        for s in newcomers:  # max_new_tokens == 0: nothing to compute
            if s.params.max_new_tokens == 0:
                self._finish(s, {"type": "length", "length": 0})
            else:
                ready.append(s)
        try:
            for group in prefill_groups(ready, self.max_prefill_tokens):
                self._prefill_group(group)
        except Exception as e:
            # Newcomers are in neither `waiting` nor the batch now: answer them here, or their clients would hang.
            reason = _abort_reason(f"prefill failed: {type(e).__name__}: {e}", 500, "InternalServerError")
            for s in ready:
                if s.finish is None and s not in self.batch.seqs:
                    self._finish(s, reason)
            raise

    def _prefill_group(self, states: list[GenerationState]) -> None:
        part, logits = prefill_distinct(self.runner, [s.prompt for s in states])
        self.counters["prefill_batches"] += 1
        self.counters["prompt_tokens"] += sum(len(p) for p in {tuple(s.prompt) for s in states})
        tokens = self._sample_and_record(logits, states)
        survivors = [i for i, s in enumerate(states) if s.finish is None]
        if not survivors:
            return
        idx = torch.tensor(survivors, device=self.device)
        part.select(idx)
        plen = torch.tensor([len(states[i].prompt) for i in survivors], device=self.device)
        self.batch.add([states[i] for i in survivors], part, tokens[idx], plen)
        self.counters["max_running_batch"] = max(self.counters["max_running_batch"], len(self.batch))

    @torch.inference_mode()
    def _decode_step(self) -> None:
        b = self.batch
        logits = self.runner.decode(b)
        self.counters["decode_steps"] += 1
        self.counters["max_running_batch"] = max(self.counters["max_running_batch"], len(b))
        b.next_ids = self._sample_and_record(logits, b.seqs)
        keep = [i for i, s in enumerate(b.seqs) if s.finish is None]
        b.keep(keep)
        self._throughput.step(self.counters, len(keep), len(self.waiting), len(self.held))

    def _sample_and_record(self, logits: torch.Tensor, states: list[GenerationState]) -> torch.Tensor:
        """Sample one token per row, append it (and its logprob), and finish rows that are done."""
        tokens, reasons = sample_and_append(
            logits.float(), states, self.tokenizer, self.context_length, self.return_original_logprob
        )
        # Counted before any row is finished: finishing answers the client, which may read /server_info at once.
        self.counters["generated_tokens"] += len(states)
        for s, reason in zip(states, reasons):
            if reason is not None:
                self._finish(s, reason)
        return tokens


class ThroughputLog:
    """The decode progress line: every `interval` decode steps, but at most every 2 s (a tiny model makes hundreds
    of steps per second, and a log line per step would drown everything else)."""

    def __init__(self, interval: int):
        self.interval = interval
        self._t0 = time.perf_counter()
        self._tokens = 0

    def step(self, counters: dict, running: int, waiting: int, held: int) -> None:
        steps = counters["decode_steps"]
        now = time.perf_counter()
        if self.interval > 0 and steps % self.interval == 0 and now - self._t0 >= 2.0:
            total = counters["generated_tokens"]
            rate = (total - self._tokens) / max(now - self._t0, 1e-9)
            self._t0, self._tokens = now, total
            log.info(
                "decode batch: #running %d, #waiting %d, #held %d, gen throughput %.1f token/s",
                running, waiting, held, rate,
            )  # fmt: skip
