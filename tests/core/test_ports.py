"""Ports for a local world's store: free now, and out of the range outgoing connections take theirs from."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from shardcore.engine.live import ports


def test_a_port_lies_below_the_ephemeral_range_and_binds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bounds = tmp_path / "ip_local_port_range"
    bounds.write_text("10100\t60999\n")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", bounds)
    given = [ports.free_port() for _ in range(40)]
    assert all(10000 <= port < 10100 for port in given)
    assert len(set(given)) == len(given), "one process never hands out one port twice"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", given[-1]))


def test_a_taken_port_is_never_handed_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bounds = tmp_path / "ip_local_port_range"
    bounds.write_text("10002 60999")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", bounds)
    monkeypatch.setattr(ports, "_given", set())
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        try:
            taken.bind(("127.0.0.1", 10000))
        except OSError:
            pytest.skip("port 10000 is in use on this machine")
        taken.listen()
        assert {ports.free_port() for _ in range(20)} <= {10001} | set(range(32768, 65536))


def test_without_room_below_the_range_the_kernel_chooses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bounds = tmp_path / "ip_local_port_range"
    bounds.write_text("1024 65535")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", bounds)
    port = ports.free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
