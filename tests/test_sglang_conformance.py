"""Conformance with the pinned SGLang release (0.5.23), checked against SGLang's own code on a CPU machine.

1. `SGLangConfig.build_cmd` emits argv that SGLang's real parser (`ServerArgs.add_cli_args`) accepts, and the
   parser rejects flags SGLang removed (so the check has teeth).
2. Request and response bodies of the embedded server decode under SGLang's JSON contract
   (`python/sglang/api/v1/api_types.py`, msgspec structs generated from SGLang's protobuf schema), and bodies that
   contract rejects are rejected by the embedded server too.

Needs `pip install --no-deps sglang==0.5.23` plus `orjson pybase64 starlette` (CPU only; no CUDA wheels). Triton
is not needed: SGLang's own macOS stand-in for it (`sglang/_platform_stubs.py`) is installed in the parser's
subprocess. The parser runs in a subprocess because importing `sglang` patches `transformers` in the importing
process; `api_types.py` is loaded by file path and needs only msgspec.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from areal_lite.api.cli_args import GenerationHyperparameters, GRPOConfig, SGLangConfig, reconcile_lora
from areal_lite.infra.remote_inf_engine import sampling_params

SGLANG_VERSION = "0.5.23"
INSTALL_HINT = (
    f"the SGLang conformance test needs `pip install --no-deps sglang=={SGLANG_VERSION} orjson pybase64 starlette`"
)


def sglang_dir() -> str:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"sglang is not installed: {INSTALL_HINT}")
    return list(spec.submodule_search_locations)[0]


def test_pinned_version():
    from importlib.metadata import version

    sglang_dir()
    assert version("sglang") == SGLANG_VERSION, INSTALL_HINT


# ----------------------------------------------------------------------------------------------------------------
# 1. the command line

PARSE_SCRIPT = r"""
import argparse, contextlib, importlib.util, io, json, os, sys

root = list(importlib.util.find_spec("sglang").submodule_search_locations)[0]
if importlib.util.find_spec("triton") is None:
    # SGLang's own Triton stand-in (used on macOS), loaded by path; enough to import the argument parser.
    spec = importlib.util.spec_from_file_location("_sglang_platform_stubs", os.path.join(root, "_platform_stubs.py"))
    stubs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stubs
    spec.loader.exec_module(stubs)
    sys.meta_path.insert(0, stubs._TritonFinder())
    for name in ["triton", "triton.language", "triton.language.extra", "triton.language.extra.libdevice",
                 "triton.runtime", "triton.runtime.jit", "triton.runtime.cache", "triton.runtime.autotuner",
                 "triton.runtime.driver", "triton.compiler", "triton.compiler.compiler", "triton.testing",
                 "triton.tools", "triton.tools.tensor_descriptor", "triton.backends", "triton.backends.compiler"]:
        mod = stubs._make_mock(name)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)
    sys.modules["triton"].__version__ = "3.0.0"
    sys.modules["triton"].next_power_of_2 = stubs._next_power_of_2
    sys.modules["triton"].cdiv = stubs._cdiv

import types

from sglang.srt.arg_groups.lora_hook import check_lora_server_args
from sglang.srt.server_args import ServerArgs


def lora_check(ns):  # SGLang's own start-up check of the LoRA arguments, on the parsed values (no GPU needed)
    if not ns.enable_lora:
        return None
    try:
        check_lora_server_args(types.SimpleNamespace(**vars(ns)))
        return "ok"
    except (AssertionError, ValueError) as e:
        return str(e)


results = []
for argv in json.load(sys.stdin):
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
        plain = (str, int, float, bool, type(None))
        args = {k: v for k, v in vars(ns).items() if isinstance(v, plain)}
        results.append({"ok": True, "args": args, "lora": lora_check(ns)})
    except SystemExit as e:
        results.append({"ok": False, "code": e.code, "stderr": err.getvalue()[-400:]})
print("RESULTS " + json.dumps(results))
"""


def parse_with_sglang(argvs: list[list[str]]) -> list[dict]:
    sglang_dir()
    proc = subprocess.run(
        [sys.executable, "-c", PARSE_SCRIPT], input=json.dumps(argvs), capture_output=True, text=True, timeout=300,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )  # fmt: skip
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULTS ")), None)
    assert line is not None, f"SGLang's parser could not be loaded ({INSTALL_HINT}):\n{proc.stderr[-3000:]}"
    return json.loads(line[len("RESULTS ") :])


def all_bools_true() -> SGLangConfig:
    cfg = SGLangConfig(model_path="/models/m")
    for f in dataclasses.fields(cfg):
        if isinstance(getattr(cfg, f.name), bool):
            setattr(cfg, f.name, True)
    return cfg


def all_optionals_set() -> SGLangConfig:
    return SGLangConfig(
        model_path="/models/m", context_length=8192, max_running_requests=64, chunked_prefill_size=4096,
        attention_backend="triton", log_level_http="info", dtype="float16", schedule_policy="fcfs",
        log_level="debug", random_seed=7, mem_fraction_static=0.5, decode_log_interval=10,
    )  # fmt: skip


def good_configs() -> list[SGLangConfig]:
    configs = [SGLangConfig(model_path="/models/m"), all_bools_true(), all_optionals_set()]
    for f in dataclasses.fields(SGLangConfig):  # every allowed value of every field that has choices
        for value in f.metadata.get("choices") or ():
            configs.append(dataclasses.replace(SGLangConfig(model_path="/models/m"), **{f.name: value}))
    return configs


def bad_argvs() -> list[list[str]]:
    base = SGLangConfig.build_cmd(SGLangConfig(model_path="/models/m"), port=30123)[3:]
    return [
        base + ["--enable-ep-moe"],  # emitted by older AReaL; removed from SGLang
        base + ["--torchao-config", "int8wo"],
        base + ["--enable-nan-detection"],
        base + ["--dtype", "float64"],  # not a choice
        base + ["--tp-size", "two"],  # not an int
    ]


def lora_run_config() -> GRPOConfig:
    """A LoRA run on SGLang as a user writes it: the switches on, SGLang's rank left to the loader."""
    config = GRPOConfig(backend="sglang")
    config.actor.use_lora = config.rollout.use_lora = True
    config.actor.lora_rank = 8
    config.sglang.model_path, config.sglang.enable_lora = "/models/m", True
    reconcile_lora(config)
    return config


def lora_argvs() -> list[list[str]]:
    """The command of a kit LoRA run, then the same without what the kit adds (SGLang's check must refuse it)."""
    cmd = SGLangConfig.build_cmd(lora_run_config().sglang)[3:]
    at = cmd.index("--lora-target-modules")
    bare = cmd[:at] + cmd[at + 2 :]
    at = bare.index("--max-lora-rank")
    return [cmd, bare[:at] + bare[at + 2 :]]


@pytest.fixture(scope="module")
def parsed():
    """One subprocess parses every command line of this module (importing SGLang takes seconds)."""
    configs = good_configs()
    cmds = [SGLangConfig.build_cmd(c, tp_size=2, base_gpu_id=1, host="127.0.0.1", port=30123,
                                   dist_init_addr="127.0.0.1:40000") for c in configs]  # fmt: skip
    bad, lora = bad_argvs(), lora_argvs()
    results = parse_with_sglang([cmd[3:] for cmd in cmds] + bad + lora)
    n, m = len(cmds), len(cmds) + len(bad)
    return configs, cmds, results[:n], results[n:m], results[m:]


def test_build_cmd_is_accepted_by_sglang_parser(parsed):
    configs, cmds, results, *_ = parsed
    for cmd in cmds:
        assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
        assert all(isinstance(a, str) for a in cmd)
    for cfg, res in zip(configs, results):
        assert res["ok"], (cfg, res)
        args = res["args"]
        assert args["model_path"] == "/models/m" and args["port"] == 30123 and args["tp_size"] == 2
        assert args["base_gpu_id"] == 1 and args["host"] == "127.0.0.1"
        assert args["random_seed"] == cfg.random_seed and args["dtype"] == cfg.dtype
        assert args["context_length"] == cfg.context_length
        assert args["skip_tokenizer_init"] == cfg.skip_tokenizer_init
        assert args["disable_radix_cache"] == cfg.disable_radix_cache


def test_parser_rejects_removed_flags(parsed):
    *_, bad_results, _ = parsed
    assert len(bad_results) == len(bad_argvs())
    for res in bad_results:
        assert not res["ok"] and res["code"] == 2, res


def test_a_lora_run_passes_sglangs_own_lora_check(parsed):
    """With no adapter at start SGLang needs the largest rank and the modules to serve LoRA; a kit LoRA run syncs
    its first adapter after start, so the loader sets `sglang.max_lora_rank` from `actor.lora_rank` and the command
    adds the modules. SGLang's own check accepts that command, and refuses it without them."""
    *_, (run, bare) = parsed
    assert run["ok"] and run["args"]["max_lora_rank"] == 8, run
    assert run["lora"] == "ok", run["lora"]
    assert bare["ok"] and "--max-lora-rank and --lora-target-modules" in bare["lora"], bare


# ----------------------------------------------------------------------------------------------------------------
# 2. the JSON contract


@pytest.fixture(scope="module")
def api():
    path = os.path.join(sglang_dir(), "api", "v1", "api_types.py")
    assert os.path.isfile(path), f"{path} missing: is sglang {SGLANG_VERSION} installed?"
    spec = importlib.util.spec_from_file_location("sglang_api_v1_types", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec/dataclass machinery resolves names through sys.modules
    spec.loader.exec_module(module)
    return module


def post(addr, path, body):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            return r.status, (json.loads(text) if text else None)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "null")


def get(addr, path):
    import urllib.request

    with urllib.request.urlopen(f"http://{addr}{path}", timeout=30) as r:
        return json.loads(r.read().decode())


def test_sampling_params_from_config_fit_the_contract(api):
    for g in [
        GenerationHyperparameters(),
        GenerationHyperparameters(greedy=True, stop=["</answer>"], stop_token_ids=[2]),
        GenerationHyperparameters(temperature=0.7, top_p=0.9, top_k=20, min_new_tokens=2, ignore_eos=True),
    ]:
        sp = sampling_params(g)
        decoded = api.SamplingParams.from_json_value(sp)
        assert decoded.max_new_tokens == g.max_new_tokens and decoded.n == 1


def test_requests_and_responses_fit_the_contract(api, embedded_server):
    addr = embedded_server.address
    requests = [
        {
            "input_ids": [11, 12, 13],
            "rid": "c-1",
            "return_logprob": True,
            "logprob_start_len": -1,
            "top_logprobs_num": 0,
            "stream": False,
            "sampling_params": sampling_params(GenerationHyperparameters(max_new_tokens=6, greedy=True)),
        },
        {
            "input_ids": [[1, 2], [3, 4, 5]],
            "rid": ["c-2", "c-3"],
            "return_logprob": [True, False],
            "sampling_params": [{"max_new_tokens": 3, "temperature": 0.0}, {"max_new_tokens": 2, "stop": "x"}],
        },
        {
            "text": "What is 1 + 1?",
            "sampling_params": {"max_new_tokens": 4, "stop": ["\n"], "stop_token_ids": [5], "n": 2},
        },
        {
            "input_ids": [7, 8],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "return_text_in_logprobs": True,
        },
    ]
    seen_types = set()
    for body in requests:
        api.GenerateRequest.from_json_value(body)  # our requests are valid SGLang requests
        status, out = post(addr, "/generate", body)
        assert status == 200, out
        for item in out if isinstance(out, list) else [out]:
            resp = api.GenerateResponse.from_json_value(item)
            meta = resp.meta_info
            assert isinstance(meta.finish_reason, (api.FinishStop, api.FinishLength, api.FinishAbort)), item
            seen_types.add(item["meta_info"]["finish_reason"]["type"])
            assert meta.completion_tokens == len(resp.output_ids) and meta.weight_version
            if item["meta_info"].get("output_token_logprobs") is not None:
                assert [e.token_id for e in meta.output_token_logprobs] == resp.output_ids
    assert "length" in seen_types

    # an aborted request (abort by rid on the shared server touches nobody else)
    def until_running(count):
        deadline = time.monotonic() + 60
        while get(addr, "/server_info")["num_running"] != count:
            assert time.monotonic() < deadline, f"the server never ran {count} requests"
            time.sleep(0.02)

    # Idle first, so that one running request below is ours: a request left by an earlier test on this shared
    # server would end the wait at once and the abort would find no "c-abort" (which then runs to its length).
    until_running(0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            post,
            addr,
            "/generate",
            {
                "input_ids": [9, 9],
                "rid": "c-abort",
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            },
        )
        until_running(1)  # 3000 tokens take seconds: the abort lands mid-generation
        body = {"rid": "c-abort", "abort_all": False}
        api.AbortRequest.from_json_value(body)
        assert post(addr, "/abort_request", body)[0] == 200
        status, out = fut.result(timeout=30)
    resp = api.GenerateResponse.from_json_value(out)
    assert isinstance(resp.meta_info.finish_reason, api.FinishAbort) and resp.meta_info.finish_reason.message

    info = api.GetModelInfoResponse.from_json_value(get(addr, "/model_info"))
    assert info.is_generation and info.model_path and isinstance(info.weight_version, str)


CONTRACT_VIOLATIONS = [
    {"input_ids": [1], "sampling_params": {"max_new_tokens": 16.0}},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": True}},
    {"input_ids": [1], "sampling_params": {"max_tokens": 16}},
    {"input_ids": [1], "sampling_params": {"temperature": "0.5"}},
    {"input_ids": [1], "sampling_params": {"top_k": 1.5}},
    {"input_ids": [1], "sampling_params": {"stop": 3}},
    {"input_ids": [1], "sampling_params": {"stop_token_ids": [1.0]}},
    {"input_ids": [1], "sampling_params": {"ignore_eos": "false"}},
    {"input_ids": [1], "sampling_params": {"n": "2"}},
    {"input_ids": [1], "sampling_params": "greedy"},
    {"input_ids": ["a", "b"]},
    {"input_ids": [1], "rid": 5},
    {"input_ids": [1], "return_logprob": 1},
    {"text": 12},
    [{"input_ids": [1]}],
]


def test_contract_violations_are_rejected_by_both(api, embedded_server):
    for body in CONTRACT_VIOLATIONS:
        with pytest.raises(api.JsonContractError):
            api.GenerateRequest.from_json_value(body)
        status, out = post(embedded_server.address, "/generate", body)
        assert status == 400 and isinstance(out["error"], str), (body, status, out)


def test_generate_fields_are_sglangs():
    """The embedded server refuses a /generate field SGLang does not define: its list is GenerateReqInput's fields."""
    import ast

    from areal_lite.kit.server.protocol import SGLANG_GENERATE_FIELDS

    path = os.path.join(sglang_dir(), "srt", "managers", "io_struct.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput"]
    fields = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    assert list(SGLANG_GENERATE_FIELDS) == fields
