"""The service-time model of a measured engine (`router.service_time.measured`): the fitted times answer the
routing cost's and the replay's questions, and a topology carries them."""

from __future__ import annotations

import msgspec
import pytest
import yaml

from cluster.topology_file import TopologyError, parse_topology
from router.service_time import MeasuredEngine, MeasuredTiming, ServiceTime, ServiceTimeModel

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
