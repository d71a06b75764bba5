"""Sending a workload at a target (bench/live/targets.py) and timing every request at the client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from bench.live.workload import Request

# A target's `send(request, timeout_s)`: the request sent, streamed and timed.
Send = Callable[[Request, float], Awaitable["Timed"]]


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
    decode_replica: str = ""  # where pdserve decoded it ("": another server, or not said)
    status: str = "OK"
    session_id: str = ""
    # The server's own account (pdserve's gRPC door): its time to first token from the request's arrival at
    # the router, and the seconds of each stage of its timeline (intake, decision, prefill_leg, ...).
    server_ttft: float | None = None
    stages: dict[str, float] = field(default_factory=dict)

    def on_tokens(self, now: float, n: int) -> None:
        if self.first_token is None:
            self.first_token = now
        self.messages.append((now, n))

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


async def open_loop(
    send: Send,
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
        result = await send(req, timeout_s)
        done += 1
        progress(done)
        return result

    results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets, strict=True)))
    return list(results), time.monotonic() - start


async def closed_loop(
    send: Send,
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
            results.append(await send(queue.pop(), timeout_s))
            progress(len(results))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return results, time.monotonic() - start


async def session_loop(
    send: Send,
    sessions: Sequence[Sequence[tuple[Request, float]]],
    starts: Sequence[float],
    timeout_s: float,
    progress: Callable[[int], None] = lambda done: None,
) -> tuple[list[Timed], float]:
    """Each session starts at its offset from now; its turns (request, gap) go one after the other, each
    `gap` seconds after the previous reply finished (an agent's think/tool time)."""
    start = time.monotonic()
    results: list[Timed] = []

    async def one(turns: Sequence[tuple[Request, float]], at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        for i, (req, gap) in enumerate(turns):
            if i:
                await asyncio.sleep(gap)
            results.append(await send(req, timeout_s))
            progress(len(results))

    await asyncio.gather(*(one(s, at) for s, at in zip(sessions, starts, strict=True)))
    return results, time.monotonic() - start
