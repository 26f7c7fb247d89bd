"""The vLLM backend without vLLM: the launcher's command and environment, the request and answer shapes, and the
client's calls against a stand-in for vLLM's HTTP API (part of `make test`; tests/test_vllm.py runs the real
server under `make test-vllm`).

The stand-in answers the endpoints the client uses with the shapes vLLM 0.32 answers (read from its source and
checked against the real server by tests/test_vllm.py): `/v1/models` owned by "vllm", `/v1/completions` with
`token_ids` and `logprobs.token_logprobs`, `/pause?mode=abort` returning running requests with `finish_reason:
"abort"` and their partial tokens, `/abort_requests` that only knows `cmpl-<id>-0`, `/collective_rpc`, a
`/reset_prefix_cache` that refuses once, and LoRA adapters loaded and unloaded by name (`/v1/load_lora_adapter`
answers plain text; an unknown adapter, or a folder without one, is a 404, as in vLLM), which a completion names in
`model`.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import threading

import pytest
from aiohttp import web

from areal_lite.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, load_expr_config, vLLMConfig
from areal_lite.api.io_struct import ModelRequest, WeightUpdateMeta
from areal_lite.engine.sglang_remote import RemoteSGLangEngine
from areal_lite.engine.vllm_client import RELOAD_METHOD, VLLMClient, completion_body, parse_completion
from areal_lite.engine.vllm_remote import RemotevLLMEngine
from areal_lite.infra.remote_inf_engine import EngineError
from areal_lite.kit.server import launch
from areal_lite.kit.server.procs import ServerLaunchError

PROMPT = [5, 6, 7]
HELD = 3  # tokens a "hold-*" request generates before it waits to be aborted


class FakeVLLM:
    """A stand-in for vLLM's server on a free port, in its own thread. Token i of a sequence is `len(prompt) + i`
    at logprob -0.5, so a request resumed from its partial output continues the same sequence. `held` is set once
    a "hold-*" request waits to be aborted: tests wait on it (with a timeout), not on a polling loop."""

    def __init__(self):
        self.calls: list = []  # (path with query, body)
        self.waiting: dict = {}  # internal id -> event set by an abort
        self.held = threading.Event()  # set when a request is in `waiting` (tests hold one at a time)
        self.sent = collections.Counter()  # internal id -> completions calls
        self.reset_refusals = 1
        self.adapters: dict = {}  # LoRA adapter name -> folder
        self.lora_routes = True  # False: started without --enable-lora, whose adapter routes answer FastAPI's 404
        self.loop = asyncio.new_event_loop()
        # The socket is bound here, on a port the OS picks, and served as is: no window between picking a free port
        # and binding it in which another process could take it.
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        app = web.Application()
        app.router.add_get("/health", lambda r: web.Response())
        app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "m", "owned_by": "vllm"}]}))
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora)
        for path in ("/pause", "/resume", "/abort_requests", "/collective_rpc", "/reset_prefix_cache"):
            app.router.add_post(path, self.control)
        self.runner = web.AppRunner(app)
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(60), "the stand-in server did not start"

    def _serve(self, ready):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.SockSite(self.runner, self.sock).start())
        ready.set()
        self.loop.run_forever()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.sock.close()

    def paths(self):
        return [p for p, _ in self.calls]

    async def completions(self, request):
        body = await request.json()
        self.calls.append(("/v1/completions", body))
        if body.get("model", "m") not in ("m", *self.adapters):
            return _not_found(f"The model `{body['model']}` does not exist.")
        internal = f"cmpl-{body['request_id']}-0"
        self.sent[internal] += 1
        start, n = len(body["prompt"]), body["max_tokens"]
        if body["request_id"].startswith("hold") and self.sent[internal] == 1:
            self.waiting[internal] = event = asyncio.Event()
            self.held.set()
            await event.wait()
            n, finish = HELD, "abort"
        else:
            finish = "length"
        tokens = [start + i for i in range(n)]
        choice = {"token_ids": tokens, "logprobs": {"token_logprobs": [-0.5] * n}, "finish_reason": finish}
        return web.json_response({"choices": [choice]})

    async def control(self, request):
        body = await request.json() if request.can_read_body else {}
        self.calls.append((request.path_qs, body))
        if request.path == "/pause" and request.query.get("mode") == "abort":
            for event in self.waiting.values():
                event.set()
        if request.path == "/abort_requests":
            for rid in body.get("request_ids", []):
                if rid in self.waiting:  # like vLLM: an id it does not know aborts nothing, and still answers 200
                    self.waiting[rid].set()
            return web.json_response({"status": "aborted", "aborted": len(body.get("request_ids", []))})
        if request.path == "/collective_rpc":
            return web.json_response({"results": [f"reloaded {body['args'][0]}"]})
        if request.path == "/reset_prefix_cache":
            ok = self.reset_refusals <= 0
            self.reset_refusals -= 1
            return web.json_response({"success": ok})
        return web.json_response({"status": "ok"})

    async def load_lora(self, request):
        body = await request.json()
        self.calls.append((request.path, body))
        if not self.lora_routes:
            return web.json_response({"detail": "Not Found"}, status=404)
        if not os.path.isfile(os.path.join(body["lora_path"], "adapter_config.json")):
            return _not_found(f"Loading lora {body['lora_name']} failed: No adapter found for {body['lora_path']}")
        self.adapters[body["lora_name"]] = body["lora_path"]
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload_lora(self, request):
        body = await request.json()
        self.calls.append((request.path, body))
        if self.adapters.pop(body["lora_name"], None) is None:
            return _not_found(f"The lora adapter '{body['lora_name']}' cannot be found.")
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")


def _not_found(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "NotFoundError", "code": 404}}, status=404)


@pytest.fixture
def fake():
    server = FakeVLLM()
    yield server
    server.close()


def _config(**kw) -> InferenceEngineConfig:
    return InferenceEngineConfig(request_timeout=30.0, setup_timeout=30.0, pause_poll_interval=0.01, **kw)


@pytest.fixture
def engine(fake):
    eng = RemoteSGLangEngine(_config()).initialize(addr=fake.address)
    yield eng
    eng.destroy()


def _gconfig(n: int, **kw) -> GenerationHyperparameters:
    return GenerationHyperparameters(max_new_tokens=n, greedy=True, **kw)


# ------------------------------------------------------------------------------------------------ shapes


def test_completion_body_has_the_sampling_of_sglangs_params():
    g = GenerationHyperparameters(max_new_tokens=9, temperature=0.7, top_p=0.9, stop=["</answer>"], stop_token_ids=[2])
    body = completion_body(g, PROMPT, 4, 1, "r1")
    assert body["prompt"] == PROMPT and body["request_id"] == "r1" and body["n"] == 1
    assert (body["max_tokens"], body["min_tokens"], body["temperature"], body["top_p"]) == (4, 1, 0.7, 0.9)
    assert body["top_k"] == 0  # vLLM's "all tokens"
    assert body["stop"] == ["</answer>"] and body["stop_token_ids"] == [2]
    assert body["logprobs"] == 0 and body["return_token_ids"] is True and body["skip_special_tokens"] is False
    greedy = completion_body(_gconfig(3), PROMPT, 3, 0, "r2")
    assert greedy["temperature"] == 0.0 and "stop" not in greedy


def test_areals_vllm_request_drops_stop_strings_ours_sends_them():
    """AReaL 1.0.4's `RemotevLLMEngine` builds vLLM's request without `stop` (its SGLang backend sends it): under it
    a turn runs past `</search>`. The kit's request has the same sampling fields, and the stop strings."""
    from areal.api.cli_args import GenerationHyperparameters as AReaLGeneration
    from areal.api.io_struct import ModelRequest as AReaLRequest
    from areal.engine.vllm_remote import VLLMBackend

    kw = dict(max_new_tokens=9, temperature=0.7, top_p=0.9, stop=["</search>"], stop_token_ids=[2])
    theirs = VLLMBackend().build_generation_request(AReaLRequest(input_ids=PROMPT, gconfig=AReaLGeneration(**kw)),
                                                    with_lora=False, version=0).payload  # fmt: skip
    ours = completion_body(GenerationHyperparameters(**kw), PROMPT, 9, 0, "r1")
    assert "stop" not in theirs and ours["stop"] == ["</search>"]
    for key in ("prompt", "max_tokens", "temperature", "top_p", "stop_token_ids", "logprobs"):
        assert theirs[key] == ours[key], key


def test_parse_completion_and_its_errors():
    answer = {"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "stop",
                           "stop_reason": "."}]}  # fmt: skip
    assert parse_completion(answer, "a") == ([1, 2], [-0.1, -0.2], "stop", ".", None)
    aborted = {"choices": [{"token_ids": [], "logprobs": None, "finish_reason": "abort"}]}
    assert parse_completion(aborted, "a")[:3] == ([], [], "abort")
    with pytest.raises(EngineError, match="choices"):
        parse_completion({"error": "x"}, "a")
    with pytest.raises(EngineError, match="logprobs"):
        parse_completion({"choices": [{"token_ids": [1], "logprobs": None, "finish_reason": "stop"}]}, "a")


# ------------------------------------------------------------------------------------------------ launcher


def test_vllm_command_and_environment(monkeypatch):
    cfg = vLLMConfig(model="m", dtype="float32", python="/opt/v/bin/python", threads=2, max_model_len=4096)
    cmd = launch._vllm_cmd(cfg, "127.0.0.1", 1234, "/models/m", seed=7, on_cpu=True)
    assert cmd[:3] == ["/opt/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model"] == "/models/m" and flags["--port"] == "1234" and flags["--seed"] == "7"
    assert flags["--dtype"] == "float32" and flags["--logprobs-mode"] == "processed_logprobs"
    assert flags["--generation-config"] == "vllm" and flags["--max-model-len"] == "4096"
    assert flags["--worker-extension-cls"] == "areal_lite_vllm_worker.WeightReloadExtension"
    assert "--enforce-eager" in cmd and cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    gpu = launch._vllm_cmd(cfg, "127.0.0.1", 1234, "/models/m", seed=None, on_cpu=False, tp_size=2)
    assert "--enforce-eager" not in gpu and gpu[gpu.index("--tensor-parallel-size") + 1] == "2"

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = {}
    launch._vllm_env(env, cfg, "/no/such/folder", on_cpu=True, tp_size=1, base_gpu_id=0)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "1"  # the launcher's cap wins over threads=2, as for the embedded server
    ext = env["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.isfile(os.path.join(ext, "areal_lite_vllm_worker.py"))
    assert sorted(f for f in os.listdir(ext) if f.endswith(".py")) == ["__init__.py", "areal_lite_vllm_worker.py"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = {}
    launch._vllm_env(env, cfg, "/no/such/folder", on_cpu=False, tp_size=1, base_gpu_id=1)
    assert env["CUDA_VISIBLE_DEVICES"] == "1"


def test_worker_extension_imports_without_the_kit():
    """It runs in vLLM's interpreter, where areal_lite is not installed: it may import nothing of the kit."""
    import ast

    path = os.path.join(launch._VLLM_EXT_DIR, "areal_lite_vllm_worker.py")
    tree = ast.parse(open(path).read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m and m.startswith("areal_lite")}


def test_missing_vllm_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "_KIT_ROOT", str(tmp_path))
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ServerLaunchError, match="make vllm"):
        launch._vllm_python(vLLMConfig())


def test_backend_vllm_from_overrides(monkeypatch):
    monkeypatch.setenv("AREAL_LITE_OVERRIDES", "backend=vllm")
    config, _ = load_expr_config(["actor.path=smollm2-135m-instruct", "actor.dtype=float32"], verbose=False)
    assert config.backend == "vllm"
    assert (config.vllm.model, config.vllm.dtype) == ("smollm2-135m-instruct", "float32")  # from the actor


# ------------------------------------------------------------------------------------------------ client


def test_engine_detects_vllm_and_generates(fake, engine):
    assert isinstance(engine._client, VLLMClient)
    resp = asyncio.run(engine.agenerate(ModelRequest(rid="r1", input_ids=PROMPT, gconfig=_gconfig(4))))
    assert resp.output_tokens == [3, 4, 5, 6] and resp.output_logprobs == [-0.5] * 4
    assert resp.output_versions == [0] * 4 and resp.stop_reason == "length"
    body = [b for p, b in fake.calls if p == "/v1/completions"][-1]
    assert body["request_id"] == "r1" and body["prompt"] == PROMPT


def test_pause_aborts_and_resume_continues_with_the_new_version(fake, engine):
    n = 8

    async def scenario():
        req = ModelRequest(rid="hold-1", input_ids=PROMPT, gconfig=_gconfig(n))
        task = asyncio.ensure_future(engine.agenerate(req))
        # The stand-in holds it after 3 tokens.
        assert await asyncio.to_thread(fake.held.wait, 60), "the stand-in never held the request"
        assert list(fake.waiting) == ["cmpl-hold-1-0"]
        await asyncio.to_thread(engine.pause)
        engine.set_version(1)
        # Kept: a correct client cannot finish while paused, however slow the machine; the 0.2 s gives a client
        # that wrongly re-sent (the stand-in answers a re-send at once) time to show it.
        await asyncio.sleep(0.2)
        assert not task.done()  # aborted with 3 tokens, waiting for resume
        await asyncio.to_thread(engine.resume)
        return await task

    resp = asyncio.run(scenario())
    assert resp.output_tokens == list(range(3, 3 + n)) and resp.stop_reason == "length"
    assert resp.output_versions == [0] * HELD + [1] * (n - HELD)
    assert "/pause?mode=abort" in fake.paths() and "/resume" in fake.paths()
    resent = [b for p, b in fake.calls if p == "/v1/completions"][-1]
    assert resent["prompt"] == PROMPT + [3, 4, 5] and resent["max_tokens"] == n - HELD


def test_weight_update_reloads_then_resets_the_prefix_cache(fake, engine, tmp_path):
    meta = WeightUpdateMeta.from_disk(path=str(tmp_path / "w"))
    os.makedirs(meta.dir_for(1))
    assert engine.update_weights(meta).result(10) == 1
    # Outside pause(): drain, reload, reset (refused once, retried), resume.
    assert fake.paths() == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/reset_prefix_cache",
                            "/resume"]  # fmt: skip
    rpc = dict(fake.calls)["/collective_rpc"]
    assert rpc == {"method": RELOAD_METHOD, "args": [meta.dir_for(1)]}

    fake.calls.clear()
    os.makedirs(meta.dir_for(2))
    engine.pause()
    engine.set_version(1)
    assert engine.update_weights(meta).result(10) == 2
    engine.resume()
    assert fake.paths() == ["/pause?mode=abort", "/collective_rpc", "/reset_prefix_cache", "/resume"]

    with pytest.raises(NotImplementedError, match="disk only"):
        engine.update_weights(WeightUpdateMeta.from_nccl("127.0.0.1", 29500))


def test_destroy_aborts_by_vllms_internal_id(fake):
    eng = RemotevLLMEngine(_config()).initialize(addr=fake.address)
    done = {}

    def run():
        done["resp"] = asyncio.run(eng.agenerate(ModelRequest(rid="hold-2", input_ids=PROMPT, gconfig=_gconfig(8))))

    worker = threading.Thread(target=run)
    worker.start()
    try:
        assert fake.held.wait(60), "the stand-in never held the request"
        assert list(fake.waiting) == ["cmpl-hold-2-0"]
    finally:  # what the test checks, and also what ends the worker if the request was never held
        eng.destroy()
    worker.join(60)
    assert not worker.is_alive()
    assert dict(fake.calls)["/abort_requests"] == {"request_ids": ["cmpl-hold-2-0"]}
    resp = done["resp"]
    assert resp.stop_reason == "abort" and resp.output_tokens == [3, 4, 5]  # partial output, not resumed


def test_vllm_engine_refuses_a_server_that_is_not_vllm(embedded_server):
    with pytest.raises(EngineError, match="not a vLLM server"):
        RemotevLLMEngine(_config()).initialize(addr=embedded_server.address)


def test_lora_adapters_load_by_version_and_requests_name_them(fake, tmp_path):
    """AReaL's LoRA over vLLM: each version's adapter folder is loaded as `<lora_name>-v<k>`, the version
    `lora_keep_versions` back is unloaded, and a request asks for the current version by name in `model`; a folder
    vLLM finds no adapter in is an error that carries vLLM's message, a server without adapter routes one that says
    how to start it."""
    eng = RemotevLLMEngine(_config(use_lora=True)).initialize(addr=fake.address)
    try:
        meta = WeightUpdateMeta.from_disk(path=str(tmp_path / "w"), use_lora=True, lora_name="ad", lora_keep_versions=2)
        for version in range(1, 5):  # the engine is at version 0: an update loads the next
            os.makedirs(meta.dir_for(version))
            open(os.path.join(meta.dir_for(version), "adapter_config.json"), "w").close()
            assert eng.update_weights(meta).result(10) == version
            eng.set_version(version)
        assert fake.adapters == {"ad-v3": meta.dir_for(3), "ad-v4": meta.dir_for(4)}
        # from version 2 on, the version two back: v0 was never loaded here (a 404, passed over: best effort)
        unloaded = [b["lora_name"] for p, b in fake.calls if p == "/v1/unload_lora_adapter"]
        assert unloaded == ["ad-v0", "ad-v1", "ad-v2"]
        resp = asyncio.run(eng.agenerate(ModelRequest(input_ids=PROMPT, gconfig=_gconfig(2, lora_name="ad"))))
        assert resp.output_tokens == [3, 4] and resp.output_versions == [4, 4]
        assert [b for p, b in fake.calls if p == "/v1/completions"][-1]["model"] == "ad-v4"

        os.makedirs(meta.dir_for(5))  # no adapter in it
        with pytest.raises(EngineError, match="No adapter found") as refused:
            eng.update_weights(meta).result(10)
        assert "--enable-lora" not in str(refused.value)  # vLLM's own 404: the server has its adapter routes
        fake.lora_routes = False  # a server started without them: the error says how to start one
        with pytest.raises(EngineError, match="HTTP 404.*--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            eng.update_weights(meta).result(10)
    finally:
        eng.destroy()


def test_vllm_lora_command_and_environment():
    cfg = vLLMConfig(model="m", python="/opt/v/bin/python", enable_lora=True, max_lora_rank=32,
                     lora_modules=["ad-v0=/a/v0"])  # fmt: skip
    cmd = launch._vllm_cmd(cfg, "127.0.0.1", 1234, "/models/m", seed=7, on_cpu=True)
    at = cmd.index("--enable-lora")
    assert cmd[at : at + 7] == ["--enable-lora", "--max-lora-rank", "32", "--max-loras", "8", "--lora-modules",
                                "ad-v0=/a/v0"]  # fmt: skip
    env = {}
    launch._vllm_env(env, cfg, "/no/such/folder", on_cpu=True, tp_size=1, base_gpu_id=0)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plain = vLLMConfig(model="m", python="/opt/v/bin/python")
    assert "--enable-lora" not in launch._vllm_cmd(plain, "127.0.0.1", 1234, "/models/m", seed=7, on_cpu=True)
    env = {}
    launch._vllm_env(env, plain, "/no/such/folder", on_cpu=True, tp_size=1, base_gpu_id=0)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
