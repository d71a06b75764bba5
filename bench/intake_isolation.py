"""Whether over-long prompts hold up anyone else: a short request's TTFT, idle and while over-long prompts
are being refused on both doors, and how long each refusal takes, in one run.

A local cluster on engine doubles (`pdserve bench`'s `doubles` system, the HTTP door on) is started. Short
requests (a few tokens in, 2 out) are sent one after another over gRPC, first alone, then while `--senders`
clients per door keep sending over-long prompts: gRPC requests just under the message limit and OpenAI chat
requests just under the HTTP body cap (router/doors/limits.py), each refused as too long for the model.

    .venv/bin/python -m bench.intake_isolation
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx

from bench.live.cli import LOCAL_TOPOLOGY
from bench.live.systems import PDSERVE_SYSTEMS, pdserve
from engine.host import free_ports
from pdserve_client.sdk import AsyncPdserveClient, PdserveError
from router.doors.limits import MAX_REQUEST_BYTES

# Room for the rest of the message or body (fields, JSON) beside the prompt text.
_ROOM = 4096
_LINE = "the quick brown fox jumps over a lazy dog while agents call tools and read their results "


def long_text(n_bytes: int) -> str:
    """Ordinary words, `n_bytes` of them in UTF-8 (ASCII)."""
    # No newline: JSON would escape it into two bytes.
    return (_LINE * (n_bytes // len(_LINE) + 1))[:n_bytes]


@dataclass
class Refusals:
    seconds: list[float] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


async def short_ttft(client: AsyncPdserveClient) -> float:
    began = time.perf_counter()
    async for response in client.generate(prompt="hello there", max_tokens=2, ignore_eos=True, timeout=60):
        if response.token_ids:
            return time.perf_counter() - began
    raise RuntimeError("a short request ended without a token")


async def grpc_over_long(target: str, text: str, out: Refusals, stop: asyncio.Event) -> None:
    async with AsyncPdserveClient(target) as client:
        while not stop.is_set():
            began = time.perf_counter()
            try:
                async for _ in client.generate(prompt=text, max_tokens=8, timeout=120):
                    pass
                out.unexpected.append("grpc: accepted")
            except PdserveError as exc:
                out.seconds.append(time.perf_counter() - began)
                if "at least" not in str(exc) and "tokens" not in str(exc):
                    out.unexpected.append(f"grpc: {exc}")


async def http_over_long(url: str, text: str, out: Refusals, stop: asyncio.Event) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 8}).encode()
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(timeout=120) as http:
        while not stop.is_set():
            began = time.perf_counter()
            response = await http.post(url, content=body, headers=headers)
            out.seconds.append(time.perf_counter() - began)
            if response.status_code != 400:
                out.unexpected.append(f"http {response.status_code}: {response.text[:200]}")


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1e3:.0f}"


async def run(grpc_target: str, http_url: str, *, shorts: int, senders: int) -> int:
    # The gRPC message holds the prompt as protobuf; the HTTP body as JSON (ASCII text: the same bytes).
    text = long_text(MAX_REQUEST_BYTES - _ROOM)
    async with AsyncPdserveClient(grpc_target) as client:
        for _ in range(3):  # warm-up
            await short_ttft(client)
        idle = [await short_ttft(client) for _ in range(shorts)]
        grpc_refusals, http_refusals = Refusals(), Refusals()
        stop = asyncio.Event()
        load = [
            *(
                asyncio.create_task(grpc_over_long(grpc_target, text, grpc_refusals, stop))
                for _ in range(senders)
            ),
            *(
                asyncio.create_task(http_over_long(http_url, text, http_refusals, stop))
                for _ in range(senders)
            ),
        ]
        await asyncio.sleep(0.2)  # the first over-long prompts are in
        loaded = [await short_ttft(client) for _ in range(shorts)]
        stop.set()
        await asyncio.gather(*load)
    idle_p50 = statistics.median(idle)
    print(f"\nover-long prompts: {len(text) / 1e6:.1f} MB of text, {senders} senders per door, back to back")
    print(f"{'':<34} {'p50 ms':>7} {'p90 ms':>7} {'max ms':>7} {'n':>5}")
    print(
        f"{'short request TTFT, idle':<34} {_ms(idle, 0.5):>7} {_ms(idle, 0.9):>7} {_ms(idle, 1):>7}"
        f" {len(idle):5d}"
    )
    print(
        f"{'short request TTFT, under load':<34} {_ms(loaded, 0.5):>7} {_ms(loaded, 0.9):>7}"
        f" {_ms(loaded, 1):>7} {len(loaded):5d}"
    )
    for name, refusals in (("gRPC", grpc_refusals), ("HTTP", http_refusals)):
        s = refusals.seconds
        print(f"{'refusal, ' + name:<34} {_ms(s, 0.5):>7} {_ms(s, 0.9):>7} {_ms(s, 1):>7} {len(s):5d}")
    print(f"\nshort TTFT under load / idle, p50: {statistics.median(loaded) / idle_p50:.2f}x")
    unexpected = grpc_refusals.unexpected + http_refusals.unexpected
    for line in unexpected[:5]:
        print("unexpected:", line)
    return 1 if unexpected else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shorts", type=int, default=40, help="short requests, idle and under load each")
    ap.add_argument("--senders", type=int, default=4, help="clients sending over-long prompts, per door")
    args = ap.parse_args(argv)
    (http_port,) = free_ports(1)
    overrides = {**PDSERVE_SYSTEMS["doubles"], "server.http_port": http_port}
    print("starting doubles with the HTTP door ...", flush=True)
    with pdserve(LOCAL_TOPOLOGY, overrides) as target:
        url = f"http://127.0.0.1:{http_port}/v1/chat/completions"
        return asyncio.run(run(target, url, shorts=args.shorts, senders=args.senders))


if __name__ == "__main__":
    raise SystemExit(main())
