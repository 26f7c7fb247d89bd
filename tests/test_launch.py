"""Tests of the launcher: real server processes, readiness, errors that quote the log, and no orphans."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest

from areal_lite.api.cli_args import EmbeddedServerConfig, GRPOConfig, SGLangConfig
from areal_lite.kit.server.launch import ENV_ADDRS, choose_backend, launch_server
from areal_lite.kit.server.procs import ServerLaunchError, find_free_port, find_free_ports


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_dead(pid: int, timeout: float = 60.0) -> bool:
    """Poll until `pid` is gone; the generous deadline costs nothing when it dies at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def kill_server(pid: int) -> None:
    """A test's last-resort cleanup of a server it could not stop through a handle (one outliving its parent): kill
    it and its children, if `pid` is still a kit server (never a process that took over a recycled pid)."""
    try:
        server = psutil.Process(pid)
        if "areal_lite.kit.server" not in " ".join(server.cmdline()):
            return
        for p in [*server.children(recursive=True), server]:
            p.kill()
    except psutil.Error:  # gone already
        pass


def cfg(path: str, **kw) -> EmbeddedServerConfig:
    return EmbeddedServerConfig(model_path=path, threads=1, **kw)


def test_the_launched_command_carries_every_config_option(tiny_model_path, monkeypatch):
    """The command line the launcher builds parses back, in the server's own parser, to the same config."""
    import dataclasses

    from areal_lite.kit.server.cli import parse_args
    from areal_lite.kit.server.launch import _embedded_cmd

    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    config = cfg("ignored", max_prefill_tokens=123, return_original_logprob=True, decode_log_interval=5)
    cmd = _embedded_cmd(config, "127.0.0.1", 4321, tiny_model_path, seed=9)
    assert cmd[1:3] == ["-m", "areal_lite.kit.server"]
    args = vars(parse_args(cmd[3:]))
    for f in dataclasses.fields(EmbeddedServerConfig):
        want = tiny_model_path if f.name == "model_path" else getattr(config, f.name)
        assert args[f.name] == want, f.name
    assert (args["host"], args["port"], args["random_seed"], args["exit_with_parent"]) == (
        "127.0.0.1",
        4321,
        9,
        os.getpid(),
    )


def test_find_free_ports():
    port = find_free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # really free
    ports = find_free_ports(5)
    assert len(set(ports)) == 5


def test_lifecycle(tiny_model_path, tmp_path):
    handle = launch_server(cfg(tiny_model_path), backend="embedded", log_dir=str(tmp_path))
    try:
        assert handle.backend == "embedded" and handle.address == f"127.0.0.1:{handle.port}"
        assert handle.url == f"http://{handle.address}" and handle.log_path.startswith(str(tmp_path))
        assert handle.address in os.environ[ENV_ADDRS].split(",")
        assert handle.wait_ready(timeout=180) is handle
        with urllib.request.urlopen(handle.url + "/health", timeout=5) as r:
            assert r.status == 200
        assert "ready on" in handle.tail(50)
        assert "embedded" in repr(handle) and "running" in repr(handle)
        cmdline = " ".join(psutil.Process(handle.pid).cmdline())
        assert "areal_lite.kit.server" in cmdline and "--threads 1" in cmdline
    finally:
        handle.stop()
    assert not alive(handle.pid)
    # SIGTERM is a clean stop: exit code 0 (not the signal's), the log flushed to its last line
    assert handle.proc.returncode == 0 and handle.tail(5).rstrip().endswith("shutting down")
    assert handle.address not in os.environ.get(ENV_ADDRS, "").split(",")
    handle.stop()  # idempotent
    assert "exited" in repr(handle)


def taken(port: int) -> bool:
    """Whether another process binding `port` on 127.0.0.1 now fails (as a starting server's would)."""
    with socket.socket() as intruder:
        try:
            intruder.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_the_port_is_held_from_launch_not_from_when_the_server_binds(tiny_model_path, tmp_path):
    """The embedded server serves on a socket the launcher bound: from the moment launch_server returns, while the
    child is still importing, no other process can take the port (a port picked and released could be taken, and
    the server would die with "address already in use"; the same race in jupyter_client's choice of a kernel's
    ports killed a notebook kernel once in CI)."""
    handle = launch_server(cfg(tiny_model_path), backend="embedded", log_dir=str(tmp_path))
    try:
        assert taken(handle.port) and "--listen-fd" in handle.cmd
        handle.wait_ready(timeout=180)
        with urllib.request.urlopen(handle.url + "/health", timeout=5) as r:
            assert r.status == 200
        ours = psutil.Process().net_connections(kind="tcp")
        assert not [c for c in ours if c.status == psutil.CONN_LISTEN and c.laddr.port == handle.port], (
            "the launcher kept its copy of the listening socket"
        )
    finally:
        handle.stop()


def test_the_launchers_omp_num_threads_caps_the_servers_threads(tiny_model_path, tmp_path, monkeypatch):
    """A config asking for 2 server threads gets 1 under OMP_NUM_THREADS=1 (how `make test` shares 2 cores).

    The launcher used to overwrite the variable with the config's count, so two notebooks on two cores each ran a
    2-thread server that spin-waited for descheduled siblings (one notebook took ten times as long).
    """
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    handle = launch_server(EmbeddedServerConfig(model_path=tiny_model_path, threads=2), backend="embedded",
                           log_dir=str(tmp_path))  # fmt: skip
    try:
        handle.wait_ready(timeout=180)
        assert psutil.Process(handle.pid).environ()["OMP_NUM_THREADS"] == "1"
        assert "threads=1 " in handle.tail(50)
    finally:
        handle.stop()
    monkeypatch.delenv("OMP_NUM_THREADS")
    handle = launch_server(EmbeddedServerConfig(model_path=tiny_model_path, threads=2), backend="embedded",
                           log_dir=str(tmp_path))  # fmt: skip
    try:  # the environment is set at spawn: no need to wait for the model to load (stop() handles a loading server)
        assert psutil.Process(handle.pid).environ()["OMP_NUM_THREADS"] == "2"  # no cap: the config's count
    finally:
        handle.stop()


def test_exception_inside_with_stops_server(tiny_model_path):
    with pytest.raises(RuntimeError, match="boom"):
        with launch_server(cfg(tiny_model_path), backend="embedded") as handle:
            pid = handle.pid
            assert alive(pid)
            raise RuntimeError("boom")
    assert wait_dead(pid)


ENV_SCRIPT = r"""
import os, sys
os.environ["AREAL_LLM_SERVER_ADDRS"] = "10.0.0.9:30000"
from areal_lite.api.cli_args import EmbeddedServerConfig
from areal_lite.kit.server.launch import launch_server
a = launch_server(EmbeddedServerConfig(model_path=sys.argv[1]), backend="embedded")
b = launch_server(EmbeddedServerConfig(model_path=sys.argv[1]), backend="embedded")
assert os.environ["AREAL_LLM_SERVER_ADDRS"] == f"{a.address},{b.address}", os.environ["AREAL_LLM_SERVER_ADDRS"]
a.stop()
assert os.environ["AREAL_LLM_SERVER_ADDRS"] == b.address
b.stop()
assert os.environ["AREAL_LLM_SERVER_ADDRS"] == "10.0.0.9:30000"
print("ENV-OK")
"""


def test_server_addrs_env_follows_live_servers(tiny_model_path):
    out = subprocess.run(
        [sys.executable, "-c", ENV_SCRIPT, tiny_model_path], capture_output=True, text=True, timeout=120
    )
    assert "ENV-OK" in out.stdout, out.stdout + out.stderr


CHILD = r"""
import sys, time
from areal_lite.api.cli_args import EmbeddedServerConfig
from areal_lite.kit.server.launch import launch_server
h = launch_server(EmbeddedServerConfig(model_path=sys.argv[1], threads=1), backend="embedded")
print("PID", h.pid, flush=True)
h.wait_ready(timeout=180)
print("READY", flush=True)
time.sleep(600)
"""


def test_killing_the_parent_leaves_no_server(tiny_model_path):
    parent = subprocess.Popen([sys.executable, "-c", CHILD, tiny_model_path], stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        lines = []
        for line in parent.stdout:
            lines.append(line)
            if line.startswith("READY"):
                break
        pid = int(next(l for l in lines if l.startswith("PID")).split()[1])
        assert "READY" in lines[-1], lines
        assert "areal_lite.kit.server" in " ".join(psutil.Process(pid).cmdline())
        parent.send_signal(signal.SIGKILL)  # no atexit, no finalizers: only the kernel's parent-death signal
        parent.wait(timeout=10)
        assert wait_dead(pid), "the server outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait(timeout=10)
        parent.stdout.close()
        if pid is not None:  # a server that outlived its parent (the failure checked above) is not left running
            kill_server(pid)


def test_launch_from_a_short_lived_thread_survives_the_thread(tiny_model_path):
    box = {}
    t = threading.Thread(target=lambda: box.update(h=launch_server(cfg(tiny_model_path), backend="embedded")))
    t.start()
    t.join()
    handle = box["h"]
    try:
        # The thread is gone before the server can be ready (loading takes seconds): a server killed by its exit
        # never answers, and wait_ready raises with the log. A fixed 1 s sleep could end before a slow kill showed.
        handle.wait_ready(timeout=180)
        assert handle.is_alive(), handle.tail()  # the parent-death signal is not tied to the finished thread
    finally:
        handle.stop()
    assert not alive(handle.pid)


def test_dead_server_raises_with_log_tail(tmp_path):
    handle = launch_server(cfg(str(tmp_path / "no-such-model")), backend="embedded")
    try:
        with pytest.raises(ServerLaunchError) as err:
            handle.wait_ready(timeout=120)
        msg = str(err.value)
        assert "exited with code" in msg and "last log lines" in msg and "no-such-model" in msg
        assert "no such folder" in msg and "Traceback" not in msg  # the user's mistake: its message, not a trace
        assert not handle.is_alive()
    finally:  # a server that did start (the failure checked above) is not left running
        handle.stop()


def test_timeout_raises_and_stops(tiny_model_path):
    handle = launch_server(cfg(tiny_model_path), backend="embedded")
    try:
        with pytest.raises(ServerLaunchError, match="did not become ready within"):
            handle.wait_ready(timeout=0.01)
        assert not handle.is_alive()  # stopped by wait_ready itself
    finally:  # idempotent, so a no-op when the checks pass; a failed one must not leave the server running
        handle.stop()


def test_backend_choice_and_config_kinds(tiny_model_path):
    import importlib.util

    import torch

    backend, why = choose_backend("auto")
    if not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None:
        assert backend == "embedded" and why.startswith("auto:")
    assert choose_backend("embedded") == ("embedded", "requested")
    assert choose_backend("vllm") == ("vllm", "requested")  # opt-in: never picked by auto
    with pytest.raises(ValueError):
        choose_backend("mlx")
    from areal_lite.utils.model_store import ModelPathError

    with pytest.raises(ModelPathError, match="no model path"):  # the trainer's and CLIs' one-line error
        launch_server(EmbeddedServerConfig(), backend="embedded")
    with pytest.raises(ValueError, match="SGLangConfig"):
        launch_server(SGLangConfig(model_path="x"), backend="embedded")
    with pytest.raises(TypeError):
        launch_server({"model_path": "x"})

    # a whole experiment config: backend and model path come from it
    config = GRPOConfig()
    config.backend = "embedded"
    config.actor.path = tiny_model_path
    config.embedded.threads = 1
    handle = launch_server(config)
    try:
        assert handle.backend == "embedded" and tiny_model_path in handle.cmd
        assert handle.cmd[handle.cmd.index("--random-seed") + 1] == str(config.seed)
    finally:
        handle.stop()
