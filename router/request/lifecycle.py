"""One request from admission to freed: what the router holds for it, released on every path.

    admit (the first route) -> prefill done -> [replica failed -> reroute]* -> tokens -> turn done -> close

The legs (router/legs/) call it as they go; `close()` runs in a `finally` (the object is a context manager),
whatever ended the request: success, a refusal, a failed leg, a cancelled client. It frees the request's
admission, load accounting and policy state, and seals the session for its next turn.

It also keeps the request's timeline: the stages the legs report (`stage`), in the final message and, with
tracing on, as OpenTelemetry spans under one request span whose context the engine requests carry.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from opentelemetry import trace

from engine.messages import Sampling
from engine.tracing import carrier, wall_ns
from router.decision.decider import Decider
from router.errors import NoReplicaError
from router.messages import PromptReuse, RequestSummary, Route, Stage
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
        block_hashes: list[int] | None = None,
        attempts: int = 3,
        arrived: float | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        """`block_hashes`: the prompt's, when intake hashed it (None: the decision does). `attempts`: how
        often the request may move to another replica after a failed leg. `arrived`: when the request
        reached the router (time.monotonic(); default now): what it spent before this (its intake) is its
        first stage."""
        self.request_id = request_id
        self.session_id = session_id
        self.prompt = prompt
        self.sampling = sampling
        self.attempts = attempts
        self.route = Route(prefill=False)
        self._reuse = reuse
        self._block_hashes = block_hashes
        self._decider = decider
        self._metrics = metrics
        self._admitted = False
        self._first_token_at: float | None = None
        self._last_tokens_at: float | None = None
        now = time.monotonic()
        self.arrived = now if arrived is None else arrived
        self._stages: list[Stage] = []
        self._tracer = tracer
        self._span: trace.Span | None = None
        self.trace_headers: dict[str, str] | None = None
        if tracer is not None:
            self._span = tracer.start_span(
                "pdserve.request",
                start_time=wall_ns(self.arrived),
                attributes={"pdserve.request_id": request_id, "pdserve.prompt_tokens": len(prompt)},
            )
            self.trace_headers = carrier(self._span)
        self.stage("intake", self.arrived, now)

    def __enter__(self) -> RequestLifecycle:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._span is not None:
            if isinstance(exc, asyncio.CancelledError):
                self._span.set_attribute("pdserve.outcome", "cancelled")
            elif exc is not None:
                self._span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
        self.close()

    def stage(self, name: str, began: float, ended: float) -> None:
        """The request spent `began`..`ended` (time.monotonic()) in stage `name`."""
        self._stages.append(Stage(name, (began - self.arrived) * 1e3, (ended - began) * 1e3))
        if self._span is not None and self._tracer is not None:
            parent = trace.set_span_in_context(self._span)
            span = self._tracer.start_span(name, context=parent, start_time=wall_ns(began))
            span.end(end_time=wall_ns(ended))

    def admit(self) -> Route:
        """The first decision. Raises Overloaded (admission) or NoReplicaError (nothing eligible)."""
        self.route = self._decide(self.prompt, self.sampling, self._reuse, self._block_hashes)
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
        """The last token was generated: record the request and tell the decider where the turn's KV is.
        Its TTFT and end-to-end time count from its arrival, as its timeline does: a client waits through
        intake, the decision and every failed attempt too."""
        now = time.monotonic()
        c.e2e_ms = (now - self.arrived) * 1e3
        if self._first_token_at is not None:
            c.ttft_ms = (self._first_token_at - self.arrived) * 1e3
        self._record(c)
        c.timeline = list(self._stages)
        self._decider.turn_done(
            self.session_id, c.decode_replica, c.pinned_kv, self.prompt, c.output_token_ids
        )

    def close(self) -> None:
        """Free everything the router holds for the request. Idempotent."""
        self._decider.finish(self.request_id)
        if self._span is not None:
            self._span.end()
            self._span = None

    def _decide(
        self,
        prompt: list[int],
        sampling: Sampling,
        reuse: PromptReuse | None = None,
        block_hashes: list[int] | None = None,
    ) -> Route:
        began = time.monotonic()
        route = self._decider.route(self.request_id, self.session_id, prompt, sampling, reuse, block_hashes)
        ended = time.monotonic()
        self._metrics.decision_seconds.observe(ended - began)
        self.stage("decision", began, ended)
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
