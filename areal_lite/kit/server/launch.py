"""Start inference servers as child processes and get them back as handles: SGLang on a GPU, the embedded server
(`python -m areal_lite.kit.server`) anywhere, and vLLM (opt-in, `backend="vllm"`) on CPU or GPU.

    handle = launch_server(config.embedded, backend="embedded", model_path=path)   # or a whole GRPOConfig
    handle.wait_ready(timeout=120)       # polls GET /health; on failure the error carries the log's tail
    ...                                  # os.environ["AREAL_LLM_SERVER_ADDRS"] now lists "127.0.0.1:PORT"
    handle.stop()                        # or: with launch_server(...) as handle: ...

Design decisions
- Process handling (free ports, no orphans, stop at exit, errors that quote the log) is `kit.server.procs`, shared with
  the RAG server; `ServerHandle` is a `procs.ServerProcess`, each server logging to its own file under `log_dir`.
- `backend="auto"` picks SGLang only when it can work: importable (checked in a subprocess: importing SGLang patches
  `transformers` in the importing process) and CUDA available; otherwise the embedded server. The choice is printed.
- `AREAL_LLM_SERVER_ADDRS` (what `RemoteSGLangEngine.initialize()` reads without an address) lists the running
  servers this process launched, in launch order; when the last one stops, the variable gets its earlier value back.
- vLLM is never chosen by `auto`: it is an opt-in install (`make vllm`) into its own `.venv-vllm` (it pins its own
  transformers). The server gets `VLLM_SERVER_DEV_MODE=1`, the kit's worker extension, logprobs after temperature
  and `--generation-config vllm` (`engine.vllm_client` says why). On CPU it runs eager, with a KV cache of
  `cpu_kv_cache_gb` (vLLM would reserve 90% of the RAM) and OpenMP threads capped like the embedded server's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from areal_lite.api.cli_args import (
    VLLM_FLAGS_WHEN_SET,
    EmbeddedServerConfig,
    SGLangConfig,
    server_backend,
    vLLMConfig,
)
from areal_lite.kit.server.procs import (
    ServerLaunchError,
    ServerProcess,
    find_free_port,
    find_free_ports,
    listening_socket,
    server_log_path,
    spawn,
)

__all__ = ["ServerHandle", "ServerLaunchError", "find_free_port", "find_free_ports", "launch_server", "choose_backend"]

ENV_ADDRS = "AREAL_LLM_SERVER_ADDRS"
_KIT_ROOT = str(Path(__file__).resolve().parents[3])  # areal_lite/kit/server/launch.py -> the checkout (`make vllm`)
_VLLM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(vLLMConfig)}
_VLLM_EXT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_ext")
_VLLM_EXTENSION = "areal_lite_vllm_worker.WeightReloadExtension"  # a module in _VLLM_EXT_DIR


# ------------------------------------------------------------------------------------------------------------------
# AREAL_LLM_SERVER_ADDRS follows the running servers

_LIVE_ORDER: list[int] = []  # pids in launch order
_LIVE_ADDR: dict[int, str] = {}
_ENV_BEFORE: list[Optional[str]] = []  # the user's own value, restored when our last server stops


def _publish_addrs() -> None:
    addrs = [_LIVE_ADDR[p] for p in _LIVE_ORDER if p in _LIVE_ADDR]
    if addrs:
        if not _ENV_BEFORE:
            _ENV_BEFORE.append(os.environ.get(ENV_ADDRS))
        os.environ[ENV_ADDRS] = ",".join(addrs)
    elif _ENV_BEFORE:
        before = _ENV_BEFORE.pop()
        if before is None:
            os.environ.pop(ENV_ADDRS, None)
        else:
            os.environ[ENV_ADDRS] = before


def _remember(pid: int, address: str) -> None:
    _LIVE_ORDER.append(pid)
    _LIVE_ADDR[pid] = address
    _publish_addrs()


def _forget(pid: int) -> None:
    _LIVE_ADDR.pop(pid, None)
    if pid in _LIVE_ORDER:
        _LIVE_ORDER.remove(pid)
    _publish_addrs()


# ------------------------------------------------------------------------------------------------------------------
# the handle


class ServerHandle(ServerProcess):
    """A running inference server process: address, log, readiness check, stop. Also a context manager.

    `.proc` is the `subprocess.Popen`, `.backend` "sglang", "embedded" or "vllm", `.cmd` the argv it was started with;
    `.tail(n)` gives the log's last lines. Stopping it removes its address from AREAL_LLM_SERVER_ADDRS."""

    def __init__(self, proc: subprocess.Popen, host: str, port: int, backend: str, log_path: str, cmd: list[str],
                 log_file: Any = None):  # fmt: skip
        self.backend = backend
        super().__init__(proc, host, port, log_path, cmd=cmd, label=f"{backend} server", on_stop=_forget,
                         log_file=log_file)  # fmt: skip

    def _repr_fields(self) -> str:
        return f"backend={self.backend!r}, "


# ------------------------------------------------------------------------------------------------------------------
# launching


def _sglang_usable() -> tuple[bool, str]:
    if importlib.util.find_spec("sglang") is None:
        return False, "sglang is not installed"
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA device"
    except Exception as e:
        return False, f"torch unusable: {e}"
    # Import in a subprocess: importing sglang patches transformers in the importing process.
    probe = subprocess.run([sys.executable, "-c", "import sglang.launch_server"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"`import sglang.launch_server` fails ({last})"
    return True, "sglang importable and CUDA available"


def choose_backend(backend: str = "auto") -> tuple[str, str]:
    """`auto` -> ("sglang", why) when SGLang can run here, else ("embedded", why). vLLM only when asked for."""
    if backend in ("sglang", "embedded", "vllm"):
        return backend, "requested"
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'sglang', 'embedded' or 'vllm', got {backend!r}")
    ok, why = _sglang_usable()
    return ("sglang" if ok else "embedded"), f"auto: {why}"


def _embedded_cmd(cfg: EmbeddedServerConfig, host: str, port: int, model_path: str, seed: Optional[int]) -> list[str]:
    """`python -m areal_lite.kit.server`: every option of `cfg` (defined once, in the dataclass) and this launch's."""
    cfg = dataclasses.replace(cfg, model_path=model_path)  # the resolved path (it may fall back to the actor's)
    per_launch = ["--host", host, "--port", str(port), "--exit-with-parent", str(os.getpid())]
    seed_args = [] if seed is None else ["--random-seed", str(seed)]
    return [sys.executable, "-m", "areal_lite.kit.server", *cfg.cli_args(), *per_launch, *seed_args]


def _vllm_python(cfg: vLLMConfig) -> str:
    """The interpreter that runs vLLM: `cfg.python`, else the checkout's `.venv-vllm`, else this one if it has vLLM."""
    if cfg.python:
        return cfg.python
    local = os.path.join(_KIT_ROOT, ".venv-vllm", "bin", "python")
    if os.path.exists(local):
        return local
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ServerLaunchError(
        f"backend=vllm: vLLM is not installed. `make vllm` builds {os.path.dirname(os.path.dirname(local))} "
        "(about 2.5 GB), or set vllm.python to an interpreter that has vLLM"
    )


def _vllm_cmd(cfg: vLLMConfig, host: str, port: int, model_path: str, seed: Optional[int], on_cpu: bool,
              tp_size: int = 1) -> list[str]:  # fmt: skip
    """`python -m vllm.entrypoints.openai.api_server` with `cfg`'s options and this launch's (the `vllm` console
    script fails under the CPU build's distribution name). Without CUDA it always runs eager: compiling takes
    minutes, and its cache did not reload."""
    cmd = [
        _vllm_python(cfg), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
        "--host", host, "--port", str(port), "--dtype", cfg.dtype or "auto",
        "--seed", str(cfg.seed if seed is None else seed), "--max-num-seqs", str(cfg.max_num_seqs),
        "--logprobs-mode", cfg.logprobs_mode, "--generation-config", "vllm",
        "--worker-extension-cls", _VLLM_EXTENSION, "--uvicorn-log-level", cfg.uvicorn_log_level,
    ]  # fmt: skip
    if cfg.max_model_len:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    for name in VLLM_FLAGS_WHEN_SET:  # AReaL's other vLLM fields, passed only when changed from their default
        value, default = getattr(cfg, name), _VLLM_DEFAULTS[name]
        if value != default:
            flag = "--" + name.replace("_", "-")
            cmd += [flag] if value is True else [flag, str(value)]
    if cfg.no_enable_prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if cfg.enable_lora:  # adapters loaded at run time (`_vllm_env` allows it), asked for by name in each request
        cmd += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", str(cfg.max_loras)]
        if cfg.lora_modules:
            cmd += ["--lora-modules", *cfg.lora_modules]
    if on_cpu:
        cmd += ["--enforce-eager", "--kv-cache-memory-bytes", str(int(cfg.cpu_kv_cache_gb) << 30)]
    else:
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization), "--tensor-parallel-size", str(tp_size)]
        if cfg.enforce_eager:
            cmd.append("--enforce-eager")
    return cmd


def _vllm_env(env: dict, cfg: vLLMConfig, model_path: str, on_cpu: bool, tp_size: int, base_gpu_id: int) -> None:
    """The vLLM server's environment, in place: `VLLM_SERVER_DEV_MODE=1` (the pause, abort and RPC endpoints), with
    `enable_lora` the run-time adapter routes, the kit's worker extension on its PYTHONPATH (nothing else of the
    kit), and on CPU unpinned OpenMP threads (vLLM would pin its own threads to cores a trainer shares)."""
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /abort_requests, /collective_rpc, /reset_prefix_cache
    if cfg.enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter and /v1/unload_lora_adapter (AReaL's)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_VLLM_EXT_DIR, env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    if os.path.isdir(model_path):
        env.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to fetch, and no waiting on a network
    if on_cpu:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        threads = _server_threads(cfg.threads)  # capped as the embedded server's
        if threads is not None:
            env["OMP_NUM_THREADS"] = threads
    else:  # the server's GPUs: base_gpu_id.. of the visible ones (the trainer keeps GPU 0 when there are two)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(base_gpu_id + tp_size)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[base_gpu_id : base_gpu_id + tp_size])


def _server_threads(threads: int) -> Optional[str]:
    """OMP_NUM_THREADS of a CPU server process: its config's count capped by the launcher's own OMP_NUM_THREADS
    (a cap, not overridden: `make test` runs two notebooks on two cores); None (inherit) for torch's default."""
    from areal_lite.utils.device import capped_threads

    return str(capped_threads(threads)) if threads > 0 else None


def _server_configs(config: Any, backend: str) -> tuple[str, dict[str, Any], str, Optional[int]]:
    """(backend, {kind: server config}, fallback model path, seed) from any config `launch_server` accepts."""
    if isinstance(config, (EmbeddedServerConfig, SGLangConfig, vLLMConfig)):
        kind = {EmbeddedServerConfig: "embedded", SGLangConfig: "sglang", vLLMConfig: "vllm"}[type(config)]
        if backend == "auto":
            backend = kind
        elif backend != kind:
            raise ValueError(f"backend={backend!r} but config is a {type(config).__name__}")
        return backend, {kind: config}, "", None
    if hasattr(config, "sglang") and hasattr(config, "embedded"):
        if backend == "auto":
            backend = server_backend(config)  # rollout.backend's prefix when set, else the kit's switch
        subs = {"sglang": config.sglang, "embedded": config.embedded, "vllm": getattr(config, "vllm", vLLMConfig())}
        fallback_path = getattr(getattr(config, "actor", None), "path", "") or ""
        return backend, subs, fallback_path, getattr(config, "seed", None)
    raise TypeError(
        "launch_server: expected EmbeddedServerConfig, SGLangConfig, vLLMConfig or GRPOConfig, "
        f"got {type(config).__name__}"
    )


def launch_server(
    config: Any,
    backend: str = "auto",
    host: str = "127.0.0.1",
    port: Optional[int] = None,
    log_dir: Optional[str] = None,
    tp_size: int = 1,
    base_gpu_id: int = 0,
    model_path: Optional[str] = None,
) -> ServerHandle:
    """Start one inference server and return its handle (call `.wait_ready()` next).

    `config`: an `EmbeddedServerConfig`, an `SGLangConfig`, a `vLLMConfig`, or a whole experiment config with
    `.backend`, `.sglang`, `.embedded` (and `.vllm`) (a `GRPOConfig`); then `backend` defaults to `config.backend`.
    `model_path` overrides the config's; with a whole config an empty path falls back to `config.actor.path`.
    """
    backend, sub, fallback_path, seed = _server_configs(config, backend)
    chosen, why = choose_backend(backend)
    cfg = sub[chosen]
    path = model_path or (cfg.model if chosen == "vllm" else cfg.model_path) or fallback_path
    if not path:
        field = "vllm.model" if chosen == "vllm" else f"{chosen}.model_path"
        from areal_lite.utils.model_store import ModelPathError

        raise ModelPathError(f"no model path: pass model_path= or set {field}")
    # No port given: our own server inherits a socket that already listens (procs.listening_socket), so nothing can
    # take the port while it starts; SGLang and vLLM bind theirs themselves, on a port that was free a moment ago.
    sock = listening_socket(host) if not port and chosen == "embedded" else None
    port = port or (sock.getsockname()[1] if sock else find_free_port(host))
    if chosen == "sglang":
        from areal_lite.utils.model_store import resolve_model_path

        cmd = SGLangConfig.build_cmd(cfg, tp_size=tp_size, base_gpu_id=base_gpu_id, host=host, port=port,
                                     model_path=resolve_model_path(path))  # fmt: skip
        env_threads = None
    elif chosen == "vllm":
        import torch

        from areal_lite.utils.model_store import resolve_model_path

        path = resolve_model_path(path)
        on_cpu = not torch.cuda.is_available()
        cmd = _vllm_cmd(cfg, host, port, path, seed, on_cpu, tp_size)
        env_threads = None  # _vllm_env sets them (CPU only)
    else:
        cmd = _embedded_cmd(cfg, host, port, path, seed) + (["--listen-fd", str(sock.fileno())] if sock else [])
        env_threads = _server_threads(cfg.threads)

    log_path = server_log_path(chosen, port, log_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if env_threads is not None:
        env["OMP_NUM_THREADS"] = env_threads  # the server's torch pool: no oversubscription of a shared CPU
    if chosen == "vllm":
        _vllm_env(env, cfg, path, on_cpu, tp_size, base_gpu_id)
    proc = spawn(cmd, log_path, env, listener=sock)
    handle = ServerHandle(proc, host, port, chosen, log_path, cmd)
    _remember(proc.pid, handle.address)
    print(f"launch_server: backend={chosen} ({why}) address={handle.address} pid={proc.pid} log={log_path}")
    return handle
