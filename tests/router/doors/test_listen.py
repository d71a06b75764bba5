"""The doors' listening sockets: a port that cannot be bound is refused with the topology field named; the
routers of one node share their doors' ports (SO_REUSEPORT), and a port they hold is still in use to anyone
else (`pdserve up` checks it before it starts a cluster)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any, cast

import pytest
from ports import free_port

from router.doors.grpc_service import PdserveService, start_grpc_server
from router.doors.listen import ListenError, bind, check_listen


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process is listening on."""
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield port


class _AnyMethod:
    """Stands in for PdserveService: these tests bind sockets and send no calls."""

    def __getattr__(self, name: str) -> Any:
        async def method(*args: Any) -> None:
            raise AssertionError(f"{name} called")

        return method


SERVICE = cast(PdserveService, _AnyMethod())


def test_check_listen_names_the_field_of_a_port_in_use(held_port: int) -> None:
    with pytest.raises(ListenError) as info:
        check_listen("server.grpc_port", "127.0.0.1", held_port)
    assert str(info.value).startswith(f"server.grpc_port: cannot listen on 127.0.0.1:{held_port} (")
    assert "in use" in str(info.value)


def test_check_listen_accepts_a_free_port_and_refuses_a_foreign_address() -> None:
    check_listen("server.metrics_port", "127.0.0.1", free_port())
    with pytest.raises(ListenError, match=r"^server.metrics_port: cannot listen on 192.0.2.1:"):
        check_listen("server.metrics_port", "192.0.2.1", free_port())  # TEST-NET-1: not this machine's


async def test_a_port_in_use_is_a_listen_error(held_port: int) -> None:
    with pytest.raises(ListenError, match=rf"^server.grpc_port: cannot listen on 127.0.0.1:{held_port} "):
        await start_grpc_server(SERVICE, host="127.0.0.1", port=held_port)


async def test_the_routers_of_a_node_share_the_grpc_port_and_it_is_in_use_to_anyone_else() -> None:
    port = free_port()
    first, _ = await start_grpc_server(SERVICE, host="127.0.0.1", port=port)
    try:
        second, _ = await start_grpc_server(SERVICE, host="127.0.0.1", port=port)
        try:
            with pytest.raises(ListenError, match="in use"):
                check_listen("server.grpc_port", "127.0.0.1", port)
        finally:
            await second.stop(grace=None)
    finally:
        await first.stop(grace=None)


def test_the_http_doors_of_a_node_share_their_port_and_the_kernel_spreads_connections() -> None:
    port = free_port()
    a, b = (
        bind("server.http_port", "127.0.0.1", port, shared=True),
        bind("server.http_port", "127.0.0.1", port, shared=True),
    )
    try:
        for s in (a, b):
            s.listen()
            s.setblocking(False)
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
        accepted = {id(a): 0, id(b): 0}
        for s in (a, b):
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                conn.close()
                accepted[id(s)] += 1
        assert sum(accepted.values()) == 64
        assert min(accepted.values()) > 0  # both routers take connections
        for c in clients:
            c.close()
        with pytest.raises(ListenError, match="in use"):
            check_listen("server.http_port", "127.0.0.1", port)
    finally:
        a.close()
        b.close()
