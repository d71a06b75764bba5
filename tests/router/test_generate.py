"""GeneratePath: a request whose wire bytes alone show that its prompt cannot fit is refused before it is
parsed, and counted as any other refusal."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from decode_pool import StandInLegs
from inprocess_server import StandInRegistry, generate_path

from engine.messages import EngineRequest, TokenBatch
from engine.tiny_model import ensure_tiny_model
from pdserve_client.api import pdserve_pb2 as pb
from router.errors import RequestFailed
from router.intake.tokenizer import PromptTokenizer
from router.metrics import RouterMetrics
from router.view.cluster_view import ClusterView


async def _nothing(req: EngineRequest, replica_id: str) -> AsyncIterator[TokenBatch]:
    raise AssertionError("a refused request reaches no replica")
    yield  # a generator


def test_a_refusal_from_the_wire_bytes_is_counted_as_invalid_argument() -> None:
    metrics = RouterMetrics()
    view = ClusterView(StandInRegistry(), block_size=32)
    path = generate_path(PromptTokenizer(ensure_tiny_model()), StandInLegs(_nothing), view, metrics=metrics)

    def invalid() -> float:
        return (
            metrics.registry.get_sample_value("pdserve_requests_total", {"code": "INVALID_ARGUMENT"}) or 0.0
        )

    with pytest.raises(RequestFailed) as refused:
        path.refuse_by_wire_size(pb.GenerateRequest(prompt="word " * 200_000).SerializeToString())
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.message.startswith("prompt: the prompt has at least ")
    assert invalid() == 1
    path.refuse_by_wire_size(pb.GenerateRequest(prompt="hello").SerializeToString())  # let through
    assert invalid() == 1
