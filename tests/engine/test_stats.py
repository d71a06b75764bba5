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
