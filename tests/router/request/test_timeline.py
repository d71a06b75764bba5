"""A request's timeline: its stages in the final message, and with tracing on one OpenTelemetry trace per
request, the router's spans and the replicas' parented by its request span. The replicas are the real
PrefillReplica and DecodeReplica classes on engine doubles, in this process but each with a tracer provider
of its own (as in their own processes), reached over their real leg and token channels; what joins them is
the trace context their EngineRequests carry.
vLLM's own spans (it reads the same headers) need a collector and a vLLM engine: not run here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from decode_pool import OPEN, token_receiver
from inprocess_server import StandInRegistry
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer
from replicas import replica_info, tiny_spec, unserved

from decode.decode_replica import DecodeReplica
from engine.double import DoubleEngineHost
from engine.leg_server import LegServer
from engine.messages import EngineRequest, ReplicaFailed
from engine.tiny_model import ensure_tiny_model
from engine.token_sender import TokenSender
from pdserve_client.api import pdserve_pb2 as pb
from prefill.prefill_replica import PrefillReplica
from router.config import LiveConfig, RouterConfig
from router.decision.decider import Decider
from router.errors import RequestFailed
from router.generate import GeneratePath
from router.intake.chat_encoder import SessionChatEncoder
from router.intake.output_parser import OutputParsers
from router.intake.prompt import PromptIntake
from router.intake.tokenizer import PromptTokenizer
from router.intake.validation import ModelLimits
from router.legs.leg_channel import LegChannel
from router.legs.orchestrator import Orchestrator
from router.messages import Finished
from router.metrics import RouterMetrics
from router.policy.selector import PdservePolicy
from router.view.cluster_view import ClusterView


def tracer(exporter: InMemorySpanExporter, service: str) -> Tracer:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer(service)


def replica(cls: type[Any], role: str, spans: Tracer) -> Any:
    spec = tiny_spec(role)
    r = unserved(cls)
    r.host = DoubleEngineHost(spec, replica_id=f"{role}-1", node_id="n", node_ip="127.0.0.1")
    r.host.start()
    r.tracer = spans
    r.tokens = TokenSender()
    OPEN.append(r.tokens)
    r._legs = LegServer(r.leg_handlers(), r.tokens, None)
    r._legs.start()
    SERVERS.append(r._legs)
    return r


# The leg servers and channels a test opened: closed after it.
SERVERS: list[LegServer] = []
CHANNELS: list[LegChannel] = []


@pytest.fixture(autouse=True)
def _close_channels() -> Iterator[None]:
    yield
    while CHANNELS:
        CHANNELS.pop().close()
    while SERVERS:
        SERVERS.pop().close()


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.shutdown()


def path(exporter: InMemorySpanExporter | None, **router: Any) -> GeneratePath:
    tokenizer = PromptTokenizer(ensure_tiny_model())
    metrics = RouterMetrics()
    config = LiveConfig(RouterConfig(mode="disaggregate", **router))
    spans = None if exporter is None else tracer(exporter, "router")
    prefill = replica(PrefillReplica, "prefill", tracer(exporter or InMemorySpanExporter(), "prefill"))
    decode = replica(DecodeReplica, "decode", tracer(exporter or InMemorySpanExporter(), "decode"))
    registry = StandInRegistry(
        [
            replica_info("prefill-1", "prefill", legs_address=prefill._legs.address),
            replica_info("decode-1", "decode", legs_address=decode._legs.address),
        ]
    )
    view = ClusterView(registry, block_size=32)
    view.sync(registry.entries)  # as its first poll leaves it
    receiver = token_receiver()
    channel = LegChannel(receiver, view.legs_address)
    CHANNELS.append(channel)
    return GeneratePath(
        intake=PromptIntake(
            tokenizer=tokenizer,
            chat_encoder=SessionChatEncoder(tokenizer),
            parsers=OutputParsers(tokenizer.hf_tokenizer, None, None),
            limits=ModelLimits(served_name="tiny-llama", max_model_len=2048, vocab_size=tokenizer.vocab_size),
            block_size=32,
            metrics=metrics,
        ),
        decider=Decider(
            view=view,
            policy=PdservePolicy(config.current),
            block_size=32,
            has_prefill_pool=True,
            config=config,
        ),
        legs=Orchestrator(channel, None, tokens=receiver, block_size=32, config=config),
        metrics=metrics,
        config=config,
        tracer=spans,
    )


async def generate(p: GeneratePath, request_id: str) -> Finished:
    request = pb.GenerateRequest(
        prompt_token_ids=list(range(100, 200)), sampling=pb.SamplingParams(max_tokens=4)
    )
    *_, finished = [e async for e in p.run(request, request_id)]
    assert isinstance(finished, Finished)
    return finished


async def test_the_final_message_has_the_requests_stages_in_order() -> None:
    finished = await generate(path(None), "r1")
    stages = finished.completion.timeline
    assert [s.name for s in stages] == ["intake", "decision", "prefill_leg", "first_token", "stream"]
    assert all(s.duration_ms >= 0 for s in stages)
    ends = [s.start_ms + s.duration_ms for s in stages]
    assert all(a <= b.start_ms + 1e-6 for a, b in zip(ends, stages[1:], strict=False))  # one after another
    # TTFT and end-to-end time count from the same arrival: the first token came after its stage, the end
    # after the stream's.
    assert ends[3] <= finished.completion.ttft_ms <= finished.completion.e2e_ms
    assert ends[-1] <= finished.completion.e2e_ms


def by_trace(spans: tuple[ReadableSpan, ...]) -> dict[int, list[ReadableSpan]]:
    out: dict[int, list[ReadableSpan]] = {}
    for span in spans:
        assert span.context is not None
        out.setdefault(span.context.trace_id, []).append(span)
    return out


async def test_one_trace_per_request_parented_across_the_router_and_the_replicas(
    exporter: InMemorySpanExporter,
) -> None:
    p = path(exporter)
    await generate(p, "r1")
    await generate(p, "r2")
    traces = by_trace(exporter.get_finished_spans())
    assert len(traces) == 2
    for spans in traces.values():
        (root,) = [s for s in spans if s.parent is None]
        assert root.name == "pdserve.request"
        names = {s.name for s in spans}
        assert names == {
            "pdserve.request",
            "intake",
            "decision",
            "prefill_leg",
            "first_token",
            "stream",
            "prefill_replica.prefill",
            "decode_replica.generate",
        }
        assert root.context is not None
        for span in spans:
            if span is not root:
                assert span.parent is not None and span.parent.span_id == root.context.span_id, span.name
        (decode_span,) = [s for s in spans if s.name == "decode_replica.generate"]
        assert [e.name for e in decode_span.events] == ["first_token"]
    ids = {s.attributes["pdserve.request_id"] for s in exporter.get_finished_spans() if s.parent is None}
    assert ids == {"r1", "r2"}


async def test_a_request_that_fails_ends_its_trace_with_an_error(exporter: InMemorySpanExporter) -> None:
    p = path(exporter, failover_attempts=0)

    async def dead(req: EngineRequest) -> Any:
        raise ReplicaFailed("prefill-1", "its vLLM engine core died")

    (prefill,) = [s for s in SERVERS if "prefill" in s._handlers]
    prefill._handlers["prefill"].__self__.host.prefill = dead  # type: ignore[attr-defined]
    request = pb.GenerateRequest(
        prompt_token_ids=list(range(100, 200)), sampling=pb.SamplingParams(max_tokens=4)
    )
    with pytest.raises(RequestFailed, match="no replica could finish the request"):
        async for _ in p.run(request, "r1"):
            pass
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "pdserve.request"]
    assert not root.status.is_ok
    assert "failed_attempt" in {s.name for s in spans}
