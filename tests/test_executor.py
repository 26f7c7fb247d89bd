"""The staleness rule (`StalenessManager`) with hand-built numbers, and `WorkflowExecutor` without any server.

The manager is pure arithmetic on its counters, so every case here is a number worked out by hand from
    capacity = min(max_concurrent_rollouts - running, (eta + v - v0 + 1) * B - (accepted + running)).
The executor runs on a real background loop with workflows that never touch HTTP (they return tensors after an
optional sleep), which checks the queue, the ordering and the counters in milliseconds; the same paths against
real servers are in test_engine.py.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
import types

import pytest
import torch

from areal_lite.api.cli_args import InferenceEngineConfig
from areal_lite.infra.staleness_manager import StalenessManager, VersionCounter
from areal_lite.infra.workflow_executor import WorkflowExecutor

# ------------------------------------------------------------------------------------------------ StalenessManager


def _manager(B=4, eta=1, mc=8, queue_size=None, *, version=0, accepted=0, running=0, sync=0, ready=0):
    s = StalenessManager(VersionCounter(version), mc, B, eta, queue_size=queue_size)
    s.accepted, s.ready, s.running, s.sync_running = accepted, ready, running, sync
    return s


def test_the_worked_example_and_its_explanation():
    s = _manager(B=4, eta=1, mc=8, version=3, accepted=12, running=4)
    assert s.bound() == (1 + 3 + 1) * 4 == 20
    assert s.headroom() == 20 - (12 + 4) == 4
    assert s.free_slots() == 8 - 4 == 4
    assert s.capacity() == 4
    text = s.explain()
    for fragment in ("version 3", "eta=1", "B=4", "(1 + 3 - 0 + 1) * 4 = 20", "12 accepted", "4 running", "4 more"):
        assert fragment in text, (fragment, text)


def test_eta_zero_is_synchronous():
    s = _manager(B=2, eta=0, mc=8)
    assert s.capacity() == 2  # one batch at version 0 ...
    for _ in range(2):
        s.on_rollout_enqueued()
        s.on_started(False)
    assert s.capacity() == 0  # ... and no more while it runs
    s.on_finished(False, accepted=True)
    s.on_finished(False, accepted=True)
    s.on_consumed(2)
    assert (s.accepted, s.running, s.ready) == (2, 0, 0)
    assert s.capacity() == 0  # consumed, but still version 0: the trainer has not stepped
    text = s.explain()
    assert "synchronous" in text and "set_version(1)" in text and "0 more episode(s) may start" in text
    s.version = 1
    assert s.capacity() == 2  # the next batch, on the new weights


def test_no_staleness_bound_in_practice_leaves_only_the_concurrency_limit():
    s = _manager(B=2, eta=100_000, mc=8, version=7, accepted=500, running=3)
    assert s.headroom() > 10**5
    assert s.capacity() == s.free_slots() == 5
    text = s.explain()
    assert "concurrency limit decides" in text and "5 more episode(s) may start" in text


def test_no_limit_reached_names_what_decides_and_ties():
    s = _manager(B=4, eta=1, mc=8)  # headroom 8 and 8 free slots
    assert s.capacity() == 8
    assert "the staleness bound and the concurrency limit decide" in s.explain()
    full = _manager(B=4, eta=1, mc=2, running=2)
    assert full.capacity() == 0 and "running episodes must finish first" in full.explain()


def test_a_resumed_run_counts_versions_from_the_recovered_one():
    s = _manager(B=2, eta=0, mc=20, version=5)  # a run resumed at step 5, before on_version_recovered
    assert s.base_version is None and s.capacity() == (0 + 5 + 1) * 2  # AReaL's number: a burst of 12
    s.on_version_recovered(5)
    assert s.base_version == 5 and s.accepted == 10 and s.bound() == 2 and s.capacity() == 2
    assert "counted from v0=5 (the run resumed there)" in s.explain() and "0 accepted" in s.explain()
    s.version = 6
    assert s.bound() == (0 + 6 - 5 + 1) * 2 == 4 and s.capacity() == 4


def test_rollout_batch_episodes_hold_a_slot_but_stay_outside_the_bound():
    s = _manager(B=2, eta=0, mc=3)
    s.on_started(True)
    s.on_started(True)
    assert (s.running, s.sync_running) == (0, 2)
    assert s.headroom() == 2 and s.free_slots() == 1 and s.capacity() == 1
    s.on_finished(True, accepted=True)
    assert s.accepted == 0 and s.ready == 0 and s.sync_running == 1 and s.get_stats().running == 0
    assert "1 of them rollout_batch episodes" in s.explain()


def test_queue_size_backpressure():
    s = _manager(B=2, eta=10, mc=8, queue_size=3, accepted=2, ready=2, running=1)
    assert s.queue_room() == 3 - (2 + 1) == 0
    assert s.capacity() == 0
    text = s.explain()
    assert "queue_size=3" in text and "finished results must be consumed first" in text
    s.on_consumed(2)
    assert s.capacity() == 2
    assert _manager(queue_size=None).queue_room() is None


def test_matches_the_reference_formula_on_a_grid():
    """capacity = min(mc - running, (eta + v + 1) * B - (accepted + running)) for a fresh run (v0 = 0)."""
    for B, eta, mc, v, accepted, running in itertools.product((1, 3), (0, 2), (1, 4, 9), (0, 1, 4), (0, 5), (0, 3)):
        s = _manager(B=B, eta=eta, mc=mc, version=v, accepted=accepted, running=running)
        assert s.capacity() == min(mc - running, (eta + v + 1) * B - (accepted + running))


def test_validation_and_config_defaults():
    s = StalenessManager.from_config(InferenceEngineConfig(consumer_batch_size=3, max_head_offpolicyness=2))
    assert (s.consumer_batch_size, s.max_head_offpolicyness, s.max_concurrent_rollouts) == (3, 2, 3)  # None means B
    assert s.max_staleness == 2 and s.version == 0 and isinstance(s.version_provider, VersionCounter)
    base = {"max_concurrent_rollouts": None, "queue_size": None}
    for kwargs, match in [
        ({"consumer_batch_size": 0, "max_head_offpolicyness": 0}, "consumer_batch_size"),
        ({"consumer_batch_size": 1, "max_head_offpolicyness": -1}, "max_head_offpolicyness"),
        ({"consumer_batch_size": 1, "max_head_offpolicyness": 0, "max_concurrent_rollouts": 0}, "max_concurrent"),
        ({"consumer_batch_size": 1, "max_head_offpolicyness": 0, "queue_size": 0}, "queue_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            StalenessManager.from_config(types.SimpleNamespace(**{**base, **kwargs}))


# ------------------------------------------------------------------------------------------------ WorkflowExecutor


class Echo:
    """Returns row `i` as a one-token trajectory after `sleep` seconds, or once the threading.Event `gate` is set;
    `reject` returns None, `fail` raises (`fail` = "exit": SystemExit, as a workflow calling sys.exit())."""

    def __init__(self):
        self.engines = set()

    async def arun_episode(self, engine, data):
        self.engines.add(id(engine))
        gate = data.get("gate")
        if gate is not None:  # waited on where it is set, not polled; 60 s: a test that never opens it fails the row
            assert await asyncio.to_thread(gate.wait, 60), f"row {data['i']}: the gate was never opened"
        await asyncio.sleep(data.get("sleep", 0.0))
        if data.get("fail") == "exit":
            sys.exit(3)
        if data.get("fail"):
            raise ValueError(f"row {data['i']} failed")
        if data.get("reject"):
            return None
        return {"input_ids": torch.tensor([[data["i"]]]), "rewards": torch.tensor([float(data["i"])])}


@pytest.fixture
def make_executor():
    """Executors on one background loop, like the engine's; closed and the loop stopped after the test."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    made = []
    engine = object()

    def make(**kw) -> WorkflowExecutor:
        ex = WorkflowExecutor(StalenessManager.from_config(InferenceEngineConfig(**kw)), engine=engine)
        ex.attach(loop, thread)
        made.append(ex)
        return ex

    make.engine = engine
    yield make
    for ex in made:
        ex.close()

    async def cancel_all():
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _rewards(items):
    return [float(it["rewards"][0]) for it in items]


def _counters_agree(ex: WorkflowExecutor) -> None:
    """The StalenessManager's counters and the executor's own records describe the same episodes."""
    st, s = ex.stats(), ex.staleness
    assert s.running + s.sync_running == st["running"]
    assert s.ready == st["ready"]


def test_workflows_get_the_engine_and_results_come_in_submission_order(make_executor):
    ex = make_executor(consumer_batch_size=3, max_head_offpolicyness=0, max_concurrent_rollouts=3)
    wf = Echo()
    gate = threading.Event()  # row 0 finishes last for certain: it is released once rows 1 and 2 are ready
    try:
        for row in ({"i": 0, "gate": gate}, {"i": 1}, {"i": 2}):
            ex.submit(row, wf)
        deadline = time.monotonic() + 10
        while ex.stats()["ready"] < 2:
            assert time.monotonic() < deadline, ex.explain()
            time.sleep(0.005)
        assert ex.stats()["running"] == 1
    finally:  # a failed check must not leave row 0's thread waiting on the gate
        gate.set()
    assert _rewards(ex.wait(2, timeout=10)) == [0.0, 1.0]  # row 0 finished last but goes first
    assert _rewards(ex.wait(1, timeout=10)) == [2.0]
    assert wf.engines == {id(make_executor.engine)}
    _counters_agree(ex)
    assert ex.stats()["accepted"] == 3 and ex.stats()["consumed"] == 3


def test_the_bound_holds_episodes_until_set_version(make_executor):
    ex = make_executor(consumer_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=8)
    for i in range(4):
        ex.submit({"i": i}, Echo())
    assert _rewards(ex.wait(2, timeout=10)) == [0.0, 1.0]
    assert ex.stats()["queued"] == 2 and ex.stats()["capacity"] == 0
    assert "set_version(1)" in ex.explain() and "Queued: 2" in ex.explain()
    with pytest.raises(RuntimeError, match="staleness bound is reached"):
        ex.wait(2, timeout=10)
    ex.set_version(1)
    assert _rewards(ex.wait(2, timeout=10)) == [2.0, 3.0]
    assert ex.start_versions() == [0, 0, 1, 1]
    _counters_agree(ex)


def test_rollout_batch_is_outside_the_bound_and_in_input_order(make_executor):
    ex = make_executor(consumer_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=2)
    # The sleeps make later rows tend to finish first; input order holds however they finish.
    rows = [{"i": i, "sleep": 0.05 * (5 - i)} for i in range(5)] + [{"i": 5, "reject": True}]
    assert _rewards(ex.rollout_batch(rows, Echo())) == [0.0, 1.0, 2.0, 3.0, 4.0]
    st = ex.stats()
    assert (st["accepted"], st["sync_accepted"], st["rejected"], st["capacity"]) == (0, 5, 1, 2)
    _counters_agree(ex)
    with pytest.raises(ValueError, match="row 1 failed"):
        ex.rollout_batch([{"i": 0}, {"i": 1, "fail": True}], Echo())
    # SystemExit inside a workflow fails its batch like any error; re-raised on the loop, it would stop the loop
    with pytest.raises(RuntimeError, match="the workflow raised SystemExit: 3"):
        ex.rollout_batch([{"i": 0}, {"i": 1, "fail": "exit"}], Echo(), timeout=30)
    assert _rewards(ex.rollout_batch([{"i": 6}], Echo(), timeout=30)) == [6.0]  # the loop still runs episodes


def test_prepare_batch_with_eta_one_runs_ahead_by_one_version(make_executor):
    B = 2
    ex = make_executor(consumer_batch_size=B, max_head_offpolicyness=1, max_concurrent_rollouts=8)
    loader = [[{"i": 2 * k}, {"i": 2 * k + 1}] for k in range(3)]
    seen = []
    for v in range(4):
        seen += _rewards(ex.prepare_batch(loader, Echo(), timeout=10))
        time.sleep(0.02)  # "training": lets the pipeline draw ahead; the asserted order does not depend on it
        ex.set_version(v + 1)
    assert seen == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 1.0]
    starts = ex.start_versions()
    for v in range(5):
        assert sum(s <= v for s in starts) <= (1 + v + 1) * B, (v, starts)
    assert ex.data_epoch >= 1
    _counters_agree(ex)


def test_paused_executor_starts_nothing_and_says_so(make_executor):
    ex = make_executor(consumer_batch_size=1, max_head_offpolicyness=0)
    ex.set_paused(True)
    ex.submit({"i": 0}, Echo())
    assert "paused" in ex.explain()
    with pytest.raises(RuntimeError, match="paused"):
        ex.wait(1, timeout=10)
    ex.set_paused(False)
    assert _rewards(ex.wait(1, timeout=10)) == [0.0]
