"""Free ports, at AReaL 1.0.4's path (`areal.utils.network`) with its signatures.

- `find_free_ports(count, port_range, exclude_ports)` is AReaL's: distinct ports drawn at random from a range below
  Linux's ephemeral range (32768-60999), where the OS does not hand out ports of its own between the check and the
  bind; each is free for TCP and UDP on every interface. Unlike AReaL's, every port stays bound until all are
  chosen, so a port cannot be checked twice, and the error says which range was searched.
- `find_free_port(host)` is the kit's: one port the OS picks on `host`, for servers that bind it themselves
  (SGLang, vLLM). The kit's own servers get a socket that already listens (`kit.server.procs.listening_socket`), so no
  port is ever free between being chosen and being served.
"""

from __future__ import annotations

import random
import socket

__all__ = ["find_free_port", "find_free_ports", "is_port_free"]


def _hold(port: int) -> list[socket.socket] | None:
    """TCP and UDP sockets bound to `port` on every interface, or None (nothing left open) when either bind fails."""
    socks = []
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        sock = socket.socket(socket.AF_INET, kind)
        try:
            sock.bind(("", port))
        except OSError:
            sock.close()
            for s in socks:
                s.close()
            return None
        socks.append(sock)
    return socks


def is_port_free(port: int) -> bool:
    """True when `port` can be bound for TCP and for UDP on every interface (AReaL's check)."""
    socks = _hold(port)
    for sock in socks or ():
        sock.close()
    return socks is not None


def find_free_ports(count: int, port_range: tuple = (10000, 32767), exclude_ports: set[int] | None = None) -> list[int]:
    """`count` distinct free ports in `port_range` (inclusive), none in `exclude_ports`, sorted.

    Raises `ValueError` when the range holds fewer than `count` candidates, or when `count * 10` random draws find
    fewer free ports (AReaL's limits).
    """
    exclude = set(exclude_ports or ())
    low, high = port_range
    available = high - low + 1 - len(exclude)
    if count > available:
        raise ValueError(f"Cannot find {count} ports in range {port_range}. Only {available} ports available.")
    held: dict[int, list[socket.socket]] = {}
    tried: set[int] = set()
    try:
        for _ in range(count * 10):
            if len(held) == count:
                break
            port = random.randint(low, high)
            if port in tried or port in exclude:
                continue
            tried.add(port)
            socks = _hold(port)
            if socks is not None:
                held[port] = socks  # kept bound: the next draw cannot land on it
    finally:
        for socks in held.values():
            for s in socks:
                s.close()
    if len(held) < count:
        raise ValueError(
            f"Could only find {len(held)} free ports out of {count} requested after {count * 10} attempts "
            f"in range {port_range}"
        )
    return sorted(held)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that the OS picks and that was free a moment ago, for a server that binds it itself
    (SGLang, vLLM): any process that binds port 0 before the child can take it, and the child then exits with
    "address already in use" in its log."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
