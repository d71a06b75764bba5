"""One Generate request, whichever door it came in by: the stages in order.

    intake (router/intake/)        validate, tokenize, check the length
    admit (router/request/)        the request's lifecycle: admission and the first route (router/decision/)
    legs (router/legs/)            prefill -> NIXL -> decode, or decode alone; failover
    output (router/intake/)        each batch parsed into content, reasoning and tool calls
    end                            one `Finished`, then the lifecycle frees the request

Every accepted request ends with exactly one terminal status, counted in pdserve_requests{code}; a failure
reaches the door as `RequestFailed`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace

from engine.messages import TokenBatch
from pdserve_client.api import pdserve_pb2 as pb
from router.config import LiveConfig
from router.decision.decider import Decider
from router.errors import ClientNotReading, NoReplicaError, Overloaded, RequestFailed
from router.intake.prompt import PromptIntake
from router.legs.orchestrator import Orchestrator
from router.messages import Finished, OutputDelta, ParsedDelta
from router.metrics import RouterMetrics
from router.request.lifecycle import RequestLifecycle

log = logging.getLogger(__name__)

MAX_CLIENT_REQUEST_ID = 128


class GeneratePath:
    def __init__(
        self,
        *,
        intake: PromptIntake,
        decider: Decider,
        legs: Orchestrator,
        metrics: RouterMetrics,
        config: LiveConfig | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        """`tracer`: where each request's spans go (None: tracing off; the timeline is kept either way)."""
        self.intake = intake
        self._tracer = tracer
        self._decider = decider
        self._legs = legs
        self._metrics = metrics
        self._config = config or LiveConfig()

    def refuse_by_wire_size(self, raw: bytes) -> None:
        """RequestFailed, counted as any refusal, for a request whose wire bytes alone show that its
        prompt cannot fit (PromptIntake.refuse_by_wire_size): before it is parsed."""
        try:
            self.intake.refuse_by_wire_size(raw)
        except RequestFailed as exc:
            self._metrics.requests.labels(code=exc.code.name).inc()
            raise

    async def run(
        self,
        request: pb.GenerateRequest,
        request_id: str,
        *,
        raw: bytes | None = None,
        time_remaining: Callable[[], float | None] = lambda: None,
    ) -> AsyncIterator[OutputDelta | Finished]:
        """The request's output, or RequestFailed. `raw`: its wire bytes (gRPC door); `time_remaining`: the
        call's deadline, to tell an expiry from a cancel. One generator, whose every step is a batch's:
        the stages it calls are plain calls and the legs' stream."""
        arrived = time.monotonic()
        code = grpc.StatusCode.OK
        self._metrics.inflight.inc()
        try:
            prompt = await self.intake.take(request, raw)
            output = prompt.output
            with RequestLifecycle(
                self._decider,
                self._metrics,
                request_id=request_id,
                session_id=prompt.session_id,
                prompt=prompt.token_ids,
                sampling=prompt.sampling,
                reuse=prompt.reuse,
                block_hashes=prompt.block_hashes,
                attempts=self._config.current.failover_attempts,
                arrived=arrived,
                tracer=self._tracer,
            ) as lifecycle:
                lifecycle.admit()
                last = OutputDelta(token_ids=[], parsed=ParsedDelta())  # until the last batch comes
                async for event in self._legs.serve(lifecycle):
                    if isinstance(event, TokenBatch):
                        lifecycle.tokens(len(event.token_ids))
                        parsed = output.feed(event.token_ids, event.text)
                        delta = OutputDelta(
                            token_ids=event.token_ids, parsed=parsed, logprobs=event.logprobs or []
                        )
                        if event.finish_reason is None:
                            yield delta
                        else:  # the last batch: the summary follows at once, and one message carries both
                            last = delta
                        continue
                    lifecycle.turn_done(event)
                    rest = output.finish()  # before the reason: it tells whether the model called tools
                    called = output.tools_called and event.finish_reason == "stop"
                    yield Finished(
                        parsed=last.parsed.then(rest),
                        finish_reason="tool_calls" if called else event.finish_reason,
                        completion=event,
                        token_ids=last.token_ids,
                        logprobs=last.logprobs,
                    )
        except (Overloaded, ClientNotReading) as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            raise RequestFailed(code, str(exc)) from exc
        except NoReplicaError as exc:
            code = grpc.StatusCode.UNAVAILABLE
            raise RequestFailed(code, str(exc)) from exc
        except RequestFailed as exc:
            code = exc.code
            raise
        except Exception as exc:
            code = grpc.StatusCode.INTERNAL
            raise internal_error("Generate", request_id, exc) from exc
        except asyncio.CancelledError:
            # Client cancelled or the deadline passed: the door cancels this task; the legs cancel the
            # engine calls on the way out.
            remaining = time_remaining()
            expired = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        finally:
            self._metrics.inflight.dec()
            self._metrics.requests.labels(code=code.name).inc()


def served_request_id(client_id: str) -> str:
    """The id a request is served and logged under: the client's own when it sent a usable one."""
    usable = client_id and len(client_id) <= MAX_CLIENT_REQUEST_ID and client_id.isprintable()
    return client_id if usable else uuid.uuid4().hex


def internal_error(method: str, request_id: str, exc: Exception) -> RequestFailed:
    """A bug or an unexpected failure: the client gets INTERNAL and an id to quote, never a traceback, a
    path or an address (the log has them, under the same id). gRPC itself would answer UNKNOWN with the
    exception's text."""
    log.error("%s %s failed", method, request_id, exc_info=exc)
    return RequestFailed(
        grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); request id {request_id}"
    )
