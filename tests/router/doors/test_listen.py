"""The gRPC endpoint's listening socket: a port that cannot be bound is refused with the topology field named,
and a second server never shares a port with the first."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any, cast

import pytest
from ports import free_port

from router.doors.grpc_service import PdserveService, start_grpc_server
from router.doors.listen import ListenError, check_listen


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


async def test_a_second_server_does_not_share_the_first_ones_port() -> None:
    port = free_port()
    first, _ = await start_grpc_server(SERVICE, host="127.0.0.1", port=port)
    try:
        with pytest.raises(ListenError):
            await start_grpc_server(SERVICE, host="127.0.0.1", port=port)
    finally:
        await first.stop(grace=None)
