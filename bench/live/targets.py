"""Where a benchmark sends its requests, behind one interface, timed the same way at the client:

- `host:port`: a pdserve gRPC endpoint (the agent API);
- `http://host:port` (or https): any OpenAI-compatible server's `/v1/completions`: pdserve's HTTP door, or a
  plain `vllm serve` of the same model (the baseline of the side-by-side run). Prompts go as token ids and
  `return_token_ids` (vLLM's extension) tells each chunk's tokens, so inter-token latency counts tokens,
  not chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from bench.live.runner import Timed
from bench.live.workload import Request
from engine.replica import HEARTBEAT_S
from pdserve_client.api import pdserve_pb2 as pb
from pdserve_client.sdk import AsyncPdserveClient, GenerateFields, PdserveError


@dataclass(frozen=True)
class Served:
    """What a target serves, and on which replicas (HTTP targets do not say: empty)."""

    model: str
    max_model_len: int
    block_size: int = 0
    replicas: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class EngineCounts:
    """The decode engines' cumulative counters, summed over replicas, as the cluster last reported them."""

    finished: int  # requests the decode engines finished
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    kv_tokens_received: int = 0  # prompt tokens whose KV came over NIXL
    kv_bytes_received: int = 0  # the bytes NIXL moved for them

    def speculation_since(self, before: EngineCounts) -> tuple[float, float] | None:
        """(acceptance rate, tokens an engine step) of the steps since `before`; None: nothing drafted."""
        drafts = self.spec_drafts - before.spec_drafts
        drafted = self.spec_draft_tokens - before.spec_draft_tokens
        if drafts <= 0 or drafted <= 0:
            return None
        accepted = self.spec_accepted_tokens - before.spec_accepted_tokens
        return accepted / drafted, 1.0 + accepted / drafts

    def kv_bytes_per_token_since(self, before: EngineCounts) -> float | None:
        """Bytes NIXL moved per prompt token whose KV it moved since `before`; None: none moved."""
        tokens = self.kv_tokens_received - before.kv_tokens_received
        return (self.kv_bytes_received - before.kv_bytes_received) / tokens if tokens > 0 else None


class Target(Protocol):
    address: str

    async def served(self) -> Served: ...

    # None where the target reports no engine counters (an OpenAI server).
    async def engine_counts(self) -> EngineCounts | None: ...

    async def send(self, req: Request, timeout_s: float) -> Timed: ...

    async def aclose(self) -> None: ...


async def counted(target: Target, before: EngineCounts | None, finished: int) -> EngineCounts | None:
    """The decode engines' counters once they count a run's `finished` requests: counters reach the
    cluster's status with each replica's heartbeat, so wait for that (two heartbeats at most)."""
    if before is None:
        return None
    deadline = time.monotonic() + 2.5 * HEARTBEAT_S
    while True:
        after = await target.engine_counts()
        if after is None or after.finished >= before.finished + finished or time.monotonic() > deadline:
            return after
        await asyncio.sleep(HEARTBEAT_S / 4)


class TargetError(Exception):
    """The target could not be reached or answered nonsense (the message names the address)."""


def open_target(
    address: str, *, token: str | None = None, tls: bool = False, temperature: float | None = None
) -> Target:
    """`temperature`: every request's sampling temperature (None: the server's default)."""
    if address.startswith(("http://", "https://")):
        return HttpTarget(address, token=token, temperature=temperature)
    return GrpcTarget(address, token=token, tls=tls, temperature=temperature)


class GrpcTarget:
    def __init__(
        self, address: str, *, token: str | None, tls: bool, temperature: float | None = None
    ) -> None:
        self.address = address
        self._temperature = temperature
        # A benchmark counts a lost stream as failed, not as the SDK's continuation of it.
        self._client = AsyncPdserveClient(address, token=token, tls=tls, reconnect_s=0)

    async def served(self) -> Served:
        try:
            (model, *_) = await self._client.list_models(timeout=30)
            replicas = await self._client.cluster_status(timeout=30)
        except PdserveError as exc:
            raise TargetError(f"{self.address}: {exc.code.name}: {exc.message}") from None
        return Served(
            model=model.id,
            max_model_len=model.max_model_len,
            block_size=model.block_size,
            replicas=tuple(
                {"replica_id": r.replica_id, "role": r.role, "node_id": r.node_id} for r in replicas
            ),
        )

    async def send(self, req: Request, timeout_s: float) -> Timed:
        fields: GenerateFields = {
            "token_ids": req.token_ids,
            "max_tokens": req.max_tokens,
            "ignore_eos": True,
            "session_id": req.session_id,
        }
        if self._temperature is not None:
            fields["temperature"] = self._temperature
        t = Timed(sent=time.monotonic(), session_id=req.session_id)
        try:
            async for msg in self._client.generate(timeout=timeout_s, **fields):
                now = time.monotonic()
                if msg.token_ids:
                    t.on_tokens(now, len(msg.token_ids))
                if msg.HasField("final"):
                    final = msg.final
                    t.end = now
                    t.completion_tokens = final.usage.completion_tokens
                    t.prompt_tokens = final.usage.prompt_tokens
                    t.cached_tokens = final.usage.cached_tokens
                    t.path = pb.ServingPath.Name(final.served_by.path).removeprefix("SERVING_PATH_").lower()
                    t.decode_replica = final.served_by.decode_replica
                    timings = final.timings
                    t.server_ttft = timings.ttft_ms / 1e3 if timings.ttft_ms else None
                    for stage in timings.timeline:
                        t.stages[stage.name] = t.stages.get(stage.name, 0.0) + stage.duration_ms / 1e3
        except PdserveError as exc:
            t.status = exc.code.name
        return t

    async def engine_counts(self) -> EngineCounts | None:
        try:
            replicas = [r for r in await self._client.cluster_status(timeout=30) if r.role == "decode"]
        except PdserveError as exc:
            raise TargetError(f"{self.address}: {exc.code.name}: {exc.message}") from None
        if not replicas:
            return None  # a server that reports no engines
        return EngineCounts(
            finished=sum(r.requests_finished for r in replicas),
            spec_drafts=sum(r.spec_drafts for r in replicas),
            spec_draft_tokens=sum(r.spec_draft_tokens for r in replicas),
            spec_accepted_tokens=sum(r.spec_accepted_tokens for r in replicas),
            kv_tokens_received=sum(r.prompt_tokens_external_kv for r in replicas),
            kv_bytes_received=sum(r.nixl_bytes_transferred for r in replicas),
        )

    async def aclose(self) -> None:
        await self._client.close()


class HttpTarget:
    def __init__(self, address: str, *, token: str | None, temperature: float | None = None) -> None:
        self.address = address.rstrip("/")
        self._sampling = {} if temperature is None else {"temperature": temperature}
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None
        self._model = ""

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No connection limit: an open-loop run has every in-flight request on its own connection.
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(limit=0)
            )
        return self._session

    async def served(self) -> Served:
        try:
            async with self._http().get(
                f"{self.address}/v1/models", timeout=aiohttp.ClientTimeout(total=30)
            ) as r:
                if r.status != 200:
                    raise TargetError(f"{self.address}/v1/models: HTTP {r.status}: {(await r.text())[:200]}")
                card = (await r.json())["data"][0]
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TargetError(f"{self.address}: UNAVAILABLE: {exc or type(exc).__name__}") from None
        except (KeyError, IndexError, ValueError) as exc:
            raise TargetError(f"{self.address}/v1/models: not an OpenAI model list ({exc})") from None
        if not card.get("max_model_len"):
            raise TargetError(f"{self.address}/v1/models: the model card has no max_model_len (vLLM's field)")
        self._model = card["id"]
        return Served(model=card["id"], max_model_len=int(card["max_model_len"]))

    async def engine_counts(self) -> EngineCounts | None:
        return None

    async def send(self, req: Request, timeout_s: float) -> Timed:
        body = {
            "model": self._model,
            "prompt": req.token_ids,
            "max_tokens": req.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            **self._sampling,
        }
        t = Timed(sent=time.monotonic(), session_id=req.session_id)
        try:
            async with self._http().post(
                f"{self.address}/v1/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                headers={"X-Session-Id": req.session_id} if req.session_id else None,
            ) as r:
                if r.status != 200:
                    t.status = f"HTTP_{r.status}"
                    return t
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    self._on_chunk(t, json.loads(line[6:]), time.monotonic())
        except TimeoutError:
            t.status = "DEADLINE_EXCEEDED"
        except aiohttp.ClientError:
            t.status = "UNAVAILABLE"
        if t.status == "OK" and t.end is None:
            t.status = "INCOMPLETE"  # the stream ended without its usage
        return t

    @staticmethod
    def _on_chunk(t: Timed, chunk: dict[str, Any], now: float) -> None:
        if "error" in chunk:
            t.status = "STREAM_ERROR"
            return
        for choice in chunk.get("choices") or ():
            if n := len(choice.get("token_ids") or ()):
                t.on_tokens(now, n)
        if served_by := chunk.get("pdserve"):  # pdserve's door says how it served the request
            t.path = served_by.get("path", "")
            t.decode_replica = served_by.get("decode_replica", "")
        if usage := chunk.get("usage"):
            t.end = now
            t.completion_tokens = usage["completion_tokens"]
            t.prompt_tokens = usage["prompt_tokens"]
            t.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
