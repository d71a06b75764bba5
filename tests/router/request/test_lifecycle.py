"""A stream whose decode replica fails while the only other one has registered since the router's last poll
of the registry: the continuation does not fail with "no ready decode replica"; the router polls the registry
at once and goes on there. (The e2e fault tests hit this when a replacement had just come up.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from decode_pool import StandInLegs
from inprocess_server import StandInRegistry, generate_path
from replicas import replica_info

from engine.messages import EngineRequest, ReplicaFailed, ReplicaInfo, TokenBatch
from engine.tiny_model import ensure_tiny_model
from pdserve_client.api import pdserve_pb2 as pb
from router.intake.tokenizer import PromptTokenizer
from router.messages import Finished, OutputDelta
from router.view.cluster_view import ClusterView


def _info(rid: str) -> ReplicaInfo:
    return replica_info(rid, ready=True)


class _Decode(StandInLegs):
    """D1's engine dies after one token; any other replica streams the rest. Records where legs went."""

    def __init__(self) -> None:
        super().__init__(self._batches)
        self.legs: list[str] = []

    async def _batches(self, req: EngineRequest, replica: str) -> AsyncIterator[TokenBatch]:
        self.legs.append(replica)
        if replica == "D1":
            yield TokenBatch(token_ids=[5], text="a", replica_id="D1")
            await asyncio.sleep(0.02)  # its failure reaches the router after the token it sent
            raise ReplicaFailed("D1", "its vLLM engine core died")
        yield TokenBatch(
            token_ids=[6],
            text="b",
            finish_reason="length",
            num_prompt_tokens=len(req.prompt_token_ids),
            replica_id=replica,
            node_id="n",
        )


async def test_a_continuation_finds_a_replica_that_registered_since_the_last_poll() -> None:
    tokenizer = PromptTokenizer(ensure_tiny_model())
    registry = StandInRegistry([_info("D1")])
    view = ClusterView(registry, block_size=32)
    await view.refresh()  # the router knows D1 only; its background poll is not running here
    decode = _Decode()
    path = generate_path(tokenizer, decode, view)
    registry.entries = [_info("D1"), _info("D2")]  # D2 registered after the router's last poll
    request = pb.GenerateRequest(
        prompt_token_ids=list(range(300, 340)), sampling=pb.SamplingParams(max_tokens=2)
    )
    events = [e async for e in path.run(request, "r1")]
    *deltas, finished = events
    assert isinstance(finished, Finished)
    assert decode.legs == ["D1", "D2"]
    assert [t for e in deltas if isinstance(e, OutputDelta) for t in e.token_ids] == [5]
    assert finished.token_ids == [6]  # the last batch rides in the final message
    done = finished.completion
    assert done.decode_replica == "D2" and "continued after decode replica D1" in done.note
