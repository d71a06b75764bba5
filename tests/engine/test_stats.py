"""The engine host's vLLM stat loggers: its counters (what the router exports about each engine), and no
Prometheus logger of vLLM's own, whose per-token histograms nobody in a replica would read."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager

from engine.stats import EngineCounters, counters_logger_factory, unexported_prometheus_logger


def test_vllm_adds_no_prometheus_logger_of_its_own_beside_the_counters() -> None:
    counters = EngineCounters()
    manager = StatLoggerManager(
        VllmConfig(),
        custom_stat_loggers=[counters_logger_factory(counters), unexported_prometheus_logger()],
        enable_default_loggers=False,
    )
    prometheus = [s for s in manager.stat_loggers if isinstance(s, PrometheusStatLogger)]
    assert len(manager.stat_loggers) == 2 and len(prometheus) == 1
    assert type(prometheus[0]) is not PrometheusStatLogger  # the stand-in: no metric registered or observed
    counters.last_step_at = 0.0
    manager.record(None, None)  # an engine step: the counters hear of it, the stand-in does nothing
    manager.log_engine_initialized()
    manager.record_sleep_state(1, 0)
    assert counters.last_step_at > 0.0


def test_speculative_decoding_stats_add_up_step_by_step() -> None:
    """vLLM's scheduler reports each step's drafts; the counters keep the running totals."""
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    counters = EngineCounters()
    for drafted, accepted in ((4, 3), (4, 0), (2, 2)):
        spec = SpecDecodingStats.new(num_spec_tokens=4)
        spec.observe_draft(num_draft_tokens=drafted, num_accepted_tokens=accepted)
        counters.record(SchedulerStats(spec_decoding_stats=spec), None)
    assert (counters.spec_drafts, counters.spec_draft_tokens, counters.spec_accepted_tokens) == (3, 10, 5)
    counters.record(SchedulerStats(), None)  # a step without speculation changes nothing
    assert counters.spec_drafts == 3


def test_step_time_is_the_smoothed_interval_between_steps_while_sequences_run(monkeypatch: Any) -> None:
    from vllm.v1.metrics.stats import SchedulerStats

    clock = iter([0.0, 0.010, 0.020, 0.050, 0.060])
    monkeypatch.setattr("engine.stats.time.monotonic", lambda: next(clock))
    counters = EngineCounters()
    counters.record(SchedulerStats(num_running_reqs=2), None)  # 0.00: idle before: no interval yet
    assert counters.step_s == 0.0
    counters.record(SchedulerStats(num_running_reqs=2), None)  # 0.01: a 10 ms step
    assert counters.step_s == pytest.approx(0.010)
    counters.record(SchedulerStats(num_running_reqs=0), None)  # 0.02: another
    counters.record(SchedulerStats(num_running_reqs=2), None)  # 0.05: idle since 0.02: not a step
    assert counters.step_s == pytest.approx(0.010)
    counters.record(SchedulerStats(num_running_reqs=2), None)  # 0.06: 10 ms again
    assert counters.step_s == pytest.approx(0.010)
