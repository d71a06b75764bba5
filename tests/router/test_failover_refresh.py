"""A stream whose decode replica fails while the only other one has registered since the router's last poll
of the registry: the continuation does not fail with "no ready decode replica"; the router polls the registry
at once and goes on there. (The e2e fault tests hit this when a replacement had just come up.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from replicas import replica_info

from engine.messages import EngineRequest, ReplicaFailed, ReplicaInfo, TokenBatch
from engine.tiny_model import ensure_tiny_model
from router.api import pdserve_pb2 as pb
from router.chat_encoder import SessionChatEncoder
from router.cluster_view import ClusterView
from router.config import LiveConfig
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.output_parser import OutputParsers
from router.policy.selector import PdservePolicy
from router.routing import RequestRouter
from router.server import GenerateCall, PdserveService
from router.tokenizer import PromptTokenizer
from router.validation import ModelLimits


def _info(rid: str) -> ReplicaInfo:
    return replica_info(rid, ready=True)


class _Registry:
    """What the registry lists: `entries`, changed by the test between polls."""

    def __init__(self, entries: list[ReplicaInfo]) -> None:
        self.entries = entries
        self.snapshot = self._Call(lambda: list(self.entries))
        self.report_failed = self._Call(lambda: None)

    class _Call:
        def __init__(self, value: Any) -> None:
            self._value = value

        def remote(self, *args: Any) -> Any:
            async def answer() -> Any:
                return self._value()

            return answer()


class _Decode:
    """D1's engine dies after one token; any other replica streams the rest. Records where legs went."""

    def __init__(self) -> None:
        self.legs: list[str | None] = []

    def options(self, stream: bool) -> _Decode:
        return self

    @property
    def generate(self) -> _Decode:
        return self

    def remote(self, req: EngineRequest, replica_hint: str | None = None, replica_avoid: Any = ()) -> Any:
        self.legs.append(replica_hint)
        return _Stream(self._batches(req, replica_hint or ""))

    async def _batches(self, req: EngineRequest, replica: str) -> AsyncIterator[TokenBatch]:
        if replica == "D1":
            yield TokenBatch(token_ids=[5], text="a", replica_id="D1")
            raise ReplicaFailed("D1", "its vLLM engine core died")
        yield TokenBatch(
            token_ids=[6],
            text="b",
            finish_reason="length",
            num_prompt_tokens=len(req.prompt_token_ids),
            replica_id=replica,
            node_id="n",
        )


class _Stream:
    """A Serve streaming response: iterable and cancellable."""

    def __init__(self, batches: AsyncIterator[TokenBatch]) -> None:
        self._batches = batches

    def __aiter__(self) -> AsyncIterator[TokenBatch]:
        return self._batches

    def cancel(self) -> None:
        return None


async def test_a_continuation_finds_a_replica_that_registered_since_the_last_poll() -> None:
    tokenizer = PromptTokenizer(ensure_tiny_model())
    registry = _Registry([_info("D1")])
    view = ClusterView(registry, block_size=32)
    await view.refresh()  # the router knows D1 only; its background poll is not running here
    decode = _Decode()
    service = PdserveService(
        tokenizer=tokenizer,
        chat_encoder=SessionChatEncoder(tokenizer),
        parsers=OutputParsers(tokenizer.hf_tokenizer, None, None),
        limits=ModelLimits(served_name="tiny-llama", max_model_len=2048, vocab_size=tokenizer.vocab_size),
        block_size=32,
        orchestrator=Orchestrator(None, decode, block_size=32, config=LiveConfig()),
        router=RequestRouter(
            view=view, policy=PdservePolicy(), block_size=32, has_prefill_pool=False, config=LiveConfig()
        ),
        metrics=RouterMetrics(),
        cluster_status=lambda: None,
    )
    registry.entries = [_info("D1"), _info("D2")]  # D2 registered after the router's last poll
    request = pb.GenerateRequest(
        prompt_token_ids=list(range(300, 340)), sampling=pb.SamplingParams(max_tokens=2)
    )
    call = GenerateCall(request, request.SerializeToString(), "r1")
    messages = [m async for m in service.run(call, lambda: None)]
    final = messages[-1].final
    assert decode.legs == ["D1", "D2"]
    assert [t for m in messages for t in m.token_ids] == [5, 6]
    assert (
        final.served_by.decode_replica == "D2" and "continued after decode replica D1" in final.served_by.note
    )
