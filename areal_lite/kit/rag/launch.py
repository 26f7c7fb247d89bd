"""`launch_rag_server`: the RAG server as a child process of a notebook or a script.

It runs through `kit.server.procs`, as the inference servers do: the log tail goes into errors, and the child exits
with its parent, so a kernel restart leaves no orphan holding the port.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from areal_lite.kit.server.procs import ServerProcess, listening_socket, server_log_path, spawn

__all__ = ["RAGServerHandle", "launch_rag_server"]


class RAGServerHandle(ServerProcess):
    """A running `python -m areal_lite.kit.rag` child process (see `procs.ServerProcess`). `.address` is "host:port";
    `with launch_rag_server(...) as srv:` waits until it is ready and stops it at the end."""

    def __init__(self, process: subprocess.Popen, host: str, port: int, log_path: str):
        super().__init__(process, host, port, log_path, label="RAG server")

    @property
    def process(self) -> subprocess.Popen:
        return self.proc

    def log_tail(self, n: int = 30) -> str:
        """The last `n` lines of the server's log."""
        return self.tail(n)

    def __enter__(self) -> "RAGServerHandle":
        return self.wait_ready()


def launch_rag_server(
    corpus: str | os.PathLike,
    retriever: str = "bm25",
    port: int | None = None,
    host: str = "127.0.0.1",
    index_cache: str | None = None,
    max_dense_docs: int | None = None,
    threads: int = 1,
) -> RAGServerHandle:
    """Start the RAG server in a subprocess (free port by default). Use `with ... as srv:` or `.wait_ready()`."""
    if not os.path.exists(corpus):
        raise FileNotFoundError(f"corpus file not found: {corpus}")
    # No port given: the server inherits a socket that already listens (procs.listening_socket), so the seconds
    # it spends building its index cannot let another process take the port.
    sock = None if port else listening_socket(host)
    port = port or sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "areal_lite.kit.rag",
        "--corpus",
        str(corpus),
        "--retriever",
        retriever,
        "--host",
        host,
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--exit-with-parent",
        str(os.getpid()),
    ]
    if index_cache:
        cmd += ["--index-cache", str(index_cache)]
    if max_dense_docs:
        cmd += ["--max-dense-docs", str(max_dense_docs)]
    if sock is not None:
        cmd += ["--listen-fd", str(sock.fileno())]
    env = dict(os.environ)
    # The child must import this package even when it is not installed (running from a checkout).
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    log_path = server_log_path("rag", port)  # beside the inference servers' logs
    return RAGServerHandle(spawn(cmd, log_path, env, listener=sock), host, port, log_path)
