"""The policies a replay compares: pdserve as configured for the run, described in the report, and names."""

from __future__ import annotations

import msgspec
import pytest

from bench.replay.policies import available_policies, describe_pdserve, select
from router.config import RouterConfig
from router.policy.selector import PdservePolicy
from router.service_time import GpuRates, ServiceTimeModel


def test_pdserve_runs_with_the_replays_timing_and_the_given_settings() -> None:
    timing = ServiceTimeModel(rates=msgspec.structs.replace(GpuRates.measured(), gemm_flops=123e12))
    router = RouterConfig(local_prefill_max_tokens=2048, prefill_overflow_queue_s=None)
    policy = available_policies(router)["pdserve"](timing)
    assert isinstance(policy, PdservePolicy)
    assert policy.weights.timing == timing and policy.config == router
    default = available_policies()["pdserve"](timing)
    assert isinstance(default, PdservePolicy) and default.config == RouterConfig()


def test_the_report_names_the_settings_pdserves_numbers_depend_on() -> None:
    line = describe_pdserve(RouterConfig(local_prefill_max_tokens=768))
    assert line == (
        "pdserve: mode auto, local_prefill_max_tokens 768, prefill weight 5, balance 0.2, churn 0.5, "
        "decode inter-token SLO 50 ms, prefill overflow at 10 s queued"
    )
    off = describe_pdserve(RouterConfig(mode="disaggregate", prefill_overflow_queue_s=None))
    assert off.startswith("pdserve: mode disaggregate,") and off.endswith("prefill overflow off")


def test_unknown_policy_names_are_refused_with_the_known_ones() -> None:
    assert list(select("pdserve, dynamo_kv")) == ["pdserve", "dynamo_kv"]
    with pytest.raises(ValueError, match=r"unknown policies \['sglang'\]; known: \["):
        select("pdserve,sglang")
