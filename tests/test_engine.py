"""RemoteSGLangEngine against real embedded server processes: generation, interruption, weights, the executor.

Every test talks HTTP to `python -m areal_lite.kit.server` processes on the tiny model (one torch thread each). There is
no pytest-asyncio here, so async parts run under `asyncio.run` inside the test -- a foreign loop for the engine,
exactly like a notebook's top-level `await`. Extra servers (a second one with different weights, a scratch one for
weight updates, one to kill) are conftest's fixtures.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import signal
import threading
import time
import urllib.request

import pytest
import torch

from areal_lite.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal_lite.api.io_struct import ModelRequest, WeightUpdateMeta
from areal_lite.engine.sglang_remote import RemoteSGLangEngine
from areal_lite.infra.remote_inf_engine import ADDRS_ENV, EngineError
from areal_lite.kit.server.procs import find_free_port
from areal_lite.utils.data import concat_padded_tensors
from areal_lite.utils.trajectory import check_trajectory

PROMPT = [11, 523, 97, 1402, 36, 2210]


# ------------------------------------------------------------------------------------------------ helpers


def _config(**kw) -> InferenceEngineConfig:
    kw.setdefault("request_timeout", 60.0)
    kw.setdefault("setup_timeout", 60.0)
    return InferenceEngineConfig(**kw)


@pytest.fixture
def make_engine():
    """Engines made through this are destroyed at the end of the test, whatever happens."""
    engines = []

    def make(addr, **kw) -> RemoteSGLangEngine:
        eng = RemoteSGLangEngine(_config(**kw))
        engines.append(eng)
        eng.initialize(addr=addr)
        return eng

    yield make
    for eng in engines:
        eng.destroy()


def _greedy(n: int, **kw) -> GenerationHyperparameters:
    return GenerationHyperparameters(max_new_tokens=n, greedy=True, ignore_eos=True, **kw)


def _gen(eng: RemoteSGLangEngine, prompt=PROMPT, gconfig=None, rid=None):
    req = ModelRequest(input_ids=list(prompt), gconfig=gconfig or _greedy(8))
    if rid is not None:
        req.rid = rid
    return asyncio.run(eng.agenerate(req))


def _get_json(addr: str, endpoint: str) -> dict:
    with urllib.request.urlopen(f"http://{addr}{endpoint}", timeout=10) as r:
        return json.loads(r.read())


async def _until_generated(addr: str, count: int, timeout: float = 60.0) -> None:
    """Wait until the server has generated `count` more tokens than now (interrupt mid-generation, by data)."""
    start = (await asyncio.to_thread(_get_json, addr, "/server_info"))["generated_tokens"]
    deadline = time.monotonic() + timeout
    while (await asyncio.to_thread(_get_json, addr, "/server_info"))["generated_tokens"] < start + count:
        assert time.monotonic() < deadline, "the server generated nothing"
        await asyncio.sleep(0.005)


def _until_running(addr: str, count: int, timeout: float = 60.0) -> None:
    """Wait until the server runs exactly `count` requests (0: idle, so token counts afterwards are ours alone; a
    request left running by an earlier test on this shared server would otherwise advance `_until_generated`)."""
    deadline = time.monotonic() + timeout
    while _get_json(addr, "/server_info")["num_running"] != count:
        assert time.monotonic() < deadline, f"the server never ran {count} requests: {_get_json(addr, '/server_info')}"
        time.sleep(0.005)


def _until(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _episode(resp, reward: float) -> dict:
    """The tensor contract for one generation: prompt then output, [1, L] tensors."""
    n_in, n_out = resp.input_len, resp.output_len
    return {
        "input_ids": torch.tensor([resp.input_tokens + resp.output_tokens], dtype=torch.long),
        "attention_mask": torch.ones(1, n_in + n_out, dtype=torch.bool),
        "loss_mask": torch.tensor([[0] * n_in + [1] * n_out], dtype=torch.long),
        "logprobs": torch.tensor([[0.0] * n_in + resp.output_logprobs], dtype=torch.float32),
        "versions": torch.tensor([[-1] * n_in + resp.output_versions], dtype=torch.long),
        "rewards": torch.tensor([reward], dtype=torch.float32),
    }


class OneTurn:
    """One generation per row. Row keys: i (reward = i unless `reward`), fail (raise), reject (return None), gate (a
    threading.Event the episode waits for before generating: it runs, and cannot finish until the test opens it)."""

    def __init__(self, max_new_tokens: int = 6, greedy: bool = False):
        self.gconfig = GenerationHyperparameters(max_new_tokens=max_new_tokens, greedy=greedy, ignore_eos=True)

    async def arun_episode(self, engine, data):
        gate = data.get("gate")
        if gate is not None:  # waited on where it is set, not polled; 60 s: a test that never opens it fails the row
            assert await asyncio.to_thread(gate.wait, 60), f"row {data['i']}: the gate was never opened"
        prompt = PROMPT[:3] + [100 + data["i"]]
        resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=self.gconfig))
        if data.get("fail"):
            raise ValueError(f"workflow failed on row {data['i']}")
        if data.get("reject"):
            return None
        return _episode(resp, float(data.get("reward", data["i"])))


def _perturbed_copy(src: str, dst: str, seed: int = 1, scale: float = 0.5) -> str:
    """Save the tiny model with noise added to every weight (config + safetensors only)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp_min(1e-3))
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def perturbed_path(tiny_model_path, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("perturbed") / "model")
    _perturbed_copy(tiny_model_path, path)
    for name in os.listdir(tiny_model_path):  # the server needs the tokenizer files too
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(os.path.join(tiny_model_path, name), path)
    return path


@pytest.fixture(scope="module")
def server_b(perturbed_path, serve):
    """A second server holding different weights: its greedy output tells which server answered."""
    with serve(perturbed_path) as handle:
        yield handle


# ------------------------------------------------------------------------------------------------ agenerate


def test_agenerate_shapes_versions_and_reference(make_engine, embedded_server, tiny_model_path):
    eng = make_engine(embedded_server.address)
    resp = _gen(eng, gconfig=_greedy(8))
    assert resp.input_tokens == PROMPT
    assert resp.output_len == len(resp.output_logprobs) == len(resp.output_versions) == 8
    assert resp.stop_reason == "length"
    assert resp.output_versions == [0] * 8
    assert all(lp <= 0.0 for lp in resp.output_logprobs)
    assert 0.0 < resp.ttft <= resp.latency < 60

    # Greedy is deterministic through the client, and matches the model run locally with transformers.
    again = _gen(eng, gconfig=_greedy(8))
    assert again.output_tokens == resp.output_tokens
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    ref_tokens, ref_lps = [], []
    with torch.no_grad():
        for _ in range(8):
            logp = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
            tok = int(logp.argmax())
            ref_tokens.append(tok)
            ref_lps.append(float(logp[tok]))
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    assert resp.output_tokens == ref_tokens
    assert resp.output_logprobs == pytest.approx(ref_lps, abs=1e-3)

    eng.set_version(3)  # the server reports no integer weight_version yet: tokens carry the engine's version
    assert _gen(eng, gconfig=_greedy(3)).output_versions == [3, 3, 3]


def test_agenerate_from_own_loop_and_executor_together(make_engine, embedded_server):
    eng = make_engine(embedded_server.address, consumer_batch_size=4, max_concurrent_rollouts=4)

    async def scenario():
        batch_job = asyncio.to_thread(eng.rollout_batch, [{"i": i} for i in range(4)], OneTurn())
        reqs = [eng.agenerate(ModelRequest(input_ids=PROMPT, gconfig=_greedy(5))) for _ in range(3)]
        return await asyncio.gather(batch_job, *reqs)

    batch, *resps = asyncio.run(scenario())
    assert len(batch) == 4 and concat_padded_tensors(batch)["input_ids"].shape[0] == 4
    assert all(r.output_len == 5 for r in resps)
    assert len({tuple(r.output_tokens) for r in resps}) == 1  # concurrent greedy requests agree


def test_n_samples_must_be_one(make_engine, embedded_server):
    eng = make_engine(embedded_server.address)
    with pytest.raises(ValueError, match="n_samples"):
        _gen(eng, gconfig=GenerationHyperparameters(n_samples=2, max_new_tokens=4))


def test_client_error_is_immediate_and_server_stays_up(make_engine, embedded_server):
    # 10 retries with backoff (0.1 s doubling, at most 5 s) would take over 26 s: the bound below tells a retried 4xx
    # from one raised at once, with room for a loaded machine (5 retries took only 3.1 s: a bound cannot see them).
    eng = make_engine(embedded_server.address, request_retries=10)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="top_p") as info:
        _gen(eng, gconfig=GenerationHyperparameters(max_new_tokens=4, top_p=0.0))
    assert info.value.status == 400
    assert time.monotonic() - t0 < 15  # not retried with backoff
    assert _gen(eng, gconfig=_greedy(2)).output_len == 2


def test_rid_affinity_across_two_servers(make_engine, embedded_server, server_b):
    a, b = embedded_server.address, server_b.address
    out_a = _gen(make_engine(a)).output_tokens
    out_b = _gen(make_engine(b)).output_tokens
    assert out_a != out_b  # different weights: the output names the server

    eng = make_engine([a, b])
    first = _gen(eng, rid="conversation-1").output_tokens
    pinned = eng.server_for("conversation-1")
    assert first == (out_a if pinned == a else out_b)
    for _ in range(3):  # the same rid always lands on the same server
        assert _gen(eng, rid="conversation-1").output_tokens == first
    fresh = [_gen(eng, rid=f"new-{k}").output_tokens for k in range(4)]
    assert fresh[0] != fresh[1] and fresh[0] == fresh[2] and fresh[1] == fresh[3]  # round-robin
    assert {tuple(out_a), tuple(out_b)} == {tuple(x) for x in fresh}


# ------------------------------------------------------------------------------------------------ pause / resume


def test_pause_mid_generation_resumes_with_new_version(make_engine, embedded_server):
    eng = make_engine(embedded_server.address, pause_poll_interval=0.01)
    # The tiny model writes ~1700 tokens/s: 300 tokens left the pause a 0.15 s window to land in before the request
    # finished. 1000 leave it half a second; the pause lands within ~10 tokens of the 20 awaited.
    n = 1000
    reference = _gen(eng, gconfig=_greedy(n))

    async def scenario():
        await asyncio.to_thread(_until_running, embedded_server.address, 0)
        progress = asyncio.ensure_future(_until_generated(embedded_server.address, 20))
        task = asyncio.ensure_future(eng.agenerate(ModelRequest(input_ids=PROMPT, gconfig=_greedy(n))))
        await progress
        await asyncio.to_thread(eng.pause)
        eng.set_version(1)
        # Kept: the request is held for 0.3 s (latency > 0.3 below); a request that wrongly re-sent while paused
        # would finish in this time. A correct one cannot, however slow the machine.
        await asyncio.sleep(0.3)
        assert not task.done()  # an aborted request waits while the engine is paused
        await asyncio.to_thread(eng.resume)
        return await task

    resp = asyncio.run(scenario())
    assert resp.stop_reason == "length"
    assert resp.output_len == len(resp.output_logprobs) == len(resp.output_versions) == n
    k = resp.output_versions.index(1)
    assert 0 < k < n, "the pause did not land mid-generation"
    assert resp.output_versions == [0] * k + [1] * (n - k)  # tokens after the resume carry the new version
    assert resp.output_tokens == reference.output_tokens  # greedy: the resumed request continues seamlessly
    assert resp.output_logprobs == pytest.approx(reference.output_logprobs, abs=1e-3)
    assert resp.latency > 0.3 and resp.ttft < resp.latency


def _post_json(addr: str, endpoint: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://{addr}{endpoint}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip() else {}


def test_server_side_abort_is_resumed(make_engine, embedded_server):
    """An abort the engine did not ask for (here /abort_request by rid) is resumed too: nothing is lost."""
    eng = make_engine(embedded_server.address)
    n = 1000  # long enough that the abort lands mid-generation on a fast machine too (see the pause test)
    reference = _gen(eng, gconfig=_greedy(n))

    async def scenario():
        await asyncio.to_thread(_until_running, embedded_server.address, 0)
        req = ModelRequest(rid="aborted-once", input_ids=PROMPT, gconfig=_greedy(n))
        info = await asyncio.to_thread(_get_json, embedded_server.address, "/server_info")
        aborted_before = info["aborted_requests"]
        progress = asyncio.ensure_future(_until_generated(embedded_server.address, 20))
        task = asyncio.ensure_future(eng.agenerate(req))
        await progress
        await asyncio.to_thread(_post_json, embedded_server.address, "/abort_request", {"rid": "aborted-once"})
        resp = await task
        info = await asyncio.to_thread(_get_json, embedded_server.address, "/server_info")
        assert info["aborted_requests"] == aborted_before + 1  # it really was cut, and resumed
        return resp

    resp = asyncio.run(scenario())
    assert resp.stop_reason == "length" and resp.output_len == n
    assert resp.output_tokens == reference.output_tokens
    assert resp.output_versions == [0] * n


# ------------------------------------------------------------------------------------------------ weights


def test_update_weights_from_disk(make_engine, perturbed_path, server_b, tmp_path, cold_server):
    scratch = cold_server
    eng = make_engine(scratch.address)
    before = _gen(eng).output_tokens
    meta = WeightUpdateMeta.from_disk(path=str(tmp_path / "weights"))
    fut = eng.update_weights(meta)
    # It waits for the trainer to publish v1: the future itself is watched for 0.3 s, so an update that does not
    # wait (or fails at once) shows itself here, the moment it does.
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.3)

    # Publish like the trainer: write to a temporary folder, then rename it into place.
    tmp_dir = str(tmp_path / "weights" / ".v1.tmp")
    shutil.copytree(perturbed_path, tmp_dir)
    os.rename(tmp_dir, meta.dir_for(1))
    assert fut.result(timeout=60) == 1
    assert str(_get_json(scratch.address, "/model_info")["weight_version"]) == "1"

    eng.set_version(1)
    after = _gen(eng)
    assert after.output_tokens != before
    assert after.output_tokens == _gen(make_engine(server_b.address)).output_tokens  # the same weights now
    assert after.output_versions == [1] * after.output_len

    # A broken checkpoint: the future raises with the server's message, and the server keeps serving.
    broken = meta.dir_for(2)
    os.makedirs(broken)
    with open(os.path.join(broken, "config.json"), "w") as fh:
        fh.write("{not json")
    with pytest.raises(EngineError) as broken_err:
        eng.update_weights(meta).result(timeout=60)
    assert broken_err.value.status is not None and "no server answers" not in str(broken_err.value)  # it answered
    assert _gen(eng).output_tokens == after.output_tokens

    # The server gone (a notebook's server cell run again replaces it): the error says which engine to connect.
    scratch.stop()
    shutil.copytree(perturbed_path, meta.dir_for(3))
    with pytest.raises(EngineError, match=r"no server answers there.*actor\.connect_engine\(engine, meta\)"):
        eng.update_weights(meta).result(timeout=60)


def test_update_weights_nccl_needs_param_specs(make_engine, embedded_server):
    eng = make_engine(embedded_server.address)
    with pytest.raises(NotImplementedError, match="names"):
        eng.update_weights(WeightUpdateMeta.from_nccl("127.0.0.1", 29500))


# ------------------------------------------------------------------------------------------------ failures


def _server_pid(handle) -> int:
    for attr in ("process", "proc", "popen"):
        proc = getattr(handle, attr, None)
        if proc is not None and hasattr(proc, "pid"):
            return proc.pid
    return int(handle.pid)


def test_server_killed_mid_rollout_raises_in_time(make_engine, cold_server):
    victim = cold_server
    eng = make_engine(victim.address, request_timeout=8.0, request_retries=3)

    async def scenario():
        progress = asyncio.ensure_future(_until_generated(victim.address, 20))
        task = asyncio.ensure_future(eng.agenerate(ModelRequest(input_ids=PROMPT, gconfig=_greedy(4000))))
        await progress  # mid-generation by data, not after a guessed 0.5 s (4000 tokens take seconds)
        assert not task.done()
        os.kill(_server_pid(victim), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=victim.address):
            await asyncio.wait_for(task, timeout=30)
        return time.monotonic() - t0

    assert asyncio.run(scenario()) < 9.0  # within the 8 s request budget (here: under 1 s)


def test_initialize_errors(monkeypatch):
    monkeypatch.delenv(ADDRS_ENV, raising=False)
    with pytest.raises(ValueError, match=ADDRS_ENV):
        RemoteSGLangEngine(_config()).initialize()
    before = set(threading.enumerate())
    dead = f"127.0.0.1:{find_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=dead):
        RemoteSGLangEngine(_config(setup_timeout=1.0)).initialize(addr=dead)
    assert time.monotonic() - t0 < 15  # the 1 s setup_timeout, not the 60 s default (room for a loaded machine)
    assert set(threading.enumerate()) <= before  # the failed engine cleaned up its thread


def test_address_from_environment_and_destroy_is_idempotent(monkeypatch, embedded_server):
    before = set(threading.enumerate())
    monkeypatch.setenv(ADDRS_ENV, embedded_server.address)
    eng = RemoteSGLangEngine(_config())  # by hand, not make_engine: initialize() reads the address from the env
    try:
        eng.initialize()
        assert eng.addresses == [embedded_server.address]
        assert _gen(eng, gconfig=_greedy(2)).output_len == 2
        _until_running(embedded_server.address, 0)
        eng.submit({"i": 0}, OneTurn(max_new_tokens=2000))  # still running when destroyed: it gets cancelled
        pending = {}
        caller = threading.Thread(target=lambda: pending.setdefault("resp", _gen(eng, gconfig=_greedy(2000))))
        caller.start()  # a request from another thread's loop, in flight during destroy()
        # Both requests on the server before counting tokens: 100 tokens could otherwise all be the episode's, with
        # the caller's request not yet sent (then it has no output, or is refused as destroyed).
        _until_running(embedded_server.address, 2)
        asyncio.run(_until_generated(embedded_server.address, 100))
        eng.destroy()
        eng.destroy()
        caller.join(timeout=60)
        assert not caller.is_alive()
        assert pending["resp"].stop_reason == "abort"  # handed back, not hung or raised
        assert 0 < pending["resp"].output_len < 2000
        assert set(threading.enumerate()) <= before
        with pytest.raises(RuntimeError, match="destroyed"):
            _gen(eng)
    finally:  # idempotent: a failed check must not leave the engine, or its 2000-token requests, on the shared server
        eng.destroy()


def test_a_dropped_engine_closes_its_session_and_ends_its_thread(embedded_server):
    """A notebook cell that makes an engine, run again, drops the first one without destroy(): once collected, it
    closes its HTTP session and its loop, and its thread ends (held by nothing else, the thread would idle forever)."""
    before = set(threading.enumerate())
    eng = RemoteSGLangEngine(_config()).initialize(addr=embedded_server.address)
    assert _gen(eng, gconfig=_greedy(2)).output_len == 2
    thread, loop, session = eng._thread, eng._loop, eng._client._session
    assert thread.is_alive() and not session.closed
    del eng
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert session.closed and loop.is_closed()
    assert set(threading.enumerate()) <= before


# ------------------------------------------------------------------------------------------------ executor


def test_rollout_batch_order_and_contract(make_engine, embedded_server):
    eng = make_engine(embedded_server.address, consumer_batch_size=4, max_concurrent_rollouts=2)
    batch = concat_padded_tensors(eng.rollout_batch([{"i": i} for i in range(4)], OneTurn()))
    assert batch["input_ids"].shape[0] == 4
    assert batch["rewards"].tolist() == [0.0, 1.0, 2.0, 3.0]  # input order
    assert check_trajectory(batch)
    assert (batch["versions"][batch["loss_mask"].bool()] == 0).all()
    stats = eng.stats()
    assert stats["sync_accepted"] == 4 and stats["running"] == 0 and stats["consumed"] == 4
    # Synchronous episodes are consumed at once (staleness 0), so they do not use up the async bound ...
    assert stats["accepted"] == 0 and stats["capacity"] == 2

    # ... and a batch larger than (eta + 1) * B (an evaluation, say) runs, max_concurrent_rollouts at a time.
    peak = {"n": 0, "now": 0}

    class Counting(OneTurn):
        async def arun_episode(self, engine, data):
            peak["now"] += 1
            peak["n"] = max(peak["n"], peak["now"])
            try:
                return await super().arun_episode(engine, data)
            finally:
                peak["now"] -= 1

    big = concat_padded_tensors(eng.rollout_batch([{"i": i} for i in range(12)], Counting()))
    assert big["rewards"].tolist() == [float(i) for i in range(12)]
    assert peak["n"] == 2
    assert eng.stats()["accepted"] == 0


def test_should_accept_and_none_drop_episodes(make_engine, embedded_server):
    eng = make_engine(embedded_server.address, consumer_batch_size=6, max_concurrent_rollouts=6)
    rows = [{"i": i} for i in range(5)] + [{"i": 5, "reject": True}]
    batch = concat_padded_tensors(
        eng.rollout_batch(rows, OneTurn(), should_accept_fn=lambda r: int(r["rewards"][0]) % 2 == 0)
    )
    assert batch["rewards"].tolist() == [0.0, 2.0, 4.0]
    assert eng.stats()["rejected"] == 3 and eng.stats()["sync_accepted"] == 3

    # Through submit/wait: rejected episodes are not counted, and waiting for more than can come fails loudly.
    eng.set_version(1)
    for r in ({"i": 1}, {"i": 2}, {"i": 3, "reject": True}):
        eng.submit(r, OneTurn(), should_accept_fn=lambda r: int(r["rewards"][0]) != 1)
    assert concat_padded_tensors(eng.wait(1, timeout=60))["rewards"].tolist() == [2.0]
    with pytest.raises(RuntimeError, match="nothing is running or queued"):
        concat_padded_tensors(eng.wait(1, timeout=60))


def test_workflow_exception_reaches_the_caller(make_engine, embedded_server):
    eng = make_engine(embedded_server.address, consumer_batch_size=4, max_concurrent_rollouts=4)
    rows = [{"i": 0}, {"i": 1, "fail": True}, {"i": 2}]
    with pytest.raises(ValueError, match="workflow failed on row 1") as info:
        concat_padded_tensors(eng.rollout_batch(rows, OneTurn()))
    assert any(entry.name == "arun_episode" for entry in info.traceback)  # the workflow's own frame
    eng.submit({"i": 3, "fail": True}, OneTurn())
    with pytest.raises(ValueError, match="row 3"):
        concat_padded_tensors(eng.wait(1, timeout=60))
    assert eng.stats()["failed"] == 2


def test_wait_timeout_reports_counts_and_loses_nothing(make_engine, embedded_server):
    eng = make_engine(embedded_server.address)
    gate = threading.Event()  # the episode cannot finish inside the 0.01 s wait, however fast the machine
    try:
        eng.submit({"i": 7, "gate": gate}, OneTurn(max_new_tokens=60))
        _until(lambda: eng.stats()["running"] == 1, "the episode never started")  # started, not still queued
        with pytest.raises(TimeoutError, match="running 1"):
            concat_padded_tensors(eng.wait(1, timeout=0.01))
    finally:
        gate.set()
    assert concat_padded_tensors(eng.wait(1, timeout=60))["rewards"].tolist() == [7.0]


def test_wait_takes_episodes_in_submission_order_even_when_a_later_one_finishes_first(make_engine, embedded_server):
    """A slow early episode is not passed over: otherwise it could be consumed more than eta versions stale."""
    eng = make_engine(
        embedded_server.address, consumer_batch_size=2, max_concurrent_rollouts=4, max_head_offpolicyness=1
    )
    # Row 0 is held by a gate until rows 1 and 2 are done (a fixed 1.5 s head start raced them on a loaded machine).
    gate = threading.Event()
    try:
        for row in ({"i": 0, "gate": gate}, {"i": 1}, {"i": 2}):
            eng.submit(row, OneTurn(max_new_tokens=3))
        _until(lambda: eng.stats()["ready"] >= 2, "rows 1 and 2 did not finish")
        assert eng.stats()["ready"] == 2 and eng.stats()["running"] == 1  # rows 1 and 2 done, row 0 still running
        eng.pause()
        with pytest.raises(RuntimeError, match="paused"):  # row 0 must go first, and it cannot finish while paused
            concat_padded_tensors(eng.wait(2, timeout=60))
        eng.resume()
    finally:
        gate.set()
    assert concat_padded_tensors(eng.wait(2, timeout=60))["rewards"].tolist() == [0.0, 1.0]
    assert concat_padded_tensors(eng.wait(1, timeout=60))["rewards"].tolist() == [2.0]


@pytest.mark.parametrize("eta", [0, 1])
def test_prepare_batch_respects_staleness_bound(make_engine, embedded_server, eta):
    """Simulate the trainer: prepare_batch, "train", set_version(v + 1). The bound must hold at every version."""
    B, steps = 2, 5
    eng = make_engine(
        embedded_server.address, consumer_batch_size=B, max_concurrent_rollouts=4, max_head_offpolicyness=eta
    )
    loader = [[{"i": 2 * k}, {"i": 2 * k + 1}] for k in range(3)]  # 3 batches: step 4 is in the second epoch
    seen, staleness = [], []
    for v in range(steps):
        batch = concat_padded_tensors(eng.prepare_batch(loader, OneTurn(max_new_tokens=4)))
        assert batch["input_ids"].shape[0] == B
        assert check_trajectory(batch)
        token_versions = batch["versions"][batch["loss_mask"].bool()]
        staleness.append(v - int(token_versions.min()))
        seen += batch["rewards"].tolist()
        time.sleep(0.05)  # "training" (scenario, not synchronisation: every start is scheduled before a result)
        eng.set_version(v + 1)
    starts = eng.start_versions()
    for v in range(steps + 1):  # episodes started by version v never exceed (eta + v + 1) * B
        assert sum(s <= v for s in starts) <= (eta + v + 1) * B, (v, starts)
    assert max(staleness) <= eta  # no consumed token is more than eta versions old
    assert eng.data_epoch >= 1  # the iterator restarted (more with eta=1: the pipeline draws ahead)
    if eta == 0:  # synchronous: exactly one batch in flight, consumed in data order
        assert seen == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 1.0, 2.0, 3.0]
        assert starts[: 2 * steps] == [v for v in range(steps) for _ in range(B)]
    else:  # asynchronous: the pipeline ran ahead to the bound, and off-policy data was really consumed
        assert sum(s == 0 for s in starts) == (eta + 1) * B
        assert max(staleness) == 1


def test_prepare_batch_without_set_version_fails_loudly(make_engine, embedded_server):
    eng = make_engine(embedded_server.address, consumer_batch_size=2)
    loader = [[{"i": 0}, {"i": 1}], [{"i": 2}, {"i": 3}]]
    concat_padded_tensors(eng.prepare_batch(loader, OneTurn(max_new_tokens=3)))
    with pytest.raises(RuntimeError, match="set_version"):
        concat_padded_tensors(eng.prepare_batch(loader, OneTurn(max_new_tokens=3)))
    explained = eng.explain()  # the same diagnosis in words, with the numbers
    assert "(0 + 0 - 0 + 1) * 2 = 2" in explained and "2 accepted" in explained and "set_version(1)" in explained
    eng.set_version(1)  # the queued rows were kept: the next step proceeds
    assert concat_padded_tensors(eng.prepare_batch(loader, OneTurn(max_new_tokens=3)))["rewards"].tolist() == [2.0, 3.0]


def test_staleness_counts_from_the_first_version_of_a_resumed_run(make_engine, embedded_server):
    """A trainer resumed at step 5 sets version 5 first: that must not open room for (5 + 1) * B stale episodes."""
    B = 2
    eng = make_engine(embedded_server.address, consumer_batch_size=B, max_concurrent_rollouts=8)
    eng.set_version(5)
    loader = [[{"i": 2 * k}, {"i": 2 * k + 1}] for k in range(4)]
    for v in (5, 6, 7):
        batch = concat_padded_tensors(eng.prepare_batch(loader, OneTurn(max_new_tokens=3)))
        assert (batch["versions"][batch["loss_mask"].bool()] == v).all()  # eta = 0: always fresh
        eng.set_version(v + 1)
    assert eng.stats()["base_version"] == 5
    assert "version 8, counted from v0=5" in eng.explain()
    assert eng.start_versions()[:6] == [5, 5, 6, 6, 7, 7]


# ---------------------------------------------------------------------------------------------- AReaL's call forms


def test_initialize_takes_areals_order_and_refuses_an_address_as_engine_id(embedded_server):
    eng = RemoteSGLangEngine(_config())
    with pytest.raises(TypeError, match=r"engine.initialize\(addr=\.\.\.\)"):
        eng.initialize(embedded_server.address)
    eng.initialize("my-engine", addr=embedded_server.address)  # AReaL: engine_id first, then addr
    try:
        assert eng.engine_id == "my-engine" and eng.addresses == [embedded_server.address]
    finally:
        eng.destroy()


def test_workflow_forms_group_size_and_list_results(make_engine, embedded_server):
    """An instance, a class + workflow_kwargs, or an import path; group_size=G gives G contiguous rows per row."""
    eng = make_engine(embedded_server.address, consumer_batch_size=2, max_concurrent_rollouts=8)
    rows = [{"i": i} for i in range(3)]
    for workflow, kwargs in [
        (OneTurn(max_new_tokens=2), None),
        (OneTurn, {"max_new_tokens": 2}),
        (f"{__name__}.OneTurn", {"max_new_tokens": 2}),
    ]:
        items = eng.rollout_batch(rows, workflow=workflow, workflow_kwargs=kwargs, group_size=2)
        assert isinstance(items, list) and len(items) == 3
        assert [it["input_ids"].shape[0] for it in items] == [2, 2, 2]
        assert [it["rewards"].tolist() for it in items] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]  # input order
    with pytest.raises(ValueError, match="workflow_kwargs is required"):
        eng.rollout_batch(rows, workflow=OneTurn)
    with pytest.raises(ValueError, match="group_size"):
        eng.rollout_batch(rows, workflow=OneTurn(), group_size=0)


def test_agenerate_accepts_areals_own_request_objects(make_engine, embedded_server, tiny_model_path):
    from areal.api.cli_args import GenerationHyperparameters as AReaLGConfig
    from areal.api.io_struct import ModelRequest as AReaLModelRequest
    from transformers import AutoTokenizer

    eng = make_engine(embedded_server.address)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    req = AReaLModelRequest(input_ids=list(PROMPT), gconfig=AReaLGConfig(greedy=True, max_new_tokens=4), tokenizer=tok)
    resp = asyncio.run(eng.agenerate(req))
    kit = _gen(eng, gconfig=_greedy(4))
    assert resp.output_tokens == kit.output_tokens and resp.tokenizer is tok
    short = AReaLModelRequest(
        input_ids=list(PROMPT), gconfig=AReaLGConfig(greedy=True, max_new_tokens=50, max_tokens=len(PROMPT) + 3)
    )
    assert asyncio.run(eng.agenerate(short)).output_len == 3  # max_tokens bounds prompt + output, as in AReaL
