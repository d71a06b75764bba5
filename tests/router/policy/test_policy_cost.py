"""pdserve's cost formula: each term in seconds of the shared service-time model, the cached-token rule, and
weight validation."""

import msgspec
import pytest
from policy_helpers import BS, view

from router.policy.cost import CostWeights, cached_tokens, cost, estimated_prefill_s, queued_s

W = CostWeights()
T = W.timing


def test_cached_tokens_keeps_the_last_token_to_compute() -> None:
    assert cached_tokens(3, BS, 100) == 48
    assert cached_tokens(10, BS, 64) == 48  # fully cached 64-token prompt still computes its last block
    assert cached_tokens(4, BS, 65) == 64
    assert cached_tokens(0, BS, 0) == 0


def test_terms_are_the_service_time_models_seconds_and_add_up() -> None:
    p = view("p", queued=100, node="n1")
    p = msgspec.structs.replace(p, queued_prefill_s=1.5)
    d = view("d", "decode", active=3, kv=0.5, node="n2")
    d = msgspec.structs.replace(d, active_context_tokens=30_000)
    t = cost(W, 1000, 64, p, 200, d, 600)
    assert (t.uncached_prefill_tokens, t.transfer_tokens) == (800, 400)
    assert t.prefill_s == pytest.approx(W.prefill * T.prefill_s(800, 200))
    assert t.queue_s == pytest.approx(1.5)
    assert t.transfer_s == pytest.approx(T.transfer_s(400))
    assert t.decode_s == pytest.approx(64 * T.tpot_s(4, 31_000) + 0.5 * W.kv_full_s)
    assert t.stall_s == 0.0  # a prefill replica computes it: no decode batch waits
    assert t.total == pytest.approx(t.prefill_s + t.queue_s + t.transfer_s + t.decode_s)


def test_a_cached_long_context_saves_more_than_its_token_count_suggests() -> None:
    # 2k new tokens after a 128k cached context vs all 130k computed: the miss also recomputes the attention
    # over the whole context (quadratic), and the hit still pays for attending to the cached part.
    hit = estimated_prefill_s(T, 130_000, 128_000)
    miss = estimated_prefill_s(T, 130_000, 0)
    assert miss / hit > 20
    assert hit > estimated_prefill_s(T, 2_000, 0)


def test_each_weight_scales_its_own_term() -> None:
    p = msgspec.structs.replace(view("p", queued=100), queued_prefill_s=2.0)
    d = view("d", "decode", active=2, kv=0.25)
    base = cost(W, 4096, 100, p, 0, d, 0)
    for field, term in [("prefill", "prefill_s"), ("queue", "queue_s"), ("transfer", "transfer_s")]:
        doubled = cost(msgspec.structs.replace(W, **{field: 2 * getattr(W, field)}), 4096, 100, p, 0, d, 0)
        assert getattr(doubled, term) == pytest.approx(2 * getattr(base, term)), field
        assert doubled.total == pytest.approx(base.total + getattr(base, term)), field
    heavier_kv = cost(msgspec.structs.replace(W, kv_full_s=10.0), 4096, 100, p, 0, d, 0)
    assert heavier_kv.decode_s == pytest.approx(base.decode_s + 0.25 * 8.0)


def test_decode_term_grows_with_batch_context_and_kv_usage() -> None:
    p = view("p")
    idle = cost(W, 4096, 100, p, 0, view("d", "decode"), 0).decode_s
    busy = cost(W, 4096, 100, p, 0, view("d", "decode", active=20), 0).decode_s
    full = cost(W, 4096, 100, p, 0, view("d", "decode", kv=0.9), 0).decode_s
    long_ctx = msgspec.structs.replace(view("d", "decode"), active_context_tokens=500_000)
    assert busy > idle and full > idle and cost(W, 4096, 100, p, 0, long_ctx, 0).decode_s > idle
    # The reply length counts up to max_output_tokens only.
    capped = msgspec.structs.replace(W, max_output_tokens=10)
    assert cost(capped, 4096, 100, p, 0, view("d", "decode"), 0).decode_s == pytest.approx(
        10 * T.tpot_s(1, 4096)
    )


def test_queue_without_an_estimate_is_costed_from_its_counts() -> None:
    counted = view("p", queued=8000, reqs=2)
    assert queued_s(W, counted) == pytest.approx(2 * T.prefill_s(4000, 0))
    assert queued_s(W, view("p")) == 0.0
    assert queued_s(W, msgspec.structs.replace(counted, queued_prefill_s=0.25)) == 0.25


def test_same_node_transfer_is_cheaper_and_local_prefill_transfers_nothing() -> None:
    d = view("d", "decode", node="n1")
    cross = cost(W, 100_000, 1, view("p", node="n2"), 0, d, 0)
    near = cost(W, 100_000, 1, view("p", node="n1"), 0, d, 0)
    assert near.transfer_s < cross.transfer_s
    local = cost(W, 1000, 1, d, 900, d, 900)
    assert local.transfer_tokens == 0 and local.transfer_s == 0 and local.uncached_prefill_tokens == 100


def test_weights_are_validated_with_field_names() -> None:
    with pytest.raises(msgspec.ValidationError, match="transfer"):
        msgspec.convert({"transfer": -1}, CostWeights)
    with pytest.raises(msgspec.ValidationError, match="bogus"):
        msgspec.convert({"bogus": 1}, CostWeights)
    with pytest.raises(msgspec.ValidationError, match=r"timing\.link_bytes_per_s"):
        msgspec.convert({"timing": {"link_bytes_per_s": 0}}, CostWeights)


def test_a_local_prefill_charges_its_seconds_once_per_sequence_in_the_decode_batch() -> None:
    # While the decode replica computes the prompt, its batch (3 running + the next admitted) waits.
    d = view("d", "decode", active=3)
    t = cost(W, 8000, 1, d, 4000, d, 4000)
    assert t.stall_s == pytest.approx(W.stall * T.prefill_s(4000, 4000) * 4)
    assert t.total == pytest.approx(t.prefill_s + t.queue_s + t.decode_s + t.stall_s)
    idle = view("d", "decode")
    assert cost(W, 8000, 1, idle, 4000, idle, 4000).stall_s == pytest.approx(t.stall_s / 4)
    off = msgspec.structs.replace(W, stall=0.0)
    assert cost(off, 8000, 1, d, 4000, d, 4000).stall_s == 0.0


def test_a_long_local_prefill_weighs_its_batchs_wait_with_its_own_weight() -> None:
    d = view("d", "decode", active=3)
    short = cost(W, 8000, 1, d, 4000, d, 4000).stall_s
    long = cost(W, 8000, 1, d, 4000, d, 4000, long_stall=True)
    assert long.stall_s == pytest.approx(W.long_stall * T.prefill_s(4000, 4000) * 4)
    assert long.stall_s == pytest.approx(short * W.long_stall / W.stall)
    assert long.total == pytest.approx(long.prefill_s + long.queue_s + long.decode_s + long.stall_s)
    # Only a local prefill stalls a decode batch.
    p = view("p")
    assert cost(W, 8000, 1, p, 4000, d, 4000, long_stall=True).stall_s == 0.0
