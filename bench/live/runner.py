"""Sending a workload to a pdserve endpoint and timing every request at the client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.live.workload import Request
from router.api import pdserve_pb2 as pb
from router.client import AsyncPdserveClient, PdserveError


@dataclass
class Timed:
    """One request as the client saw it (monotonic seconds)."""

    sent: float
    first_token: float | None = None
    end: float | None = None
    # (arrival, tokens) of every streamed message that carried tokens.
    messages: list[tuple[float, int]] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    path: str = ""
    status: str = "OK"

    @property
    def ok(self) -> bool:
        return self.status == "OK" and self.end is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.end is None or self.completion_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.completion_tokens - 1)

    def itl(self) -> list[float]:
        """Per-token inter-token latencies: each message's gap to the previous one, over its tokens."""
        out: list[float] = []
        for (prev, _), (at, n) in zip(self.messages, self.messages[1:], strict=False):
            out.extend([(at - prev) / n] * n)
        return out


async def send(client: AsyncPdserveClient, req: Request, timeout_s: float) -> Timed:
    t = Timed(sent=time.monotonic())
    try:
        async for msg in client.generate(
            token_ids=req.token_ids, max_tokens=req.max_tokens, ignore_eos=True, timeout=timeout_s
        ):
            now = time.monotonic()
            if msg.token_ids:
                if t.first_token is None:
                    t.first_token = now
                t.messages.append((now, len(msg.token_ids)))
            if msg.HasField("final"):
                final = msg.final
                t.end = now
                t.completion_tokens = final.usage.completion_tokens
                t.prompt_tokens = final.usage.prompt_tokens
                t.cached_tokens = final.usage.cached_tokens
                t.path = pb.ServingPath.Name(final.served_by.path).removeprefix("SERVING_PATH_").lower()
    except PdserveError as exc:
        t.status = exc.code.name
    return t


async def open_loop(
    client: AsyncPdserveClient,
    requests: Sequence[Request],
    offsets: Sequence[float],
    timeout_s: float,
    progress: Callable[[int], None] = lambda done: None,
) -> tuple[list[Timed], float]:
    """Each request sent at its offset from now, whether earlier ones finished or not. (results, seconds)."""
    start = time.monotonic()
    done = 0

    async def one(req: Request, at: float) -> Timed:
        nonlocal done
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        result = await send(client, req, timeout_s)
        done += 1
        progress(done)
        return result

    results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets, strict=True)))
    return list(results), time.monotonic() - start


async def closed_loop(
    client: AsyncPdserveClient,
    requests: Sequence[Request],
    concurrency: int,
    timeout_s: float,
    progress: Callable[[int], None] = lambda done: None,
) -> tuple[list[Timed], float]:
    """`concurrency` clients, each sending its next request when its last one finished."""
    start = time.monotonic()
    queue = list(reversed(requests))
    results: list[Timed] = []

    async def worker() -> None:
        while queue:
            results.append(await send(client, queue.pop(), timeout_s))
            progress(len(results))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return results, time.monotonic() - start
