"""Tests of areal_lite.kit.server.procs with real tiny child processes on 127.0.0.1: readiness, errors that quote the
log, stop (with escalation and the child's own children), and no orphans when the parent dies."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from areal_lite.kit.server.procs import (
    _LIVE,
    OOM_SCORE_ADJ,
    ServerLaunchError,
    ServerProcess,
    ServerTimeoutError,
    exit_cause,
    find_free_port,
    find_free_ports,
    spawn,
)

PY = sys.executable


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def start(tmp_path, code: str, label: str = "test server") -> ServerProcess:
    """A ServerProcess around `python -c code`, started with procs.spawn, on a free port that nothing serves."""
    log = str(tmp_path / f"{label.replace(' ', '-')}.log")
    return ServerProcess(spawn([PY, "-c", code], log), "127.0.0.1", find_free_port(), log, label=label)


def test_find_free_ports():
    port = find_free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert len(set(find_free_ports(4))) == 4


def test_spawn_runs_the_child_in_cwd(tmp_path):
    """`cwd` is the child's working directory (the throughput bench runs another source tree's server from it)."""
    log, where = tmp_path / "cwd.log", tmp_path / "elsewhere"
    where.mkdir()
    proc = spawn([PY, "-c", "import os; print(os.getcwd(), flush=True)"], str(log), cwd=str(where))
    assert proc.wait(timeout=60) == 0
    assert log.read_text().strip() == str(where)


def test_wait_ready_then_stop(tmp_path):
    port = find_free_port()
    log = str(tmp_path / "http.log")
    cmd = [PY, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(tmp_path), str(port)]
    srv = ServerProcess(spawn(cmd, log), "127.0.0.1", port, log, label="file server", health_path="/")
    with srv:
        assert srv.wait_ready(timeout=30) is srv
        assert srv.is_alive() and srv.address == f"127.0.0.1:{port}" and srv.url == f"http://127.0.0.1:{port}"
        assert srv.cmd == cmd and _LIVE[srv.pid] is srv
        assert "running" in repr(srv) and f"pid={srv.pid}" in repr(srv)
        assert "GET / " in srv.tail()  # http.server logs each request to stderr, which goes to the log
        assert psutil.Process(srv.pid).ppid() == os.getpid()
        assert os.getpgid(srv.pid) == srv.pid  # its own process group: stop() signals the group
    assert not alive(srv.pid) and srv.pid not in _LIVE
    assert "exited" in repr(srv)
    srv.stop()  # idempotent


def test_child_that_exits_early_names_its_log_tail(tmp_path):
    srv = start(tmp_path, "import sys; print('cannot load weights from /nowhere', flush=True); sys.exit(3)")
    with pytest.raises(ServerLaunchError) as err:
        srv.wait_ready(timeout=30)
    msg = str(err.value)
    assert "test server at 127.0.0.1:" in msg and "exited with code 3" in msg
    assert "last log lines" in msg and "cannot load weights from /nowhere" in msg and srv.log_path in msg
    assert not isinstance(err.value, TimeoutError)
    srv.stop()


def test_timeout_stops_the_child(tmp_path):
    srv = start(tmp_path, "import time; print('loading forever', flush=True); time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(ServerTimeoutError) as err:
        srv.wait_ready(timeout=0.5, poll_interval=0.05)
    assert time.monotonic() - t0 < 60  # the 0.5 s timeout, not the 120 s default (room for a loaded machine)
    assert isinstance(err.value, TimeoutError) and isinstance(err.value, ServerLaunchError)
    assert "did not become ready within 0.5s" in str(err.value)
    assert not srv.is_alive()


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path):
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('armed', flush=True); time.sleep(60)"
    )
    srv = start(tmp_path, code)
    assert wait_until(lambda: "armed" in srv.tail()), srv.tail()
    srv.stop(timeout=0.3)
    assert srv.proc.returncode == -signal.SIGKILL


def test_stop_reaches_the_childs_own_children(tmp_path):
    code = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('GRANDCHILD', g.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    srv = start(tmp_path, code)
    assert wait_until(lambda: "GRANDCHILD" in srv.tail()), srv.tail()
    grandchild = int(srv.tail().split("GRANDCHILD")[1].split()[0])
    assert alive(grandchild)
    srv.stop()
    assert wait_until(lambda: not alive(grandchild), 60)


def file_server(tmp_path) -> ServerProcess:
    """A ready `http.server` child, as a ServerProcess."""
    port = find_free_port()
    log = str(tmp_path / "http.log")
    cmd = [PY, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(tmp_path), str(port)]
    return ServerProcess(spawn(cmd, log), "127.0.0.1", port, log, label="file server", health_path="/").wait_ready(30)


def test_a_ready_server_that_dies_unasked_says_why_at_once(tmp_path, capsys):
    """Killed as the OOM killer kills (SIGKILL), a ready server reports it on stderr by itself, with the cause, what
    to do and its log's tail: a notebook shows it in the running cell, before the next request fails."""
    srv = file_server(tmp_path)
    os.kill(srv.pid, signal.SIGKILL)
    said = []
    assert wait_until(lambda: said.append(capsys.readouterr().err) or "areal-lite:" in "".join(said))
    msg = "".join(said)
    assert f"the file server at {srv.address} (pid {srv.pid}, log {srv.log_path})" in msg
    assert "was killed by SIGKILL (signal 9)" in msg and "out-of-memory killer" in msg and "Out of memory" in msg
    assert "last log lines" in msg and "Serving HTTP on 127.0.0.1" in msg
    srv.stop()


def test_a_server_stopped_or_failing_to_start_gets_no_second_report(tmp_path, capsys):
    """stop() (and a crash before ready, which wait_ready raises) print nothing: only an unasked death is news."""
    srv = file_server(tmp_path)
    watcher = next(t for t in threading.enumerate() if t.name == f"areal-lite-watch-{srv.pid}")
    srv.stop()
    watcher.join(timeout=10)
    early = start(tmp_path, "import sys; sys.exit(3)")
    with pytest.raises(ServerLaunchError):
        early.wait_ready(timeout=30)
    watcher = next((t for t in threading.enumerate() if t.name == f"areal-lite-watch-{early.pid}"), None)
    if watcher is not None:
        watcher.join(timeout=10)  # it saw the exit and ended without a word
    assert not watcher or not watcher.is_alive()
    assert "areal-lite:" not in capsys.readouterr().err
    early.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="oom_score_adj is Linux's")
def test_out_of_memory_the_kernel_takes_a_server_before_its_parent(tmp_path):
    srv = start(tmp_path, "import time; time.sleep(60)")
    with open(f"/proc/{srv.pid}/oom_score_adj") as f:
        assert int(f.read()) == OOM_SCORE_ADJ > 0
    with open("/proc/self/oom_score_adj") as f:
        assert int(f.read()) < OOM_SCORE_ADJ  # the parent keeps its own
    srv.stop()


def test_exit_causes_read_as_a_person_would_say_them():
    assert exit_cause(3) == "exited with code 3"
    assert exit_cause(-signal.SIGTERM) == "was killed by SIGTERM (signal 15)"
    assert exit_cause(-signal.SIGKILL).startswith("was killed by SIGKILL (signal 9). On Linux that is most often")
    assert exit_cause(-200) == "was killed by an unknown signal (signal 200)"


def test_collected_handle_stops_its_child_and_runs_on_stop_once(tmp_path):
    stopped = []
    log = str(tmp_path / "gc.log")
    srv = ServerProcess(
        spawn([PY, "-c", "import time; time.sleep(60)"], log), "127.0.0.1", 1, log, on_stop=stopped.append
    )
    pid = srv.pid
    del srv
    gc.collect()
    assert stopped == [pid] and not alive(pid)


# Says ARMED once its SIGWINCH handler is set; answers each SIGWINCH with PONG.
PINGABLE = (
    "import signal, time\n"
    "signal.signal(signal.SIGWINCH, lambda *a: print('PONG', flush=True))\n"
    "print('ARMED', flush=True)\n"
    "time.sleep(60)\n"
)


def test_spawn_from_a_short_lived_thread_survives_the_thread(tmp_path):
    box = {}
    t = threading.Thread(target=lambda: box.update(srv=start(tmp_path, PINGABLE)))
    t.start()
    t.join()
    srv = box["srv"]
    try:
        # The parent-death signal follows the forking thread; the spawner thread outlives this one. Instead of
        # watching the child for 0.5 s (a late SIGTERM would pass unseen): once the thread has left the kernel's
        # task list, any SIGTERM it triggered has been sent, and a child with SIGTERM's default action is then
        # already condemned. A child that still answers a later ping was never sent it.
        assert wait_until(lambda: "ARMED" in srv.tail() or not srv.is_alive(), 60), srv.tail()
        assert wait_until(lambda: t.native_id not in {th.id for th in psutil.Process().threads()}, 60)
        srv.proc.send_signal(signal.SIGWINCH)  # a no-op once the child has been reaped
        assert wait_until(lambda: "PONG" in srv.tail() or not srv.is_alive(), 60), srv.tail()
        assert srv.is_alive() and "PONG" in srv.tail(), srv.tail()
    finally:
        srv.stop()


# An intermediate parent: starts a sleeping child one of three ways, says the child's pid, then waits to be killed
# (or, for "exit", exits normally). Each way exercises one no-orphan layer alone.
PARENT = r"""
import subprocess, sys, time
from areal_lite.kit.server.procs import ServerProcess, spawn
how, log = sys.argv[1], sys.argv[2]
if how == "spawn":  # prctl on Linux
    proc = spawn([sys.executable, "-c", "import time; time.sleep(60)"], log)
elif how == "watch":  # a plain child that watches its parent itself; it says when it watches
    code = ("import os, time; from areal_lite.kit.server.procs import exit_with_parent; "
            "exit_with_parent(os.getppid(), 0.1); print('WATCHING', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code])
else:  # a plain child: only this process's atexit hook and finalizers can stop it
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('STARTED', flush=True); time.sleep(60)"])
handle = ServerProcess(proc, "127.0.0.1", 1, log)
print("CHILD", proc.pid, flush=True)
if how == "exit":
    sys.exit(0)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["spawn", "watch", "exit"])
def test_child_dies_with_its_parent(tmp_path, how):
    parent = subprocess.Popen([PY, "-c", PARENT, how, str(tmp_path / "child.log")], stdout=subprocess.PIPE, text=True)
    try:
        lines = [parent.stdout.readline() for _ in range(1 if how == "spawn" else 2)]
        child = int(next(line for line in lines if line.startswith("CHILD")).split()[1])
        if how == "exit":
            parent.wait(timeout=15)
        else:
            assert alive(child)
            parent.send_signal(signal.SIGKILL)  # no atexit, no finalizers run in the parent
            parent.wait(timeout=10)
        assert wait_until(lambda: not alive(child), 60), f"child {child} outlived its parent ({how})"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_exit_now_keeps_the_exit_code_and_loses_no_output(tmp_path):
    """What a stopping server leaves must all arrive: block-buffered stdout, its log handler's records, its atexit
    handlers (in their usual last-in-first-out order), and the code it exits with."""
    log, marks = tmp_path / "server.log", tmp_path / "atexit.txt"
    code = f"""
import atexit, logging, sys
from areal_lite.kit.server.procs import exit_now
logging.basicConfig(filename={str(log)!r}, level=logging.INFO)
atexit.register(lambda: open({str(marks)!r}, "a").write("registered first, runs last\\n"))
atexit.register(lambda: open({str(marks)!r}, "a").write("registered last, runs first\\n"))
logging.getLogger("server").info("shutting down")
print("buffered line")  # stdout is a file here: block-buffered, not yet written
sys.stderr.write("unflushed stderr\\n")
exit_now(3)
print("never printed")
"""
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.run([PY, "-c", code], stdout=o, stderr=e, timeout=60)
    assert proc.returncode == 3
    assert out.read_text() == "buffered line\n"
    assert err.read_text() == "unflushed stderr\n"
    assert "shutting down" in log.read_text()
    assert marks.read_text().splitlines() == ["registered last, runs first", "registered first, runs last"]
