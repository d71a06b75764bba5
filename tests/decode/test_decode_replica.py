"""The decode replica's KV export answers only as the replica the router chose."""

from __future__ import annotations

from decode.decode_replica import DecodeReplica
from engine.double import DoubleEngineHost
from engine.messages import EngineRequest, Sampling
from engine.spec import EngineSpec


def server() -> DecodeReplica:
    spec = EngineSpec(
        role="decode",
        engine="double",
        model_source="builtin:tiny-llama",
        served_name="tiny-llama",
        block_size=4,
        dtype="float32",
        max_model_len=2048,
        kv_readback_ttl_s=60,
    )
    s = object.__new__(DecodeReplica)  # the Serve constructor needs a running replica context
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
