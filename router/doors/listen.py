"""Binding the doors' addresses: a clear error naming the topology field when one cannot be listened on."""

from __future__ import annotations

import socket


class ListenError(OSError):
    """A configured endpoint cannot be listened on; the message names the topology field."""

    def __init__(self, field: str, address: str, reason: str) -> None:
        super().__init__(f"{field}: cannot listen on {address} ({reason})")


def bind(field: str, host: str, port: int, *, shared: bool = False) -> socket.socket:
    """A socket bound to `host:port` (SO_REUSEADDR, as the servers set it: a port in TIME_WAIT from a previous
    run is free), or ListenError. `shared`: SO_REUSEPORT too, so that the routers on one node listen on the
    same port (the kernel spreads connections among them); a socket bound without it still fails on it."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if shared:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(addr)
        except BaseException:
            sock.close()
            raise
    except OSError as exc:
        raise ListenError(field, f"{host}:{port}", exc.strerror or str(exc)) from exc
    return sock


def check_listen(field: str, host: str, port: int) -> None:
    """Raise ListenError unless `host:port` can be bound now (so `pdserve up` fails before its engines spend
    minutes starting)."""
    bind(field, host, port).close()
