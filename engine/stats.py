"""Engine counters fed by vLLM's own statistics (a custom stat logger), read by `EngineHost.stats()`.

vLLM computes these in the AsyncLLM process (scheduler stats come from the engine core with every
output batch); keeping a copy here lets the router and tests read what the engine itself reported,
instead of guessing from the outside.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STEP_SMOOTHING = 0.2  # weight of the newest step interval in `step_s`


@dataclass
class EngineCounters:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens_computed: int = 0
    prompt_tokens_local_cache_hit: int = 0
    prompt_tokens_external_kv: int = 0
    nixl_bytes_transferred: int = 0
    nixl_transfers: int = 0
    nixl_transfer_seconds: float = 0.0
    requests_finished: int = 0
    # Speculative decoding (vLLM's SpecDecodingStats): steps that verified a draft, tokens drafted, accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Seconds between steps while sequences ran, smoothed over the last few (what a token costs now).
    step_s: float = 0.0
    # When the engine last reported a step (monotonic clock): how a hung engine is told from a busy one.
    last_step_at: float = field(default_factory=time.monotonic)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        now = time.monotonic()
        if self.running:  # sequences ran since the last step: the interval was one step
            interval = now - self.last_step_at
            old = self.step_s or interval
            self.step_s = STEP_SMOOTHING * interval + (1 - STEP_SMOOTHING) * old
        self.last_step_at = now
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            if scheduler_stats.kv_connector_stats:
                transferred = _sum_key(scheduler_stats.kv_connector_stats, "bytes_transferred")
                self.nixl_bytes_transferred += int(transferred[0])
                self.nixl_transfers += transferred[1]
                self.nixl_transfer_seconds += _sum_key(
                    scheduler_stats.kv_connector_stats, "transfer_duration"
                )[0]
            if (spec := scheduler_stats.spec_decoding_stats) is not None:
                self.spec_drafts += spec.num_drafts
                self.spec_draft_tokens += spec.num_draft_tokens
                self.spec_accepted_tokens += spec.num_accepted_tokens
        if iteration_stats is not None:
            tokens = iteration_stats.prompt_token_stats
            self.prompt_tokens_computed += tokens.computed
            self.prompt_tokens_local_cache_hit += tokens.local_cache_hit
            self.prompt_tokens_external_kv += tokens.external_kv_transfer
            self.requests_finished += len(iteration_stats.finished_requests)


def _sum_key(data: Any, key: str) -> tuple[float, int]:
    """Sum (and count) the observations under `key` in a connector's stats dict; a MultiConnector nests
    one dict per connector, so search recursively."""
    total, count = 0.0, 0
    if isinstance(data, dict):
        for k, v in data.items():
            if k == key and isinstance(v, list):
                total += sum(v)
                count += len(v)
            else:
                t, c = _sum_key(v, key)
                total, count = total + t, count + c
    return total, count


def counters_logger_factory(counters: EngineCounters) -> Callable[..., Any]:
    """A vLLM StatLoggerFactory whose loggers write into `counters`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _CountersLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.counters = counters

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            self.counters.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            return None

    return _CountersLogger


def unexported_prometheus_logger() -> type:
    """A vLLM stat logger that takes the place of vLLM's own Prometheus logger and does nothing.

    vLLM adds a PrometheusStatLogger to every AsyncLLM unless one is given: it observes per-token histograms
    at every engine step into this process's prometheus registry, which nothing serves in a replica (the
    router exports the engines' statistics from `EngineCounters`, via the registry). Given this one, vLLM
    adds none, and the replica spends no CPU per token on metrics nobody reads."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class _Unexported(PrometheusStatLogger):
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            pass  # PrometheusStatLogger's own would register every metric

        def record(self, *args: Any, **kwargs: Any) -> None:
            return None

        def record_admission_rejection(self, reason: str) -> None:
            return None

        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            return None

        def log_engine_initialized(self) -> None:
            return None

    return _Unexported
