"""Free TCP ports for what a replica binds by number (vLLM's KV event publisher, NIXL's side channel, a local
Ray head's ports)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ports drawn below the kernel's ephemeral range (and above Ray's worker ports, 10002-19999): a port drawn
# there goes only to a process that asks for it by number. A port found free by binding port 0 comes from
# the ephemeral range, where any outgoing connection may take it before vLLM binds it; vLLM's NIXL
# handshake listener then dies on "Address already in use" and the engine hangs in start-up (seen when a
# replacement replica started while the cluster was busy).
_PORT_LOW = 20_000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on every interface now, outside the ephemeral range where there is room.
    All are held until the last is drawn: two equal ports would stop the engine (vLLM's publisher binds both
    of its endpoints, NIXL its side channel). Another process asking for the same number can still take
    one before vLLM binds it (Serve then restarts the replica)."""
    high = _ephemeral_low()
    pick = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for _ in range(200 * n):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            port = pick.randrange(_PORT_LOW, high) if high - _PORT_LOW > 1000 else 0
            try:
                s.bind(("0.0.0.0", port))  # not listening: free on 0.0.0.0 means free on the node's address
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise OSError(f"no {n} free ports in {_PORT_LOW}-{high - 1}")
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
