"""Ports for the clusters tests start.

A port found free by binding to port 0 comes from the kernel's ephemeral range, and a cluster starting in
the meantime (Ray's processes, the engines, NIXL) takes ephemeral ports of its own for outgoing connections:
once a router then failed to bind the gRPC port a test had picked 40 s earlier. Ports below the ephemeral
range and above Ray's worker ports (10002-19999) go only to processes that ask for them by number."""

from __future__ import annotations

from engine.ports import free_ports

_HANDED_OUT: set[int] = set()  # this test process's ports: a test binds its ports only after drawing them all


def free_port() -> int:
    """A port that is free now, outside the ephemeral range where possible (engine.ports.free_ports).

    A port is free until its test binds it, so two calls in one test could draw the same one (it happened in
    CI: grpc_port == metrics_port). No port is handed out twice in one process."""
    while True:
        (port,) = free_ports(1)
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
