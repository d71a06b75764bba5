"""The engine host's own pieces that run before vLLM starts (the engine itself: tests/e2e)."""

import socket

from engine.host import free_ports


def test_an_engine_hosts_ports_are_distinct_and_free() -> None:
    # NIXL's side channel and the KV-event publisher's two endpoints: two equal ports stop the engine.
    for _ in range(200):
        ports = free_ports(3)
        assert len(set(ports)) == 3
        for port in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
