"""OpenTelemetry traces of requests, shared by the router and the engine replicas (off unless the topology's
`server.otlp_traces_endpoint` is set).

Each process makes its own tracer provider (no global one is installed) and exports spans over OTLP. A
request's trace context crosses processes as W3C `traceparent` headers in its EngineRequest, so the spans a
replica makes (and vLLM's own, which read the same headers) are children of the router's request span.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def otlp_tracer(endpoint: str | None, service: str) -> trace.Tracer | None:
    """A tracer exporting to `endpoint` (OTLP over gRPC) in batches; None when tracing is off."""
    if endpoint is None:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider.get_tracer("pdserve")


def carrier(span: trace.Span) -> dict[str, str]:
    """`span`'s context as W3C trace headers (what an EngineRequest carries)."""
    headers: dict[str, str] = {}
    _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
    return headers


@contextmanager
def child_span(
    tracer: trace.Tracer | None, name: str, headers: dict[str, str] | None, **attributes: Any
) -> Iterator[trace.Span | None]:
    """A span parented by the trace headers a request carries (None, and nothing recorded, when tracing is
    off here or the request carries none)."""
    if tracer is None or not headers:
        yield None
        return
    parent = _PROPAGATOR.extract(headers)
    with tracer.start_as_current_span(name, context=parent, attributes=attributes) as span:
        yield span


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds OpenTelemetry records."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
