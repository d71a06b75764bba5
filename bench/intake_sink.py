"""A sink for over-long prompts: a process that reads each request whole on both doors and refuses it,
doing nothing else (bench/intake_isolation.py's `sink` system).

Sent to the sink instead of to pdserve, the same over-long prompts still cost this machine their bytes: the
senders' encoding and writes, the kernel's copies, a server's reads. What a short request sent to pdserve
meanwhile waits for is then what sharing the cores costs, apart from anything pdserve does with the prompts:
the floor for any intake, however well isolated, on these cores.

- gRPC: the pdserve Generate method, its request taken as raw bytes (never parsed) and refused with
  INVALID_ARGUMENT, under the same receive limit as the router's.
- HTTP: HTTP/1.1 on a plain asyncio stream, the body read to its Content-Length and answered 400.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from router.doors.limits import MAX_REQUEST_BYTES

REFUSAL = "refused by the sink, unread"
_HTTP_BODY = b'{"error": {"message": "refused by the sink"}}'
_HTTP_REFUSAL = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
    + f"content-length: {len(_HTTP_BODY)}\r\n\r\n".encode()
    + _HTTP_BODY
)


async def _refuse(_request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, REFUSAL)
    yield b""  # never reached: makes this the async generator a server-streaming handler is


async def _http_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise
                return  # the client closed its connection between requests
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            writer.write(_HTTP_REFUSAL)
            await writer.drain()
    finally:
        writer.close()


async def serve(grpc_port: int, http_port: int, ready: Any, stop: Any) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
        ]
    )
    generate = grpc.unary_stream_rpc_method_handler(_refuse)  # no deserializer: the bytes as received
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("pdserve.v1.Pdserve", {"Generate": generate})]
    )
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()
    http = await asyncio.start_server(_http_connection, "127.0.0.1", http_port, limit=MAX_REQUEST_BYTES)
    ready.set()
    try:
        await asyncio.to_thread(stop.wait)
    finally:
        http.close()
        await server.stop(0)


def run(grpc_port: int, http_port: int, ready: Any, stop: Any) -> None:
    """The sink's process: serves until `stop` is set (`ready` once both doors listen)."""
    asyncio.run(serve(grpc_port, http_port, ready, stop))
