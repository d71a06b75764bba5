"""The decode replica: its KV export answers only as the replica the router chose; its tokens go to the
router's token channel."""

from __future__ import annotations

import asyncio

from decode_pool import token_receiver
from replicas import tiny_spec, unserved

from decode.decode_replica import DecodeReplica
from engine.double import DoubleEngineHost, double_tokens
from engine.messages import EngineRequest, Sampling
from engine.token_sender import TokenSender


def server() -> DecodeReplica:
    spec = tiny_spec("decode", block_size=4, kv_readback_ttl_s=60)
    s = unserved(DecodeReplica)
    s.host = DoubleEngineHost(spec, replica_id="d1", node_id="node-1", node_ip="127.0.0.1")
    s.host.start()
    return s


REQ = EngineRequest(request_id="r-x", prompt_token_ids=list(range(9)), sampling=Sampling(max_tokens=1))


async def test_the_chosen_replica_pins_the_prefix() -> None:
    pinned = await server().export(REQ, replica_hint="d1")
    assert pinned is not None and pinned["remote_num_tokens"] == 9


async def test_a_replica_serve_spilled_the_call_to_declines_instead_of_computing_the_prefix() -> None:
    s = server()
    assert await s.export(REQ, replica_hint="d0") is None
    assert s.host.stats().prompt_tokens_computed == 0


async def test_generate_streams_to_the_routers_token_channel_and_returns_how_many_batches() -> None:
    s = server()
    s.tokens = TokenSender()
    receiver = token_receiver()
    req = EngineRequest(request_id="r", prompt_token_ids=list(range(9)), sampling=Sampling(max_tokens=5))
    reply_to = receiver.open()
    call = asyncio.ensure_future(s.generate(req, reply_to))
    batches = [b async for b in receiver.stream(reply_to, call)]
    s.tokens.close()
    assert [t for b in batches for t in b.token_ids] == double_tokens(req.prompt_token_ids, 5)
    assert call.result() == len(batches) and batches[-1].finish_reason == "length"
    assert {b.replica_id for b in batches} == {"d1"}
