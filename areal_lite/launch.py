"""Start inference servers as child processes and get them back as handles: SGLang on a GPU, the embedded server
(`python -m areal_lite.serve`) anywhere.

    handle = launch_server(config.embedded, backend="embedded", model_path=path)   # or a whole GRPOConfig
    handle.wait_ready(timeout=120)       # polls GET /health; on failure the error carries the log's tail
    ...                                  # os.environ["AREAL_LLM_SERVER_ADDRS"] now lists "127.0.0.1:PORT"
    handle.stop()                        # or: with launch_server(...) as handle: ...

Design decisions
- Process handling (free ports, a child that dies with its parent even when the parent is SIGKILLed, stop at
  exit, errors that quote the log) lives in `areal_lite.procs`, shared with the RAG server; `ServerHandle` is a
  `procs.ServerProcess`. Each server writes to its own log file under `log_dir` (a temp folder by default).
- `backend="auto"` picks SGLang only when it can work: the package is importable (checked in a subprocess:
  importing SGLang here would patch `transformers` inside the caller's process) and CUDA is available.
  Otherwise the embedded server. The choice is printed.
- `AREAL_LLM_SERVER_ADDRS` (what `RemoteSGLangEngine.initialize()` reads when given no address) is set to the
  comma-separated addresses of the servers this process launched and that are still running, in launch order;
  `stop()` removes its address again, and when the last one stops the variable gets back the value it had before
  the first launch (or is removed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from areal_lite.config import EmbeddedServerConfig, SGLangConfig
from areal_lite.procs import ServerLaunchError, ServerProcess, find_free_port, find_free_ports, spawn

__all__ = ["ServerHandle", "ServerLaunchError", "find_free_port", "find_free_ports", "launch_server", "choose_backend"]

ENV_ADDRS = "AREAL_LLM_SERVER_ADDRS"


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

    `.proc` is the `subprocess.Popen`, `.backend` "sglang" or "embedded", `.cmd` the argv it was started with;
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
    """`auto` -> ("sglang", why) when SGLang can run here, else ("embedded", why)."""
    if backend in ("sglang", "embedded"):
        return backend, "requested"
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'sglang' or 'embedded', got {backend!r}")
    ok, why = _sglang_usable()
    return ("sglang" if ok else "embedded"), f"auto: {why}"


def _embedded_cmd(cfg: EmbeddedServerConfig, host: str, port: int, model_path: str, seed: Optional[int]) -> list[str]:
    """`python -m areal_lite.serve` with every option of `cfg` (defined once, in the dataclass) and this launch's."""
    cfg = dataclasses.replace(cfg, model_path=model_path)  # the resolved path (it may fall back to the actor's)
    per_launch = ["--host", host, "--port", str(port), "--exit-with-parent", str(os.getpid())]
    seed_args = [] if seed is None else ["--random-seed", str(seed)]
    return [sys.executable, "-m", "areal_lite.serve", *cfg.cli_args(), *per_launch, *seed_args]


def _server_configs(config: Any, backend: str) -> tuple[str, dict[str, Any], str, Optional[int]]:
    """(backend, {kind: server config}, fallback model path, seed) from any config `launch_server` accepts."""
    if isinstance(config, (EmbeddedServerConfig, SGLangConfig)):
        kind = "embedded" if isinstance(config, EmbeddedServerConfig) else "sglang"
        if backend == "auto":
            backend = kind
        elif backend != kind:
            raise ValueError(f"backend={backend!r} but config is a {type(config).__name__}")
        return backend, {kind: config}, "", None
    if hasattr(config, "sglang") and hasattr(config, "embedded"):
        if backend == "auto":
            backend = getattr(config, "backend", "auto")
        subs = {"sglang": config.sglang, "embedded": config.embedded}
        fallback_path = getattr(getattr(config, "actor", None), "path", "") or ""
        return backend, subs, fallback_path, getattr(config, "seed", None)
    raise TypeError(
        f"launch_server: expected EmbeddedServerConfig, SGLangConfig or GRPOConfig, got {type(config).__name__}"
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

    `config`: an `EmbeddedServerConfig`, an `SGLangConfig`, or a whole experiment config with `.backend`,
    `.sglang` and `.embedded` (a `GRPOConfig`); then `backend` defaults to `config.backend`. `model_path`
    overrides the config's; with a whole config an empty path falls back to `config.actor.path`.
    """
    backend, sub, fallback_path, seed = _server_configs(config, backend)
    chosen, why = choose_backend(backend)
    cfg = sub[chosen]
    path = model_path or cfg.model_path or fallback_path
    if not path:
        raise ValueError(f"no model path: pass model_path= or set {chosen}.model_path")
    port = port or find_free_port(host)
    if chosen == "sglang":
        from areal_lite.models import resolve_model_path

        cmd = SGLangConfig.build_cmd(cfg, tp_size=tp_size, base_gpu_id=base_gpu_id, host=host, port=port,
                                     model_path=resolve_model_path(path))  # fmt: skip
        env_threads = None
    else:
        from areal_lite.models import capped_threads

        cmd = _embedded_cmd(cfg, host, port, path, seed)
        # The launcher's own OMP_NUM_THREADS is a cap, not overridden: `make test` runs two notebooks on two cores.
        env_threads = str(capped_threads(cfg.threads)) if cfg.threads > 0 else None

    log_dir = log_dir or os.path.join(tempfile.gettempdir(), "areal-lite-logs")
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{chosen}-{port}-{time.strftime('%Y%m%d-%H%M%S')}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if env_threads is not None:
        env["OMP_NUM_THREADS"] = env_threads  # the server's torch pool: no oversubscription of a shared CPU
    proc = spawn(cmd, log_path, env)
    handle = ServerHandle(proc, host, port, chosen, log_path, cmd)
    _remember(proc.pid, handle.address)
    print(f"launch_server: backend={chosen} ({why}) address={handle.address} pid={proc.pid} log={log_path}")
    return handle
