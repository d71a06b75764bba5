"""The bound end of pdserve's ZMQ channels (a router's token receiver, a replica's leg server): an ipc socket
readable by this user only when everything runs on one machine, else TCP on a free port of `host`."""

from __future__ import annotations

import ipaddress
import logging
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import msgspec
import zmq

log = logging.getLogger(__name__)
T = TypeVar("T")


def bind_pull(
    ctx: zmq.Context[zmq.Socket[bytes]], host: str | None, *, hwm: int
) -> tuple[zmq.Socket[bytes], str]:
    """A PULL socket and the address its peers connect to. `host` None or a loopback address: ipc."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if host is None or _loopback(host):
        base = Path(tempfile.gettempdir()) / "pdserve-channels"
        base.mkdir(mode=0o700, exist_ok=True)
        address = f"ipc://{base}/{uuid.uuid4().hex}"
        sock.bind(address)
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
        address = f"tcp://{host}:{port}"
    return sock, address


def frames(sock: zmq.Socket[bytes], decoder: msgspec.msgpack.Decoder[T], channel: str) -> Iterator[T]:
    """Every frame the socket holds now. ZMQ's descriptor signals edges, not levels: it must be drained. A
    frame that does not decode (a peer of another version) is logged and skipped."""
    while True:
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            yield decoder.decode(data)
        except msgspec.DecodeError as exc:
            log.error("%s: undecodable frame (%d bytes): %s", channel, len(data), exc)


def unlink(address: str) -> None:
    """Remove an ipc socket's file (TCP addresses leave nothing behind)."""
    if address.startswith("ipc://"):
        Path(address.removeprefix("ipc://")).unlink(missing_ok=True)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
