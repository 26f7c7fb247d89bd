"""Child server processes: starting a child that dies with its parent, and a handle to wait for it, read its log
and stop it. The inference servers (`launch.ServerHandle`) and the RAG server (`rag.RAGServerHandle`) use it.

    port = find_free_port()
    proc = spawn([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)], "/tmp/files.log")
    with ServerProcess(proc, "127.0.0.1", port, "/tmp/files.log", label="file server", health_path="/") as srv:
        srv.wait_ready(timeout=30)       # polls GET http://127.0.0.1:PORT/; on failure the error quotes the log

Design decisions
- No orphans, in layers (a notebook kernel can crash at any time): (1) on Linux the child gets SIGTERM when its
  parent dies, SIGKILL included (`_Spawner` says why it forks on one thread); (2) `atexit`; (3) a weakref finalizer
  on the handle; (4) `exit_with_parent(pid)`, the child's own poll, where prctl does not exist.
- Each child leads its own process group: `stop()` reaches the child's children (SGLang's schedulers), and a Ctrl-C
  or notebook interrupt sent to the parent's group does not kill the server.
- `wait_ready()` raises `ServerLaunchError` (with the log's tail) if the child exits; a timeout also stops it.
  Once ready, a server that dies unasked says so on stderr at once, with the cause and its log's tail (`_watch`).
- Out of memory, Linux's OOM killer takes a server before its parent (`OOM_SCORE_ADJ`): a notebook's kernel, which
  holds the learner's work, survives and says what happened.
- Our servers serve on a `listening_socket()`, never on a port chosen and released (`find_free_port`: SGLang, vLLM).
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
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
from typing import Any, Callable, Mapping, NoReturn, Optional, Sequence, TypeVar

from areal_lite.utils.lifeline import PR_SET_PDEATHSIG, prctl_function
from areal_lite.utils.network import find_free_port, find_free_ports  # re-exported: the launcher's names

__all__ = [
    "ServerLaunchError",
    "ServerTimeoutError",
    "ServerProcess",
    "find_free_port",
    "find_free_ports",
    "listening_socket",
    "server_log_path",
    "spawn",
    "exit_with_parent",
    "exit_now",
]

logger = logging.getLogger(__name__)


class ServerLaunchError(RuntimeError):
    """The server process died or did not become healthy in time; the message ends with its last log lines."""


class ServerTimeoutError(ServerLaunchError, TimeoutError):
    """The server did not become healthy within the timeout (and was stopped)."""


# ------------------------------------------------------------------------------------------------------------------
# listening sockets (free ports: utils.network)


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: the OS picks a free port) and listening. Hand it to a child with
    `spawn(..., listener=sock)`, which serves on it: the port is never free between being chosen and being served,
    so no other process can take it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what aiohttp sets when it binds itself
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


# ------------------------------------------------------------------------------------------------------------------
# starting children that die with their parent


# Linux's OOM killer picks the process with the highest oom_score (its share of memory, in thousandths, plus this):
# +500 makes it take a server before the kernel or script that started it, unless that one holds half the memory.
OOM_SCORE_ADJ = 500


def _parent_death_preexec() -> Optional[Callable[[], None]]:
    """preexec_fn for Popen: SIGTERM this child when the forking thread/process dies, and make it the OOM killer's
    first choice (`OOM_SCORE_ADJ`) (Linux only)."""
    prctl = prctl_function()  # resolved here, in the parent: no dlopen after fork
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)
        try:  # raw system calls: nothing after fork may take a lock another thread held
            fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            try:
                os.write(fd, str(OOM_SCORE_ADJ).encode())
            finally:
                os.close(fd)
        except OSError:  # no /proc, or a sandbox that forbids it: the child runs as it would have
            pass

    return preexec


class _Spawner:
    """Runs Popen on one long-lived thread when called from any thread but the main one.

    Linux sends the parent-death signal (`prctl(PR_SET_PDEATHSIG)`) when the *thread* that forked the child exits,
    not the process: a server started from a short-lived worker thread would die with that thread."""

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


def spawn(
    cmd: Sequence[str],
    log_path: str,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
    listener: Optional[socket.socket] = None,
) -> subprocess.Popen:
    """Start `cmd` (an argv list) as a child server, in `cwd` (default: ours): stdout and stderr appended to
    `log_path`, stdin from /dev/null, in its own process group, and (on Linux) sent SIGTERM if this process dies.
    `listener` (a `listening_socket()`): the child inherits it under the same descriptor number, and this process's
    copy is closed once the child has started (or failed to), so only the child serves on it."""
    try:
        with open(log_path, "ab") as log:  # the child holds its own copy of the descriptor
            return _SPAWNER.popen(
                list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=None if env is None else dict(env), cwd=cwd,
                pass_fds=() if listener is None else (listener.fileno(),),
                start_new_session=True,  # own process group: stop() reaches the child's children; Ctrl-C does not
                preexec_fn=_parent_death_preexec(),
            )  # fmt: skip
    finally:
        if listener is not None:
            listener.close()


def server_log_path(name: str, port: int, log_dir: Optional[str] = None) -> str:
    """`<log_dir>/<name>-<port>-<time>.log`, by default in the temp folder's `areal-lite-logs/` (created), where
    every server the kit launches writes its log."""
    log_dir = log_dir or os.path.join(tempfile.gettempdir(), "areal-lite-logs")
    os.makedirs(log_dir, exist_ok=True)
    return os.path.join(log_dir, f"{name}-{port}-{time.strftime('%Y%m%d-%H%M%S')}.log")


def exit_with_parent(parent_pid: int, interval: float = 1.0, log: Optional[logging.Logger] = None) -> threading.Thread:
    """Call in a child server: exit the process once `parent_pid` is no longer its parent.

    A daemon thread checks every `interval` seconds; when the parent dies the child is re-parented, so
    `os.getppid()` changes. This is the no-orphan fallback where prctl does not exist, and it also runs while the
    child is still loading (before any event loop starts)."""

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent_pid:
                (log or logger).warning("parent process %d is gone; exiting", parent_pid)
                os._exit(0)  # no cleanup: nobody is left to talk to, and a hung shutdown would be an orphan

    thread = threading.Thread(target=watch, name="areal-lite-parent-watch", daemon=True)
    thread.start()
    return thread


def exit_now(code: int) -> NoReturn:
    """Call last in a child server that has stopped serving: run the `atexit` handlers (logging's flush among them),
    flush stdout and stderr, then end the process with `code`, skipping the interpreter's teardown of every module
    and object. Why: freeing torch's and transformers' modules one by one takes longer than to stop serving, and
    every `ServerProcess.stop()` waits for it. The caller must have closed its files and joined its threads."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):  # closed or replaced by a caller: nothing to flush
                pass
        os._exit(code)


# ------------------------------------------------------------------------------------------------------------------
# stopping


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
        # The leader is gone; its group (e.g. SGLang's scheduler processes) may not be.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass


def _finalize(
    proc: subprocess.Popen,
    log_file: Any,
    on_stop: Optional[Callable[[int], None]],
    timeout: float = 5.0,
    stopping: Optional[threading.Event] = None,
) -> None:
    """Stop the child and run the owner's `on_stop(pid)`. Takes no handle, so a finalizer can call it. `stopping`
    tells the handle's `_watch` that this exit was asked for."""
    if stopping is not None:
        stopping.set()
    _terminate(proc, timeout=timeout)
    if on_stop is not None:
        on_stop(proc.pid)
    if log_file is not None:
        try:
            log_file.close()
        except Exception:
            pass


def _tail(path: str, n: int) -> str:
    """The last `n` lines of the log at `path`."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(collections.deque(f, maxlen=n))
    except OSError as e:
        return f"(cannot read {path}: {e})"


_LIVE: "weakref.WeakValueDictionary[int, ServerProcess]" = weakref.WeakValueDictionary()


@atexit.register
def _stop_all() -> None:
    for handle in list(_LIVE.values()):
        try:
            handle.stop(timeout=5.0)
        except Exception:
            pass


def exit_cause(returncode: int) -> str:
    """How a child ended, from Popen's `returncode`, for a person: "exited with code 1", "was killed by SIGKILL
    (signal 9)", and for SIGKILL what most often sends it."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "an unknown signal"
    cause = f"was killed by {name} (signal {-returncode})"
    if -returncode == signal.SIGKILL:
        cause += (
            ". On Linux that is most often the out-of-memory killer: the machine ran out of memory (`dmesg | grep -i "
            "oom` shows it). Close other notebooks and programs, then run the cells again from the one that starts "
            "the server; notebooks/README.md (Out of memory) gives each notebook's peak"
        )
    return cause


def _watch(proc: subprocess.Popen, where: str, ready: threading.Event, stopping: threading.Event,
           tail: Callable[[], str], interval: float = 1.0) -> None:  # fmt: skip
    """Until the server is stopped: once it has been ready, report at once on stderr if it dies unasked (a crash, the
    OOM killer), with the cause and the log's tail. A notebook shows stderr in the running cell, so the learner sees
    why the next request fails. Holds no reference to the handle, which must stay collectable."""
    while not stopping.wait(interval):
        code = proc.poll()
        if code is None:
            continue
        if ready.is_set() and not stopping.is_set() and code != 0:  # a crash before ready: wait_ready reports it
            print(f"areal-lite: {where} {exit_cause(code)}.\n--- last log lines ---\n{tail()}", file=sys.stderr,
                  flush=True)  # fmt: skip
        return


# ------------------------------------------------------------------------------------------------------------------
# the handle

_H = TypeVar("_H", bound="ServerProcess")


class ServerProcess:
    """A child server process: address, log, readiness check, stop. Also a context manager (exit stops it).

    `on_stop(pid)` runs once when the server is stopped, by `stop()`, at exit or when the handle is collected; it
    must not refer to the handle (that would keep it alive). `log_file`, if given, is closed at the same time.
    """

    def __init__(self, proc: subprocess.Popen, host: str, port: int, log_path: str, *,
                 cmd: Optional[Sequence[str]] = None, label: str = "server", health_path: str = "/health",
                 on_stop: Optional[Callable[[int], None]] = None, log_file: Any = None):  # fmt: skip
        self.proc = proc
        self.host = host
        self.port = port
        self.log_path = log_path
        self.cmd = [str(a) for a in (cmd if cmd is not None else proc.args)]
        self.label = label
        self.health_path = health_path
        self._on_stop = on_stop
        self._log_file = log_file
        self._ready, self._stopping = threading.Event(), threading.Event()
        self._finalizer = weakref.finalize(self, _finalize, proc, log_file, on_stop, 5.0, self._stopping)
        _LIVE[proc.pid] = self
        where = f"the {label} at {host}:{port} (pid {proc.pid}, log {log_path})"
        tail = functools.partial(_tail, log_path, 15)
        threading.Thread(target=_watch, args=(proc, where, self._ready, self._stopping, tail),
                         name=f"areal-lite-watch-{proc.pid}", daemon=True).start()  # fmt: skip

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
        return _tail(self.log_path, n)

    def _failure(self, why: str, error: type = ServerLaunchError) -> ServerLaunchError:
        return error(
            f"{self.label} at {self.address} {why}.\ncommand: {' '.join(self.cmd)}\nlog: {self.log_path}\n"
            f"--- last log lines ---\n{self.tail(30)}"
        )

    def wait_ready(self: _H, timeout: float = 120.0, poll_interval: float = 0.25) -> _H:
        """Block until GET `health_path` answers 200. Raises ServerLaunchError (with the log's tail) if the process
        exits, ServerTimeoutError if `timeout` seconds pass; in the latter case the server is stopped."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self._failure(f"exited with code {code} before becoming ready")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2.0) as r:
                    if r.status == 200:
                        self._ready.set()
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass  # not listening yet, or 503 while loading
            if time.monotonic() >= deadline:
                err = self._failure(f"did not become ready within {timeout:g}s (stopped it)", ServerTimeoutError)
                self.stop()
                raise err
            time.sleep(poll_interval)

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the server (SIGTERM to its group, wait, SIGKILL) and run `on_stop`. Idempotent."""
        if self._finalizer.detach() is not None:  # first call only; later calls (and GC) do nothing
            if _LIVE.get(self.pid) is self:
                del _LIVE[self.pid]
            _finalize(self.proc, self._log_file, self._on_stop, timeout, self._stopping)

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _repr_fields(self) -> str:
        """Extra `name=value, ` pairs a subclass shows first in its repr."""
        return ""

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else f"exited({self.proc.returncode})"
        return (
            f"{type(self).__name__}({self._repr_fields()}address={self.address!r}, pid={self.pid}, {state}, "
            f"log={self.log_path!r})"
        )
