"""The engine host's own pieces: its ports, and how a request's stream ends when the engine hangs or the
request is given up, on a stand-in for vLLM's AsyncLLM surface (the engine itself: tests/e2e)."""

import asyncio
import socket
from typing import Any

import pytest
from replicas import tiny_spec

from engine.host import EngineHost, free_ports
from engine.messages import EngineRequest, ReplicaFailed, Sampling


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
    import socket

    from engine.host import _PORT_LOW, _ephemeral_low, free_ports

    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(_PORT_LOW <= p < _ephemeral_low() for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("0.0.0.0", p))


class _Collector:
    """vLLM's per-request output queue (RequestOutputCollector): an exception put there is raised."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()


class _StandInLLM:
    """The surface of vLLM's AsyncLLM that EngineHost._outputs and failure use: `generate` yields what a
    test puts on the request's queue, and `output_processor.propagate_error` puts an exception on every
    open request's queue, as vLLM's own is for a dead engine."""

    def __init__(self) -> None:
        self.errored = False
        self.open: dict[str, _Collector] = {}
        self.closed: list[str] = []
        self.output_processor = self

    def propagate_error(self, e: Exception) -> None:
        for c in self.open.values():
            c.queue.put_nowait(e)

    async def generate(self, prompt: object, params: object, *, request_id: str, **_: object) -> Any:
        c = self.open[request_id] = _Collector()
        try:
            while True:
                out = await c.queue.get()
                if isinstance(out, Exception):
                    raise out
                yield out
        finally:
            self.closed.append(request_id)  # vLLM aborts the request here when it did not finish
            del self.open[request_id]


def _host(hang_timeout_s: float) -> tuple[EngineHost, _StandInLLM]:
    spec = tiny_spec("decode", engine="vllm", hang_timeout_s=hang_timeout_s)
    host = EngineHost(spec, replica_id="d1", node_id="n1", node_ip="127.0.0.1")
    host._llm = llm = _StandInLLM()
    return host, llm


async def test_a_hung_engines_streams_end_as_replica_failed_when_the_watchdog_asks() -> None:
    host, llm = _host(hang_timeout_s=0.05)
    request = EngineRequest(request_id="r1", prompt_token_ids=[1, 2], sampling=Sampling())
    outputs = host._outputs(request, None)
    first = asyncio.ensure_future(anext(outputs))
    await asyncio.sleep(0.01)
    llm.open["r1"].queue.put_nowait("token")
    assert await first == "token"
    waiting = asyncio.ensure_future(anext(outputs))
    await asyncio.sleep(0.1)  # no step for longer than hang_timeout_s, one request in flight
    assert not waiting.done()  # nothing raises by itself: the watchdog's question ends it
    reason = host.failure()
    assert reason is not None and "no step for" in reason
    with pytest.raises(ReplicaFailed) as failed:
        await waiting
    assert failed.value.reason == reason and host._inflight == 0
    with pytest.raises(ReplicaFailed):  # sticky: nothing new starts on it
        await anext(host._outputs(request, None))


async def test_closing_a_stream_closes_vllms_at_once_which_aborts_the_request() -> None:
    host, llm = _host(hang_timeout_s=30)
    outputs = host._outputs(EngineRequest(request_id="r2", prompt_token_ids=[1], sampling=Sampling()), None)
    first = asyncio.ensure_future(anext(outputs))
    await asyncio.sleep(0.01)
    llm.open["r2"].queue.put_nowait("token")
    await first
    await outputs.aclose()
    assert llm.closed == ["r2"] and host._inflight == 0 and host.failure() is None
