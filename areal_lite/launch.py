"""Start inference servers as child processes and get them back as handles: SGLang on a GPU, the embedded server
(`python -m areal_lite.serve`) anywhere.

    handle = launch_server(config.embedded, backend="embedded", model_path=path)   # or a whole GRPOConfig
    handle.wait_ready(timeout=120)       # polls GET /health; on failure the error carries the log's tail
    ...                                  # os.environ["AREAL_LLM_SERVER_ADDRS"] now lists "127.0.0.1:PORT"
    handle.stop()                        # or: with launch_server(...) as handle: ...

Design decisions
- A server is a plain child process started from an argv list (never a shell string), with stdout and stderr going
  to one log file. Errors quote the last lines of that file, so a failed start explains itself in the notebook.
- No orphans, in three layers. (1) Linux: the child asks the kernel for SIGTERM when its parent dies
  (`prctl(PR_SET_PDEATHSIG)`), which covers a SIGKILLed or crashed parent (a kernel restart in Jupyter). The
  kernel sends that signal when the *thread* that forked the child exits, so forks from non-main threads are done
  by one long-lived spawner thread. (2) `atexit` stops every server still running at interpreter exit. (3) A
  weakref finalizer stops a server whose handle is garbage-collected. `stop()` is idempotent: SIGTERM to the
  child's process group (SGLang has children of its own), wait, then SIGKILL.
- `backend="auto"` picks SGLang only when it can work: the package is importable (checked in a subprocess:
  importing SGLang here would patch `transformers` inside the caller's process) and CUDA is available.
  Otherwise the embedded server. The choice is printed.
- `AREAL_LLM_SERVER_ADDRS` (what `RemoteSGLangEngine.initialize()` reads when given no address) is set to the
  comma-separated addresses of the servers this process launched and that are still running, in launch order;
  `stop()` removes its address again, and when the last one stops the variable gets back the value it had before
  the first launch (or is removed).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import importlib.util
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from typing import Any, Optional

from areal_lite.config import EmbeddedServerConfig, SGLangConfig

__all__ = ["ServerHandle", "ServerLaunchError", "find_free_port", "find_free_ports", "launch_server", "choose_backend"]

ENV_ADDRS = "AREAL_LLM_SERVER_ADDRS"


class ServerLaunchError(RuntimeError):
    """The server process died or did not become healthy in time; the message ends with its last log lines."""


# ------------------------------------------------------------------------------------------------------------------
# ports


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (the OS picks it)."""
    return find_free_ports(1, host)[0]


def find_free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports (all sockets are held open until every port is chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# ------------------------------------------------------------------------------------------------------------------
# child processes that die with their parent


def _parent_death_preexec():
    """preexec_fn for Popen: SIGTERM this child when the forking thread/process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, in the parent: no dlopen after fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    PR_SET_PDEATHSIG = 1

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class _Spawner:
    """Runs Popen on one long-lived thread, so PR_SET_PDEATHSIG fires only when the process exits.

    (The signal is tied to the forking thread: a server started from a short-lived worker thread would otherwise
    be killed when that thread ends.)"""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen:
        if threading.current_thread() is threading.main_thread():
            return subprocess.Popen(*args, **kwargs)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="areal-lite-spawner", daemon=True)
                self._thread.start()
        box: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((args, kwargs, box))
        ok, value = box.get()
        if not ok:
            raise value
        return value

    def _loop(self) -> None:
        while True:
            args, kwargs, box = self._jobs.get()
            try:
                box.put((True, subprocess.Popen(*args, **kwargs)))
            except BaseException as e:  # hand the error back to the caller's thread
                box.put((False, e))


_SPAWNER = _Spawner()
_LIVE: "weakref.WeakValueDictionary[int, ServerHandle]" = weakref.WeakValueDictionary()
_LIVE_ORDER: list[int] = []  # pids in launch order (for AREAL_LLM_SERVER_ADDRS)
_LIVE_ADDR: dict[int, str] = {}


def _terminate(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the child's process group, wait, then SIGKILL. Safe to call more than once."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError, OSError):
            proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                proc.kill()
            proc.wait(timeout=timeout)
    else:
        # The leader is gone; its group (SGLang's scheduler processes) may not be.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass


def _forget(pid: int) -> None:
    _LIVE_ADDR.pop(pid, None)
    if pid in _LIVE_ORDER:
        _LIVE_ORDER.remove(pid)
    _publish_addrs()


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


def _finalize(proc: subprocess.Popen, log_file: Any, timeout: float = 5.0) -> None:
    _terminate(proc, timeout=timeout)
    _forget(proc.pid)
    try:
        log_file.close()
    except Exception:
        pass


@atexit.register
def _stop_all() -> None:
    for handle in list(_LIVE.values()):
        try:
            handle.stop(timeout=5.0)
        except Exception:
            pass


# ------------------------------------------------------------------------------------------------------------------
# the handle


class ServerHandle:
    """A running server process: address, log, readiness check, stop. Also a context manager."""

    def __init__(self, proc: subprocess.Popen, host: str, port: int, backend: str, log_path: str, cmd: list[str],
                 log_file: Any):  # fmt: skip
        self.proc = proc
        self.host = host
        self.port = port
        self.backend = backend
        self.log_path = log_path
        self.cmd = cmd
        self._log_file = log_file
        self._finalizer = weakref.finalize(self, _finalize, proc, log_file)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        """The last `n` lines of the server's log."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(collections.deque(f, maxlen=n))
        except OSError as e:
            return f"(cannot read {self.log_path}: {e})"

    def _fail(self, why: str) -> ServerLaunchError:
        return ServerLaunchError(
            f"{self.backend} server at {self.address} {why}.\ncommand: {' '.join(self.cmd)}\nlog: {self.log_path}\n"
            f"--- last log lines ---\n{self.tail(30)}"
        )

    def wait_ready(self, timeout: float = 120.0, poll_interval: float = 0.25) -> "ServerHandle":
        """Block until GET /health answers 200. Raises ServerLaunchError (with the log's tail) if the process
        exits or `timeout` seconds pass; in the latter case the server is stopped."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self._fail(f"exited with code {code} before becoming ready")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass  # not listening yet, or 503 while loading
            if time.monotonic() >= deadline:
                err = self._fail(f"did not become ready within {timeout:g}s (stopped it)")
                self.stop()
                raise err
            time.sleep(poll_interval)

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the server (SIGTERM, wait, SIGKILL), close its log, drop its address. Idempotent."""
        if self._finalizer.detach() is not None:  # first call only; later calls (and GC) do nothing
            _finalize(self.proc, self._log_file, timeout)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else f"exited({self.proc.returncode})"
        return (
            f"ServerHandle(backend={self.backend!r}, address={self.address!r}, pid={self.pid}, {state}, "
            f"log={self.log_path!r})"
        )


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
    cmd = [
        sys.executable, "-m", "areal_lite.serve", "--model-path", model_path, "--host", host, "--port", str(port),
        "--dtype", cfg.dtype, "--device", cfg.device, "--max-running-requests", str(cfg.max_running_requests),
        "--threads", str(cfg.threads), "--log-level", cfg.log_level,
    ]  # fmt: skip
    if cfg.context_length:
        cmd += ["--context-length", str(cfg.context_length)]
    if seed is not None:
        cmd += ["--random-seed", str(seed)]
    return cmd


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
    seed = None
    if isinstance(config, (EmbeddedServerConfig, SGLangConfig)):
        kind = "embedded" if isinstance(config, EmbeddedServerConfig) else "sglang"
        if backend == "auto":
            backend = kind
        elif backend != kind:
            raise ValueError(f"backend={backend!r} but config is a {type(config).__name__}")
        sub = {kind: config}
        fallback_path = ""
    elif hasattr(config, "sglang") and hasattr(config, "embedded"):
        if backend == "auto":
            backend = getattr(config, "backend", "auto")
        sub = {"sglang": config.sglang, "embedded": config.embedded}
        fallback_path = getattr(getattr(config, "actor", None), "path", "") or ""
        seed = getattr(config, "seed", None)
    else:
        raise TypeError(
            f"launch_server: expected EmbeddedServerConfig, SGLangConfig or GRPOConfig, got {type(config).__name__}"
        )

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
        cmd = _embedded_cmd(cfg, host, port, path, seed)
        env_threads = str(cfg.threads)

    log_dir = log_dir or os.path.join(tempfile.gettempdir(), "areal-lite-logs")
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{chosen}-{port}-{time.strftime('%Y%m%d-%H%M%S')}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if env_threads is not None:
        env["OMP_NUM_THREADS"] = env_threads  # the server's torch pool: no oversubscription of a shared CPU
    log_file = open(log_path, "ab")
    try:
        proc = _SPAWNER.popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,  # own process group: stop() reaches SGLang's children; Ctrl-C does not
            preexec_fn=_parent_death_preexec(),
        )  # fmt: skip
    except BaseException:
        log_file.close()
        raise
    handle = ServerHandle(proc, host, port, chosen, log_path, cmd, log_file)
    _LIVE[proc.pid] = handle
    _LIVE_ORDER.append(proc.pid)
    _LIVE_ADDR[proc.pid] = handle.address
    _publish_addrs()
    print(f"launch_server: backend={chosen} ({why}) address={handle.address} pid={proc.pid} log={log_path}")
    return handle
