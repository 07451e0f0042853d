"""Free TCP ports on 127.0.0.1, for a local world's store or rendezvous.

A port is chosen now and bound later, sometimes many seconds later (a survivors' store is hosted only after a
rank has died). A port the kernel hands out for ``bind(0)`` lies in the ephemeral range, the same range every
outgoing connection on the machine takes its local port from: in between, another job's connection may take it,
and the store fails with EADDRINUSE. So the port is drawn at random from below that range, where the kernel never
assigns one on its own, and checked free by binding it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LINUX_EPHEMERAL_START = 32768  # the kernel's default start of that range
_LOWEST = 10000  # below it lie the ports services are commonly configured on
_TRIES = 64
_given: set[int] = set()  # this process never hands out one port twice (two worlds it starts would collide)


def _ephemeral_start() -> int:
    """Where the machine's ephemeral range starts (the kernel's default where it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _LINUX_EPHEMERAL_START


def _bindable(port: int) -> bool:
    """Whether ``port`` on 127.0.0.1 can be bound right now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now and that no outgoing connection will take meanwhile (for a
    world's store or rendezvous); a port from ``bind(0)`` where the range below the ephemeral one is full or absent.
    """
    start = _ephemeral_start()
    if start > _LOWEST:
        for _ in range(_TRIES):
            port = random.randrange(_LOWEST, start)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    _given.add(port)
    return port


__all__ = ["free_port"]
