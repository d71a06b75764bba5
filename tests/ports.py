"""Ports for the clusters tests start.

A port found free by binding to port 0 comes from the kernel's ephemeral range, and a cluster starting in
the meantime (Ray's processes, the engines, NIXL) takes ephemeral ports of its own for outgoing connections:
once a router then failed to bind the gRPC port a test had picked 40 s earlier. Ports below the ephemeral
range and above Ray's worker ports (10002-19999) go only to processes that ask for them by number."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOW = 20_000  # above Ray's default worker port range
_HANDED_OUT: set[int] = set()  # this test process's ports: a test binds its ports only after drawing them all


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and outside the ephemeral range where possible.

    A port is free until its test binds it, so two calls in one test could draw the same one (it happened in
    CI: grpc_port == metrics_port). No port is handed out twice in one process."""
    high = _ephemeral_low()
    if high > _LOW:
        for port in random.sample(range(_LOW, high), k=min(200, high - _LOW)):
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
