"""pdserve's cost formula: each term in seconds of the shared service-time model, the cached-token rule, and
weight validation."""

import msgspec
import pytest
from policy_helpers import BS, view

from router.config import RouterConfig
from router.messages import ReplicaView, Terms
from router.policy.cost import (
    CostWeights,
    cached_tokens,
    decode_term,
    estimated_prefill_s,
    queued_prefill_s,
    wait_term,
)
from router.policy.options import Balance, Prompt, Scorer
from router.policy.recent_work import RecentWork

W = CostWeights.of(RouterConfig())
T = W.timing


def cost(
    w: CostWeights,
    tokens: int,
    max_tokens: int,
    computing: ReplicaView,
    cached_on_computing: int,
    decode: ReplicaView,
    cached_on_decode: int,
) -> Terms:
    """The terms the options give computing the prompt on `computing` and decoding on `decode` (the same
    replica: a local prefill), without pulls or balance charges."""
    matched = {computing.replica_id: cached_on_computing, decode.replica_id: cached_on_decode}
    prompt = Prompt(tokens=tokens, max_tokens=max_tokens, block_size=1, matched=matched)
    scorer = Scorer(w, prompt, None)
    decode_s = decode_term(w, decode, tokens, max_tokens)
    if computing.replica_id == decode.replica_id:
        return scorer.local(decode, cached_on_decode, "local_prefill", decode_s).terms
    sides = scorer.prefill_sides([computing], Balance(RecentWork(), RecentWork(), 0.0, 0.0))
    return scorer.disaggregated(sides, 0, decode, cached_on_decode, decode_s).terms


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
    assert t.prefill == pytest.approx(W.prefill * T.prefill_s(800, 200))
    assert t.queue == pytest.approx(1.5)
    assert t.transfer == pytest.approx(T.transfer_s(400))
    assert t.decode == pytest.approx(64 * T.tpot_s(4, 31_000) + 0.5 * W.kv_full_s)
    assert t.stall == 0.0  # a prefill replica computes it: no decode batch waits
    assert t.total == pytest.approx(t.prefill + t.queue + t.transfer + t.decode)


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
    for field, term in [("prefill", "prefill"), ("queue", "queue"), ("transfer", "transfer")]:
        doubled = cost(msgspec.structs.replace(W, **{field: 2 * getattr(W, field)}), 4096, 100, p, 0, d, 0)
        assert getattr(doubled, term) == pytest.approx(2 * getattr(base, term)), field
        assert doubled.total == pytest.approx(base.total + getattr(base, term)), field
    heavier_kv = cost(msgspec.structs.replace(W, kv_full_s=10.0), 4096, 100, p, 0, d, 0)
    assert heavier_kv.decode == pytest.approx(base.decode + 0.25 * 8.0)


def test_decode_term_grows_with_batch_context_and_kv_usage() -> None:
    p = view("p")
    idle = cost(W, 4096, 100, p, 0, view("d", "decode"), 0).decode
    busy = cost(W, 4096, 100, p, 0, view("d", "decode", active=20), 0).decode
    full = cost(W, 4096, 100, p, 0, view("d", "decode", kv=0.9), 0).decode
    long_ctx = msgspec.structs.replace(view("d", "decode"), active_context_tokens=500_000)
    assert busy > idle and full > idle and cost(W, 4096, 100, p, 0, long_ctx, 0).decode > idle
    # The reply length counts up to max_output_tokens only.
    capped = msgspec.structs.replace(W, max_output_tokens=10)
    assert cost(capped, 4096, 100, p, 0, view("d", "decode"), 0).decode == pytest.approx(
        10 * T.tpot_s(1, 4096)
    )


def test_queue_without_an_estimate_is_costed_from_its_counts() -> None:
    counted = view("p", queued=8000, reqs=2)
    assert queued_prefill_s(T, counted) == pytest.approx(2 * T.prefill_s(4000, 0))
    assert queued_prefill_s(T, view("p")) == 0.0
    assert queued_prefill_s(T, msgspec.structs.replace(counted, queued_prefill_s=0.25)) == 0.25


def test_a_wait_past_the_ttft_slo_is_charged_over_slo_weight_on_the_excess() -> None:
    assert W.ttft_slo_s == RouterConfig().ttft_slo_ms / 1000
    assert wait_term(W, 3.0, 1.0) == pytest.approx(3.0)  # first token at 4 s: within the SLO, the wait
    # First token at 7 s: the wait, and 2 s past the SLO at the over-SLO weight.
    assert wait_term(W, 5.0, 2.0) == pytest.approx(5.0 + W.over_slo * 2.0)
    p = msgspec.structs.replace(view("p", queued=100), queued_prefill_s=W.ttft_slo_s)
    t = cost(W, 4096, 1, p, 0, view("d", "decode"), 0)
    assert t.queue == pytest.approx(W.ttft_slo_s + W.over_slo * T.prefill_s(4096, 0))
    # A local prefill's wall is in its stall term (at the over-SLO weight past the inter-token SLO).
    d = msgspec.structs.replace(view("d", "decode"), queued_prefill_s=W.ttft_slo_s)
    assert cost(W, 4096, 1, d, 0, d, 0).queue == pytest.approx(W.ttft_slo_s)


def test_same_node_transfer_is_cheaper_and_local_prefill_transfers_nothing() -> None:
    d = view("d", "decode", node="n1")
    cross = cost(W, 100_000, 1, view("p", node="n2"), 0, d, 0)
    near = cost(W, 100_000, 1, view("p", node="n1"), 0, d, 0)
    assert near.transfer < cross.transfer
    local = cost(W, 1000, 1, d, 900, d, 900)
    assert local.transfer == 0


def test_router_settings_are_validated_with_field_paths() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"\$\.prefill_weight"):
        msgspec.convert({"prefill_weight": -1}, RouterConfig)
    with pytest.raises(msgspec.ValidationError, match="bogus"):
        msgspec.convert({"bogus": 1}, RouterConfig)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.service_time\.model\.layers"):
        msgspec.convert({"service_time": {"model": {"layers": 0}}}, RouterConfig)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.service_time\.hardware"):
        msgspec.convert({"service_time": {"hardware": "tpu"}}, RouterConfig)


def test_the_service_time_comes_from_the_configured_model_shape_and_hardware() -> None:
    # The default: DeepSeek-V3 on 8 H200s, rates measured (router/hardware/h200.json).
    assert RouterConfig().service_time.timing() == T
    half = msgspec.convert({"service_time": {"gpus_per_replica": 4}}, RouterConfig).service_time.timing()
    assert half.prefill_s(8000, 0) > T.prefill_s(8000, 0)
    small = {
        "service_time": {"model": {"active_params": 3.7e9, "total_params": 67.1e9, "dense_params": 1.7e9}}
    }
    lighter = msgspec.convert(small, RouterConfig).service_time.timing()
    assert lighter.prefill_s(8000, 0) < T.prefill_s(8000, 0) and lighter.tpot_s(8, 0) < T.tpot_s(8, 0)


def test_a_local_prefill_charges_the_delay_its_mixed_steps_add_to_every_running_sequence() -> None:
    # Chunked between the decode steps: 4000 new tokens in one 8192-token step, as slow as the prefill.
    d = msgspec.structs.replace(view("d", "decode", active=3), active_context_tokens=3_000)
    steps, step = T.mixed_prefill(4000, 4000, 3, 3_000)
    assert (steps, step) == (1, pytest.approx(T.prefill_s(4000, 4000)))
    delay = step - T.tpot_s(3, 3_000)  # each running sequence's step takes this much longer
    loose = msgspec.structs.replace(W, tpot_slo_s=10.0)  # the step stays within this SLO: weight 1
    t = cost(loose, 8000, 1, d, 4000, d, 4000)
    assert t.stall == pytest.approx(3 * delay + step)  # and the next sequence admitted waits it all
    assert t.total == pytest.approx(t.prefill + t.queue + t.decode + t.stall)
    idle = view("d", "decode")
    assert cost(loose, 8000, 1, idle, 4000, idle, 4000).stall == pytest.approx(T.prefill_s(4000, 4000))
    # The next sequence admitted to an idle replica meets the same steps: a long prefill breaks the SLO.
    assert cost(W, 8000, 1, idle, 4000, idle, 4000).stall == pytest.approx(
        W.over_slo * T.prefill_s(4000, 4000)
    )
    # A prompt longer than a step's budget takes several mixed steps, each at least a decode step.
    steps, step = T.mixed_prefill(20_000, 0, 3, 3_000)
    assert steps == 3 and step >= T.tpot_s(3, 3_000)


def test_a_local_prefill_that_breaks_the_inter_token_slo_is_charged_over_slo_weight() -> None:
    d = msgspec.structs.replace(view("d", "decode", active=3), active_context_tokens=3_000)
    _, step = T.mixed_prefill(4000, 4000, 3, 3_000)
    within = cost(msgspec.structs.replace(W, tpot_slo_s=step * 1.01), 8000, 1, d, 4000, d, 4000)
    broken = cost(msgspec.structs.replace(W, tpot_slo_s=step * 0.99), 8000, 1, d, 4000, d, 4000)
    assert broken.stall == pytest.approx(within.stall * W.over_slo / W.stall)
    assert RouterConfig().tpot_slo_ms / 1e3 == W.tpot_slo_s
    # Only a local prefill slows a decode batch.
    p = view("p")
    assert cost(W, 8000, 1, p, 4000, d, 4000).stall == 0.0


def test_a_new_prompt_recomputing_a_prefix_another_prefill_replica_holds_is_charged_copy_weight() -> None:
    holder, other = view("p1"), view("p2")
    prompt = Prompt(tokens=64_000, max_tokens=1, block_size=1, matched={"p1": 60_000, "p2": 0})
    none = Balance(RecentWork(), RecentWork(), 0.0, 0.0)
    new = Scorer(W, prompt, None).prefill_sides([holder, other], none)
    hit, miss = new.own_s
    assert new.prefill == pytest.approx([W.prefill * hit, W.prefill * hit + W.copy * (miss - hit)])
    # A session's next turn: its prefix is its own context, which may move with it at the prefill weight.
    turn = Scorer(W, prompt, None, continuing=True).prefill_sides([holder, other], none)
    assert turn.prefill == pytest.approx([W.prefill * hit, W.prefill * miss])
    assert W.copy > W.prefill
