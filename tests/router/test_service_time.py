"""The service-time model of a measured engine (`router.service_time.measured`): the fitted times answer the
routing cost's and the replay's questions, and a topology carries them."""

from __future__ import annotations

import msgspec
import pytest
import yaml

from cluster.topology_file import TopologyError, parse_topology
from router.service_time import MeasuredEngine, MeasuredTiming, ServiceTime, ServiceTimeModel, Speculation

FIT = MeasuredTiming(
    prefill_fixed_s=0.01,
    prefill_token_s=1e-4,
    prefill_pair_s=1e-8,
    decode_step_s=0.005,
    decode_seq_s=2e-4,
    decode_context_token_s=1e-6,
    transfer_fixed_s=0.002,
    transfer_token_s=1e-5,
)


def test_a_measured_engine_answers_from_its_fit() -> None:
    timing = ServiceTime(measured=FIT, decode_chunk_tokens=512).timing()
    assert isinstance(timing, MeasuredEngine)
    # 100 new tokens after 200 cached: 100 x 200 + 100 x 101 / 2 attention pairs.
    assert timing.prefill_s(100, 200) == pytest.approx(0.01 + 100e-4 + (20_000 + 5_050) * 1e-8)
    assert timing.prefill_s(0, 200) == 0.01
    assert timing.tpot_s(4, 1000) == pytest.approx(0.005 + 8e-4 + 1e-3)
    assert timing.transfer_s(0) == 0.0 and timing.transfer_s(100) == pytest.approx(0.003)
    # 1000 prompt tokens on a decode replica running 12 sequences: chunks of 500, as slow as the larger part.
    steps, step_s = timing.mixed_prefill(1000, 0, 12, 600)
    assert steps == 2 and step_s == pytest.approx(timing.prefill_s(1000, 0) / 2)


def test_without_a_measurement_the_hardware_and_model_shape_decide() -> None:
    assert isinstance(ServiceTime().timing(), ServiceTimeModel)


def test_a_topology_carries_the_measured_section_and_refuses_a_bad_one_by_field_path() -> None:
    measured = msgspec.to_builtins(FIT)
    topo = parse_topology(yaml.safe_dump({"router": {"service_time": {"measured": measured}}}))
    assert topo.router.service_time.measured == FIT
    measured["prefill_fixed_s"] = -0.01
    with pytest.raises(TopologyError) as info:
        parse_topology(yaml.safe_dump({"router": {"service_time": {"measured": measured}}}))
    assert info.value.path == "router.service_time.measured.prefill_fixed_s"


def test_contention_slows_a_measured_engine_with_the_root_of_the_others_in_flight_and_never_a_gpu() -> None:
    timing = MeasuredEngine(fit=msgspec.structs.replace(FIT, prefill_contention=0.25, decode_contention=0.5))
    assert timing.contention(0) == (1.0, 1.0)
    assert timing.contention(4) == pytest.approx((1.5, 2.0))
    assert MeasuredEngine(fit=FIT).contention(9) == (1.0, 1.0)  # none measured: none charged
    assert ServiceTimeModel().contention(100) == (1.0, 1.0)
    assert "sqrt(k)" in ServiceTime(measured=timing.fit).describe()


def test_speculation_divides_a_step_over_the_tokens_it_gains_and_charges_the_drafts() -> None:
    spec = Speculation(draft_tokens=3, acceptance_rate=0.6, draft_cost=0.05)
    assert spec.tokens_per_step == pytest.approx(1 + 0.6 * 3)
    plain = MeasuredEngine(fit=FIT)
    fast = ServiceTime(measured=FIT, speculation=spec).timing()
    # A step of 4 sequences verifying 4 tokens each, plus three drafted tokens at 5% of a plain step each.
    step = 0.005 + 2e-4 * 4 * 4 + 1e-6 * 1000
    assert fast.tpot_s(4, 1000) == pytest.approx((step + 3 * 0.05 * plain.tpot_s(4, 1000)) / 2.8)
    assert fast.tpot_s(4, 1000) < plain.tpot_s(4, 1000)
    # Nothing accepted: every step costs more and still makes one token.
    none_accepted = ServiceTime(measured=FIT, speculation=Speculation(draft_tokens=3, acceptance_rate=0.0))
    assert none_accepted.timing().tpot_s(4, 1000) > plain.tpot_s(4, 1000)
    assert "2.80 tokens a step" in ServiceTime(speculation=spec).describe()


def test_on_gpus_a_wide_speculative_batch_becomes_compute_bound() -> None:
    """A decode step streams weights and KV; verifying drafts multiplies the tokens computed, so a wide batch
    pays for its FLOPs (and a MoE's touches more experts)."""
    spec = Speculation(draft_tokens=3, acceptance_rate=0.7)
    model = ServiceTime().timing()
    assert isinstance(model, ServiceTimeModel)
    m, r = model.shape, model.rates
    compute = 2 * m.active_params * 2048 * 4 / (r.gemm_flops * 8 * model.parallel_efficiency)
    assert model.step_s(2048, 0, 4) == pytest.approx(model.decode_step_overhead_s + compute)
    assert model.step_s(1, 0, 4) > model.step_s(1, 0)  # four tokens touch more experts than one
    with_spec = ServiceTime(speculation=spec).timing()
    assert with_spec.tpot_s(8, 8 * 32_000) < model.tpot_s(8, 8 * 32_000)  # memory-bound: speculation wins
    assert with_spec.tpot_s(2048, 0) > model.tpot_s(2048, 0) * 0.9  # compute-bound: it gains little


def test_kv_capacity_follows_the_kv_dtype_and_whether_gpus_split_a_tokens_kv() -> None:
    mla = ServiceTimeModel()  # DeepSeek-V3 on 8 H200s, fp8 weights, a bf16 latent on every GPU
    free = 0.9 * 141e9 - 671e9 / 8
    assert mla.kv_capacity_tokens() == pytest.approx(free / 70e3)
    fp8 = ServiceTimeModel(shape=msgspec.structs.replace(mla.shape, kv_bytes_per_token=35e3))
    assert fp8.kv_capacity_tokens() == pytest.approx(2 * mla.kv_capacity_tokens())
    gqa = ServiceTimeModel(shape=msgspec.structs.replace(mla.shape, kv_split_by_gpus=True))
    assert gqa.kv_capacity_tokens() == pytest.approx(8 * mla.kv_capacity_tokens())
