"""The ports a replica binds by number: free, distinct, and where no outgoing connection takes them first."""

import socket

from engine.ports import _PORT_LOW, _ephemeral_low, free_ports


def test_an_engine_hosts_ports_are_distinct_and_free() -> None:
    # NIXL's side channel and the KV-event publisher's two endpoints: two equal ports stop the engine.
    for _ in range(200):
        ports = free_ports(3)
        assert len(set(ports)) == 3
        for port in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    # An ephemeral port can be taken by any outgoing connection before vLLM binds it; NIXL's handshake
    # listener then dies and the engine hangs in start-up. Ports below the range go only to who asks.
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(_PORT_LOW <= p < _ephemeral_low() for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("0.0.0.0", p))
