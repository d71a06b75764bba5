"""The policies a replay compares: pdserve as configured for the run, described in the report, and names."""

from __future__ import annotations

import pytest

from bench.replay.policies import available_policies, describe_pdserve, pdserve_config, select
from router.policy.selector import PdservePolicy, PdservePolicyConfig
from router.policy.service_time import ServiceTimeModel


def test_pdserve_runs_with_the_replays_timing_and_the_given_settings() -> None:
    timing = ServiceTimeModel(gemm_flops=123e12)
    overrides = {"local_prefill_max_tokens": 2048, "prefill_overflow_queue_s": None}
    policy = available_policies(overrides)["pdserve"](timing)
    assert isinstance(policy, PdservePolicy)
    assert policy.config.weights.timing == timing
    assert policy.config.local_prefill_max_tokens == 2048
    assert policy.config.prefill_overflow_queue_s is None
    default = available_policies()["pdserve"](timing)
    assert isinstance(default, PdservePolicy)
    assert default.config == pdserve_config(timing=timing)
    assert default.config.local_prefill_max_tokens == PdservePolicyConfig().local_prefill_max_tokens


def test_the_report_names_the_settings_pdserves_numbers_depend_on() -> None:
    line = describe_pdserve(pdserve_config({"local_prefill_max_tokens": 768}))
    assert line == (
        "pdserve: local_prefill_max_tokens 768, prefill weight 5, balance 0.2, churn 0.5, "
        "long local prefill stall x20, prefill overflow at 10 s queued"
    )
    off = describe_pdserve(pdserve_config({"prefill_overflow_queue_s": None, "long_local_prefill": False}))
    assert off.endswith("long local prefill off, prefill overflow off")


def test_pdserve_settings_are_validated_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"Expected `int` >= 0 - at `\$.local_prefill_max_tokens`"):
        available_policies({"local_prefill_max_tokens": -5})
    with pytest.raises(ValueError, match="unknown field `prefill_overflow`"):
        pdserve_config({"prefill_overflow": 5.0})


def test_unknown_policy_names_are_refused_with_the_known_ones() -> None:
    assert list(select("pdserve, dynamo_kv")) == ["pdserve", "dynamo_kv"]
    with pytest.raises(ValueError, match=r"unknown policies \['sglang'\]; known: \["):
        select("pdserve,sglang")
