"""The engine host's vLLM stat loggers: its counters (what the router exports about each engine), and no
Prometheus logger of vLLM's own, whose per-token histograms nobody in a replica would read."""

from __future__ import annotations

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
