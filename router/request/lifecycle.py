"""One request from admission to freed: what the router holds for it, released on every path.

    admit (the first route) -> prefill done -> [replica failed -> reroute]* -> tokens -> turn done -> close

The legs (router/legs/) call it as they go; `close()` runs in a `finally` (the object is a context manager),
whatever ended the request: success, a refusal, a failed leg, a cancelled client. It frees the request's
admission, load accounting and policy state, and seals the session for its next turn.
"""

from __future__ import annotations

import time
from types import TracebackType

from engine.messages import Sampling
from router.decision.decider import Decider
from router.errors import NoReplicaError
from router.messages import PromptReuse, RequestSummary, Route
from router.metrics import RouterMetrics


class RequestLifecycle:
    def __init__(
        self,
        decider: Decider,
        metrics: RouterMetrics,
        *,
        request_id: str,
        session_id: str | None,
        prompt: list[int],
        sampling: Sampling,
        reuse: PromptReuse | None = None,
        attempts: int = 3,
    ) -> None:
        """`attempts`: how often the request may move to another replica after a failed leg."""
        self.request_id = request_id
        self.session_id = session_id
        self.prompt = prompt
        self.sampling = sampling
        self.attempts = attempts
        self.route = Route(prefill=False)
        self._reuse = reuse
        self._decider = decider
        self._metrics = metrics
        self._admitted = False
        self._first_token_at: float | None = None
        self._last_tokens_at: float | None = None

    def __enter__(self) -> RequestLifecycle:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def admit(self) -> Route:
        """The first decision. Raises Overloaded (admission) or NoReplicaError (nothing eligible)."""
        self.route = self._decide(self.prompt, self.sampling, self._reuse)
        self._admitted = True
        return self.route

    def prefill_done(self) -> None:
        """The prompt is computed (the prefill leg returned, or decode's first token of a local prefill)."""
        self._decider.prefill_done(self.request_id)

    def replica_failed(self, replica_id: str, reason: str) -> None:
        """A leg found `replica_id` dead or its engine failed: no request goes there again."""
        self._decider.replica_failed(replica_id, reason)

    async def reroute(self, prompt: list[int], sampling: Sampling) -> Route:
        """A failed leg's continuation (`prompt`: the original one plus every token streamed so far): freed
        from its first admission, decided again. With no replica left in this router's view, the view is
        refreshed once first: a replacement may have registered since the last poll (every second)."""
        self._decider.finish(self.request_id)
        self._metrics.failovers.inc()
        try:
            self.route = self._decide(prompt, sampling)
        except NoReplicaError:
            await self._decider.refresh()
            self.route = self._decide(prompt, sampling)
        return self.route

    def tokens(self, count: int) -> None:
        """A batch of `count` tokens goes to the client (the inter-token latency is observed here)."""
        if not count:
            return
        now = time.monotonic()
        if self._first_token_at is None:
            self._first_token_at = now
        else:
            self._metrics.observe_itl(now - (self._last_tokens_at or now), count)
        self._last_tokens_at = now

    def turn_done(self, c: RequestSummary) -> None:
        """The last token was generated: record the request and tell the decider where the turn's KV is."""
        self._record(c)
        self._decider.turn_done(
            self.session_id, c.decode_replica, c.pinned_kv, self.prompt, c.output_token_ids
        )

    def close(self) -> None:
        """Free everything the router holds for the request. Idempotent."""
        self._decider.finish(self.request_id)

    def _decide(self, prompt: list[int], sampling: Sampling, reuse: PromptReuse | None = None) -> Route:
        began = time.perf_counter()
        route = self._decider.route(self.request_id, self.session_id, prompt, sampling, reuse)
        self._metrics.decision_seconds.observe(time.perf_counter() - began)
        self._metrics.on_decision(route.reason, route.terms)
        if route.readback_tokens:
            self._metrics.readback_tokens.labels(decode_replica=route.readback_replica).inc(
                route.readback_tokens
            )
        return route

    def _record(self, c: RequestSummary) -> None:
        m = self._metrics
        m.ttft.labels(path=c.path).observe(c.ttft_ms / 1e3)
        m.e2e.labels(path=c.path).observe(c.e2e_ms / 1e3)
        if self._first_token_at is not None and c.completion_tokens > 1:
            tpot = (time.monotonic() - self._first_token_at) / (c.completion_tokens - 1)
            m.tpot.labels(decode_replica=c.decode_replica).observe(tpot)
        if c.prefill_replica:
            m.prefill.labels(prefill_replica=c.prefill_replica).observe(c.prefill_ms / 1e3)
            m.kv_transfer_tokens.labels(
                prefill_replica=c.prefill_replica, decode_replica=c.decode_replica
            ).inc(c.kv_transferred_tokens)
        m.prompt_tokens.inc(c.prompt_tokens)
        m.completion_tokens.inc(c.completion_tokens)
        m.cached_tokens.inc(c.cached_tokens)
        m.predicted_cached_tokens.inc(c.predicted_cached_tokens)
        m.cache_prediction_error.observe(c.cached_tokens - c.predicted_cached_tokens)
        m.paths.labels(path=c.path).inc()
        if c.export:
            m.exports.labels(outcome=c.export).inc()
