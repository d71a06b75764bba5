"""Legs sent straight to replicas: the router's leg channel (router/legs/leg_channel.py) against a replica's
real leg server (engine/leg_server.py) and token channel, over real sockets. What a replica's handler does is
the test's; a replica in another process is killed with SIGKILL to show a lost replica surfaces."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from decode_pool import OPEN, token_receiver

from engine.leg_server import LegServer
from engine.messages import EngineRequest, LegEnd, PrefillResult, ReplicaFailed, ReplyTo, Sampling, TokenBatch
from engine.token_sender import TokenSender
from router.legs import leg_channel
from router.legs.leg_channel import LegChannel, LegError, ReplicaLost
from router.legs.token_receiver import TokenReceiver

REQ = EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=Sampling(max_tokens=3))
RESULT = PrefillResult(
    request_id="r-p",
    replica_id="P1",
    node_id="n",
    kv_transfer_params={"remote_block_ids": [[1]]},
    num_prompt_tokens=3,
    num_cached_tokens=0,
    prefill_ms=1.0,
)


class Replica:
    """A replica's two channel ends, with handlers that record what they were asked and how they ended."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.tokens = TokenSender()
        OPEN.append(self.tokens)
        self.started: list[EngineRequest] = []
        self.cancelled: list[str] = []
        self.fail: BaseException | None = None
        self.hang = False
        self.server = LegServer({"prefill": self.prefill, "generate": self.generate}, self.tokens, None)
        self.server.start()

    async def prefill(self, req: EngineRequest, reply_to: ReplyTo) -> PrefillResult:
        self.started.append(req)
        if self.fail is not None:
            raise self.fail
        return RESULT

    async def generate(self, req: EngineRequest, reply_to: ReplyTo) -> int:
        self.started.append(req)
        return await self.tokens.stream(reply_to, self._batches(req))

    async def _batches(self, req: EngineRequest) -> AsyncIterator[TokenBatch]:
        try:
            yield TokenBatch(token_ids=[7], text="a", replica_id=self.replica_id)
            if self.hang:
                await asyncio.Event().wait()
            if self.fail is not None:
                raise self.fail
            yield TokenBatch(token_ids=[8], text="b", finish_reason="length", replica_id=self.replica_id)
        except asyncio.CancelledError:
            self.cancelled.append(req.request_id)
            raise


@pytest.fixture
def opened() -> Iterator[list[Any]]:
    """Leg servers and channels a test opened: closed after it."""
    things: list[Any] = []
    yield things
    for thing in things:
        thing.close()


def channel(opened: list[Any], addresses: dict[str, str]) -> tuple[LegChannel, TokenReceiver]:
    receiver = token_receiver()
    legs = LegChannel(receiver, addresses.get)
    opened.append(legs)
    return legs, receiver


def replica(opened: list[Any], replica_id: str) -> Replica:
    r = Replica(replica_id)
    opened.append(r.server)
    return r


async def test_a_prefill_leg_returns_its_result_and_a_decode_leg_streams_then_counts(
    opened: list[Any],
) -> None:
    p, d = replica(opened, "P1"), replica(opened, "D1")
    legs, receiver = channel(opened, {"P1": p.server.address, "D1": d.server.address})
    assert await legs.prefill(REQ, "P1") == RESULT
    reply_to = receiver.open()
    call = legs.generate(REQ, reply_to, "D1")
    batches = [b async for b in receiver.stream(reply_to, call)]
    assert [t for b in batches for t in b.token_ids] == [7, 8] and await call == 2
    assert p.started == [REQ] and d.started == [REQ]


async def test_cancelling_a_leg_aborts_it_on_the_replica(opened: list[Any]) -> None:
    d = replica(opened, "D1")
    d.hang = True
    legs, receiver = channel(opened, {"D1": d.server.address})
    reply_to = receiver.open()
    call = legs.generate(REQ, reply_to, "D1")
    stream = receiver.stream(reply_to, call)
    assert (await anext(stream)).token_ids == [7]
    await stream.aclose()  # the client went away: the stream cancels its leg
    for _ in range(100):
        if d.cancelled:
            break
        await asyncio.sleep(0.01)
    assert d.cancelled == ["r"] and d.server.running == 0


async def test_a_failed_engine_names_its_replica_and_any_other_error_carries_its_message(
    opened: list[Any],
) -> None:
    p = replica(opened, "P1")
    legs, _ = channel(opened, {"P1": p.server.address})
    p.fail = ReplicaFailed("P1", "its vLLM engine core died")
    with pytest.raises(ReplicaFailed) as failed:
        await legs.prefill(REQ, "P1")
    assert failed.value.replica_id == "P1" and failed.value.reason == "its vLLM engine core died"
    p.fail = ValueError("prompt too long for this engine")
    with pytest.raises(LegError, match="ValueError: prompt too long for this engine"):
        await legs.prefill(REQ, "P1")


async def test_a_decode_leg_that_fails_midway_streams_what_it_sent_first(opened: list[Any]) -> None:
    d = replica(opened, "D1")
    d.fail = ReplicaFailed("D1", "its vLLM engine core died")
    legs, receiver = channel(opened, {"D1": d.server.address})
    reply_to = receiver.open()
    got: list[list[int]] = []
    with pytest.raises(ReplicaFailed):
        async for batch in receiver.stream(reply_to, legs.generate(REQ, reply_to, "D1")):
            got.append(batch.token_ids)
    assert got == [[7]]


async def test_a_leg_longer_than_the_reconnect_bound_on_a_live_replica_goes_on(
    opened: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leg_channel, "RECONNECT_S", 0.1)
    p = replica(opened, "P1")
    legs, _ = channel(opened, {"P1": p.server.address})
    release = asyncio.Event()

    async def slow(req: EngineRequest, reply_to: ReplyTo) -> PrefillResult:
        await release.wait()
        return RESULT

    p.server._handlers = {"prefill": slow}
    call = legs.prefill(REQ, "P1")
    await asyncio.sleep(0.5)  # five times the bound: the connection is up, so nothing is lost
    assert not call.done()
    release.set()
    assert await call == RESULT


async def test_a_replica_the_registry_does_not_list_fails_the_leg_at_once(opened: list[Any]) -> None:
    legs, _ = channel(opened, {})
    with pytest.raises(ReplicaLost, match="not in the registry"):
        legs.prefill(REQ, "P9")


async def test_an_address_nobody_listens_on_fails_the_leg_after_the_reconnect_bound(
    opened: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(leg_channel, "RECONNECT_S", 0.2)
    legs, _ = channel(opened, {"P1": f"ipc://{tmp_path}/nobody"})
    began = time.monotonic()
    with pytest.raises(ReplicaLost) as lost:
        await legs.prefill(REQ, "P1")
    assert lost.value.replica_id == "P1" and time.monotonic() - began < 2.0


async def test_a_replica_that_closes_with_legs_open_fails_them_and_the_next_leg_reconnects(
    opened: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leg_channel, "RECONNECT_S", 0.2)
    d = replica(opened, "D1")
    d.hang = True
    addresses = {"D1": d.server.address}
    legs, receiver = channel(opened, addresses)
    reply_to = receiver.open()
    call = legs.generate(REQ, reply_to, "D1")
    stream = receiver.stream(reply_to, call)
    assert (await anext(stream)).token_ids == [7]
    d.server.close()
    with pytest.raises(ReplicaLost, match="D1"):
        await anext(stream)
    # Its replacement (a new replica at a new address): legs go there on a new connection.
    d2 = replica(opened, "D1")
    addresses["D1"] = d2.server.address
    reply_to = receiver.open()
    call = legs.generate(REQ, reply_to, "D1")
    assert [t async for b in receiver.stream(reply_to, call) for t in b.token_ids] == [7, 8]


ROOT = Path(__file__).resolve().parents[3]
REPLICA_PROCESS = """
import asyncio, sys
from engine.leg_server import LegServer
from engine.token_sender import TokenSender

async def hang(req, reply_to):
    await asyncio.Event().wait()

async def main():
    server = LegServer({"prefill": hang}, TokenSender(), None)
    server.start()
    print(server.address, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_replica_process_killed_mid_leg_surfaces_as_lost_within_the_bound(
    opened: list[Any],
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        REPLICA_PROCESS,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        address = (await proc.stdout.readline()).decode().strip()
        legs, _ = channel(opened, {"P1": address})
        call = legs.prefill(REQ, "P1")
        await asyncio.sleep(0.3)  # connected, the leg running there
        assert not call.done()
        os.kill(proc.pid, signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(ReplicaLost) as lost:
            await asyncio.wait_for(call, 10)
        assert lost.value.replica_id == "P1"
        assert time.monotonic() - began < 1.0  # its connection closed: within END_GRACE_S
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_draining_waits_for_running_legs_and_for_routers_to_stop_sending(opened: list[Any]) -> None:
    d = replica(opened, "D1")
    legs, receiver = channel(opened, {"D1": d.server.address})
    release = asyncio.Event()

    async def slow(req: EngineRequest) -> AsyncIterator[TokenBatch]:
        await release.wait()
        yield TokenBatch(token_ids=[8], text="b", finish_reason="length")

    d._batches = slow  # type: ignore[method-assign]
    reply_to = receiver.open()
    call = legs.generate(REQ, reply_to, "D1")
    stream = receiver.stream(reply_to, call)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)
    drained = asyncio.ensure_future(d.server.drain(notice_s=0.2))
    await asyncio.sleep(0.3)
    assert not drained.done()  # a leg still runs
    release.set()
    assert (await first).token_ids == [8]
    await asyncio.wait_for(drained, 2)
    await stream.aclose()


async def test_a_leg_the_replica_does_not_run_is_refused_and_the_next_ones_still_run(
    opened: list[Any],
) -> None:
    d = replica(opened, "D1")
    d.server._handlers = {"generate": d.generate}  # a decode replica: it runs no prefill legs
    legs, receiver = channel(opened, {"D1": d.server.address})
    with pytest.raises(LegError, match="not prefill"):
        await legs.prefill(REQ, "D1")
    reply_to = receiver.open()
    call = legs.generate(REQ, reply_to, "D1")
    assert [t async for b in receiver.stream(reply_to, call) for t in b.token_ids] == [7, 8]


async def test_a_stopping_replica_sends_its_last_legs_end_before_it_closes(opened: list[Any]) -> None:
    p = replica(opened, "P1")
    legs, _ = channel(opened, {"P1": p.server.address})

    async def slow(req: EngineRequest, reply_to: ReplyTo) -> PrefillResult:
        await asyncio.sleep(0.3)
        return RESULT

    p.server._handlers = {"prefill": slow}
    call = legs.prefill(REQ, "P1")
    await asyncio.sleep(0.05)  # running there
    await p.server.drain(notice_s=0.1)  # as the replica's shutdown does, then it closes everything
    await p.tokens.flush(1.0)
    p.server.close()
    p.tokens.close(linger_ms=1000)
    assert await asyncio.wait_for(call, 2) == RESULT


async def test_a_legs_end_that_arrives_just_after_its_leg_channel_closed_still_counts(
    opened: list[Any],
) -> None:
    # The token channel and the leg channel are two sockets: a stopping replica's last end may reach the
    # router after the closing of its leg channel does.
    p = replica(opened, "P1")
    p.server._handlers = {"prefill": lambda req, reply_to: asyncio.Event().wait()}  # type: ignore[dict-item]
    legs, _ = channel(opened, {"P1": p.server.address})
    call = legs.prefill(REQ, "P1")
    await asyncio.sleep(0.1)  # connected, running there
    p.server.close()
    await asyncio.sleep(0.05)  # its close was seen (ipc: at once), within END_GRACE_S
    p.tokens.end(call.reply_to, LegEnd(leg=call.reply_to.leg, sent=0, result=RESULT))
    assert await asyncio.wait_for(call, 2) == RESULT


async def test_a_stopping_router_ends_its_open_legs(opened: list[Any]) -> None:
    p = replica(opened, "P1")
    p.server._handlers = {"prefill": lambda req, reply_to: asyncio.Event().wait()}  # type: ignore[dict-item]
    legs, _ = channel(opened, {"P1": p.server.address})
    call = legs.prefill(REQ, "P1")
    await asyncio.sleep(0.05)
    legs.close()
    with pytest.raises(ReplicaLost, match="the router is stopping"):
        await call
