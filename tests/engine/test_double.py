"""The engine test double (engine/double.py): EngineHost's interface and messages, deterministic tokens,
streams that take real time, load and prefix-cache accounting. It stands in for vLLM in cluster tests only."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from engine.double import VOCAB_SIZE, DoubleEngineHost, DoubleTiming, double_tokens
from engine.messages import EngineRequest, Sampling, StreamBatch, TokenBatch
from engine.spec import EngineSpec, spec_env, spec_from_env

FAST = DoubleTiming(decode_s_per_token=0.002)


def spec(role: str = "decode", **kw: object) -> EngineSpec:
    return EngineSpec(
        role=role,  # type: ignore[arg-type]
        engine="double",
        model_source="builtin:tiny-llama",
        served_name="tiny-llama",
        block_size=4,
        dtype="float32",
        max_model_len=2048,
        **kw,  # type: ignore[arg-type]
    )


def host(role: str = "decode", timing: DoubleTiming = FAST, **kw: object) -> DoubleEngineHost:
    h = DoubleEngineHost(
        spec(role, **kw), replica_id=f"{role}-r1", node_id="node-1", node_ip="127.0.0.1", timing=timing
    )
    h.start()
    return h


def request(
    prompt: list[int], max_tokens: int = 8, rid: str = "req", kv_transfer_params: dict[str, Any] | None = None
) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=Sampling(max_tokens=max_tokens),
        kv_transfer_params=kv_transfer_params,
    )


async def aenumerate(batches: AsyncIterator[TokenBatch]) -> AsyncIterator[tuple[int, TokenBatch]]:
    i = 0
    async for batch in batches:
        yield i, batch
        i += 1


async def collect(h: DoubleEngineHost, req: EngineRequest) -> list[TokenBatch]:
    return [b async for b in h.generate(req)]


async def test_tokens_depend_only_on_the_sequence_so_far_and_stay_in_the_vocabulary() -> None:
    a, b = host(), host()
    prompt = list(range(10, 30))
    first, second = await collect(a, request(prompt, 20)), await collect(b, request(prompt, 20, rid="other"))
    ids = [t for batch in first for t in batch.token_ids]
    assert ids == [t for batch in second for t in batch.token_ids]
    assert ids == double_tokens(prompt, 20)
    # Autoregressive, as greedy decoding: the prompt plus the first tokens continues with the rest.
    assert double_tokens([*prompt, *ids[:7]], 13) == ids[7:]
    assert len(set(ids)) > 10  # not a constant
    assert all(3 <= t < VOCAB_SIZE for t in ids)
    other = await collect(a, request([*prompt, 1], 20, rid="x"))
    assert [t for batch in other for t in batch.token_ids] != ids


async def test_stream_sends_the_first_token_alone_then_batches_and_ends_with_a_final_batch() -> None:
    h = host()
    req = msgspec.structs.replace(request([1, 2, 3, 4, 5], max_tokens=10), stream=StreamBatch(4, 10_000.0))
    batches = await collect(h, req)
    assert [len(b.token_ids) for b in batches] == [1, 4, 4, 1]
    assert [b.finish_reason for b in batches] == [None, None, None, "length"]
    last = batches[-1]
    assert (last.replica_id, last.node_id, last.num_prompt_tokens) == ("decode-r1", "node-1", 5)
    assert batches[0].text == f" t{batches[0].token_ids[0]}"


async def test_streams_take_time_per_token() -> None:
    h = host(timing=DoubleTiming(decode_s_per_token=0.01))
    started = time.monotonic()
    await collect(h, request([1, 2, 3], max_tokens=21))
    assert time.monotonic() - started >= 0.2  # 20 decode steps after the first token


async def test_a_busy_event_loop_delays_tokens_but_not_the_steps_after_them() -> None:
    """Steps keep the engine's cadence, as an engine core stepping in its own process does: a consumer that
    blocks the loop for 5 steps' time delays the next token, not every one after it."""
    h = host(timing=DoubleTiming(decode_s_per_token=0.02))
    started = time.monotonic()
    async for i, _ in aenumerate(h.generate(request([1, 2, 3], max_tokens=11))):
        if i == 1:
            time.sleep(0.1)  # noqa: ASYNC251 (on purpose: the replica's loop busy elsewhere, once)
    elapsed = time.monotonic() - started
    assert 0.2 <= elapsed < 0.27  # 10 steps; relative sleeps would have made it 0.3 s or more


async def test_prefill_hands_off_kv_params_that_let_decode_skip_the_prompt() -> None:
    p, d = host("prefill"), host("decode")
    prompt = list(range(100, 110))
    result = await p.prefill(request(prompt, rid="r-p"))
    assert result.replica_id == "prefill-r1" and result.num_prompt_tokens == 10
    params = result.kv_transfer_params
    assert params is not None and params["remote_block_ids"] == [0, 1, 2]  # ceil(10 / 4) blocks
    batches = await collect(d, request(prompt, 5, rid="r-d", kv_transfer_params=params))
    assert batches[-1].num_cached_tokens == 10
    stats = d.stats()
    assert stats.prompt_tokens_external_kv == 10 and stats.prompt_tokens_computed == 0
    assert stats.nixl_transfers == 1 and stats.requests_finished == 1
    assert p.stats().prompt_tokens_computed == 10


async def test_repeated_prefixes_count_as_local_cache_hits_in_whole_blocks() -> None:
    h = host()
    await collect(h, request(list(range(10)), 1, rid="a"))  # caches blocks [0-3], [4-7]
    batches = await collect(h, request([*range(9), 99, 98], 1, rid="b"))
    assert batches[-1].num_cached_tokens == 8
    assert h.stats().prompt_tokens_local_cache_hit == 8
    assert h.stats().prompt_tokens_computed == 10 + 3


async def test_max_num_seqs_bounds_running_requests_and_the_rest_wait() -> None:
    h = host(timing=DoubleTiming(decode_s_per_token=0.01), engine_args={"max_num_seqs": 2})
    tasks = [asyncio.create_task(collect(h, request([i] * 8, 30, rid=f"r{i}"))) for i in range(5)]
    await asyncio.sleep(0.05)
    stats = h.stats()
    assert (stats.running, stats.waiting) == (2, 3)
    assert stats.kv_cache_usage > 0
    await asyncio.gather(*tasks)
    stats = h.stats()
    assert (stats.running, stats.waiting, stats.requests_finished) == (0, 0, 5)
    assert stats.kv_cache_usage == 0


async def test_abort_ends_a_stream_with_finish_reason_abort() -> None:
    h = host(timing=DoubleTiming(decode_s_per_token=0.01))
    stream = h.generate(request([1, 2], 1000, rid="long"))
    first = await anext(stream)
    assert first.finish_reason is None
    await h.abort("long")
    rest = [b async for b in stream]
    assert rest[-1].finish_reason == "abort"
    assert h.stats().running == 0


async def test_info_health_and_shutdown() -> None:
    h = DoubleEngineHost(spec(), replica_id="r", node_id="n", node_ip="127.0.0.1")
    with pytest.raises(RuntimeError):
        await h.check_health()
    assert h.info().ready is False
    h.start()
    await h.check_health()
    info = h.info(draining=True)
    assert info.ready and info.draining and info.kv_events_endpoint is None and info.block_size == 4
    assert info.stats is not None and info.stats.role == "decode"
    h.shutdown()
    with pytest.raises(RuntimeError):
        await h.check_health()


def test_the_spec_travels_through_the_replica_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    original = spec(engine_args={"max_num_seqs": 3})
    for key, value in spec_env(original).items():
        monkeypatch.setenv(key, value)
    assert spec_from_env() == original


async def test_an_export_returns_pin_parameters_only_with_readback_on() -> None:
    req = request([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert await host().export(req) is None
    pinned = await host(kv_readback_ttl_s=60).export(req)
    assert pinned is not None and pinned["remote_num_tokens"] == 9 and pinned["remote_block_ids"] == [0, 1, 2]
