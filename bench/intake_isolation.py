"""Whether over-long prompts hold up anyone else: a short request's TTFT, idle and while over-long prompts
are being refused on both doors, and how long each refusal takes, in one run.

A local cluster on engine doubles (`pdserve bench`'s `doubles` system, the HTTP door on) is started. Short
requests (a few tokens in, 2 out) are sent one after another over gRPC, first alone, then while `--senders`
clients per door keep sending over-long prompts: gRPC requests just under the message limit and OpenAI chat
requests just under the HTTP body cap (router/doors/limits.py), each refused as too long for the model.

    .venv/bin/python -m bench.intake_isolation [--systems doubles@REV,doubles]

`doubles@REV` runs this repository as of git revision REV (bench/live/systems.py): before against after in one
run, one table. `sink` sends the short requests to this tree's `doubles` and the over-long prompts to a sink
on the same cores instead (bench/intake_sink.py: each read whole and refused, nothing else): what sharing the
machine with the senders costs a short request, the floor for any intake on it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench import intake_sink
from bench.live.cli import LOCAL_TOPOLOGY
from bench.live.systems import PDSERVE_SYSTEMS, pdserve, revision
from engine.ports import free_ports
from pdserve_client.sdk import AsyncPdserveClient, PdserveError
from router.doors.limits import MAX_REQUEST_BYTES

# Room for the rest of the message or body (fields, JSON) beside the prompt text.
_ROOM = 4096
SINK = "sink"  # the over-long prompts to bench/intake_sink.py, the short requests to doubles
_LINE = "the quick brown fox jumps over a lazy dog while agents call tools and read their results "


def long_text(n_bytes: int) -> str:
    """Ordinary words, `n_bytes` of them in UTF-8 (ASCII)."""
    # No newline: JSON would escape it into two bytes.
    return (_LINE * (n_bytes // len(_LINE) + 1))[:n_bytes]


@dataclass
class Refusals:
    seconds: list[float] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


async def short_ttft(client: AsyncPdserveClient) -> tuple[float, float]:
    """One short request: when it was sent (wall clock, comparable across processes) and its TTFT."""
    sent, began = time.time(), time.perf_counter()
    async for response in client.generate(prompt="hello there", max_tokens=2, ignore_eos=True, timeout=60):
        if response.token_ids:
            return sent, time.perf_counter() - began
    raise RuntimeError("a short request ended without a token")


async def grpc_refusal(client: AsyncPdserveClient, text: str, out: Refusals) -> None:
    began = time.perf_counter()
    try:
        async for _ in client.generate(prompt=text, max_tokens=8, timeout=120):
            pass
        out.unexpected.append("grpc: accepted")
    except PdserveError as exc:
        out.seconds.append(time.perf_counter() - began)
        if "at least" not in str(exc) and "tokens" not in str(exc) and intake_sink.REFUSAL not in str(exc):
            out.unexpected.append(f"grpc: {exc}")


async def http_refusal(http: httpx.AsyncClient, url: str, body: bytes, out: Refusals) -> None:
    began = time.perf_counter()
    response = await http.post(url, content=body, headers={"content-type": "application/json"})
    out.seconds.append(time.perf_counter() - began)
    if response.status_code != 400:
        out.unexpected.append(f"http {response.status_code}: {response.text[:200]}")


def _send_over_long(
    grpc_target: str, http_url: str, text: str, senders: int, burst: bool, stop: Any, results: Any
) -> None:
    """The over-long senders, in their own process, until `stop`: `senders` clients per door back to back, or
    (`burst`) that many per door sent together, again 0.25 s after the last is refused. Puts the refusals and
    the bursts' (start, end) wall-clock windows on `results`."""
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 8}).encode()

    async def send() -> tuple[Refusals, Refusals, list[tuple[float, float]]]:
        grpc_refusals, http_refusals, windows = Refusals(), Refusals(), []
        clients = [AsyncPdserveClient(grpc_target) for _ in range(senders)]
        https = [httpx.AsyncClient(timeout=120) for _ in range(senders)]

        async def back_to_back(coro: Any) -> None:
            while not stop.is_set():
                await coro()

        try:
            if burst:
                while not stop.is_set():
                    began = time.time()
                    await asyncio.gather(
                        *(grpc_refusal(c, text, grpc_refusals) for c in clients),
                        *(http_refusal(h, http_url, body, http_refusals) for h in https),
                    )
                    windows.append((began, time.time()))
                    await asyncio.sleep(0.25)
            else:
                await asyncio.gather(
                    *(back_to_back(lambda c=c: grpc_refusal(c, text, grpc_refusals)) for c in clients),
                    *(
                        back_to_back(lambda h=h: http_refusal(h, http_url, body, http_refusals))
                        for h in https
                    ),
                )
        finally:
            for c in clients:
                await c.close()
            for h in https:
                await h.aclose()
        return grpc_refusals, http_refusals, windows

    results.put(asyncio.run(send()))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def _ms(values: list[float], q: float) -> str:
    return f"{_quantile(values, q) * 1e3:.0f}" if values else "-"


@dataclass
class Outcome:
    """One system's run: short TTFTs idle and under load (seconds), the refusals, and the load's shape."""

    idle: list[float]
    loaded: list[float]
    grpc: Refusals
    http: Refusals
    how: str


async def run(
    grpc_target: str,
    http_url: str,
    *,
    shorts: int,
    senders: int,
    burst: bool,
    over_long_to: tuple[str, str] | None = None,
) -> Outcome:
    """Short requests to `grpc_target`, idle and while over-long prompts are sent to the same router's doors
    (or to `over_long_to`'s gRPC target and HTTP URL: the sink)."""
    over_grpc, over_http = over_long_to or (grpc_target, http_url)
    # The gRPC message holds the prompt as protobuf; the HTTP body as JSON (ASCII text: the same bytes).
    text = long_text(MAX_REQUEST_BYTES - _ROOM)
    async with AsyncPdserveClient(grpc_target) as client:
        for _ in range(3):  # warm-up
            await short_ttft(client)
        idle = [ttft for _, ttft in [await short_ttft(client) for _ in range(shorts)]]
        # The senders run in a process of their own, as other clients would: sharing this event loop, their
        # 4 MB writes would delay the short requests' own client and be counted as the router's.
        ctx = multiprocessing.get_context("spawn")
        stop, results = ctx.Event(), ctx.SimpleQueue()
        sender = ctx.Process(
            target=_send_over_long, args=(over_grpc, over_http, text, senders, burst, stop, results)
        )
        sender.start()
        timed: list[tuple[float, float]] = []
        try:
            await asyncio.sleep(2.0)  # the sender process is up and its first over-long prompts are in
            # In bursts only the short requests that overlap one count: more are sent to get `shorts` of them.
            for _ in range(shorts * (8 if burst else 1)):
                timed.append(await short_ttft(client))
                await asyncio.sleep(0.01 if burst else 0)
        finally:
            stop.set()
        grpc_refusals, http_refusals, windows = await asyncio.to_thread(results.get)
        sender.join(30)
    if burst:
        # A short request counts when it was sent during a burst (between its first send and last refusal).
        loaded = [ttft for sent, ttft in timed if any(a <= sent <= b for a, b in windows)]
        how = f"{2 * senders} at once ({senders} per door), {len(windows)} bursts"
    else:
        loaded = [ttft for _, ttft in timed]
        how = f"{senders} senders per door, back to back"
    return Outcome(idle, loaded, grpc_refusals, http_refusals, how)


def report(outcomes: list[tuple[str, Outcome]]) -> int:
    """One row per system; 1 when a system saw an unexpected answer or no short request under load."""
    mb = len(long_text(MAX_REQUEST_BYTES - _ROOM)) / 1e6
    print(f"\nover-long prompts: {mb:.1f} MB of text; " + "; ".join(f"{n}: {o.how}" for n, o in outcomes))
    cols = ["idle p50", "load p50", "load p90", "load/idle", "gRPC p50", "gRPC p90", "HTTP p50", "HTTP p90"]
    print(
        f"{'system':<22} " + " ".join(f"{c:>9}" for c in cols) + "   (ms; short request TTFT, then refusals)"
    )
    failed = 0
    for system, o in outcomes:
        ratio = f"{_quantile(o.loaded, 0.5) / _quantile(o.idle, 0.5):.2f}x" if o.loaded else "-"
        cells = [_ms(o.idle, 0.5), _ms(o.loaded, 0.5), _ms(o.loaded, 0.9), ratio]
        cells += [_ms(r.seconds, q) for r in (o.grpc, o.http) for q in (0.5, 0.9)]
        print(f"{system:<22} " + " ".join(f"{c:>9}" for c in cells))
        for line in (o.grpc.unexpected + o.http.unexpected)[:5]:
            print(f"  {system}: unexpected: {line}")
        failed |= bool(o.grpc.unexpected or o.http.unexpected or not o.loaded)
    return int(failed)


def systems(spec: str) -> list[str]:
    """`--systems`: `doubles`, `doubles@REV` or `sink`, comma-separated."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for name in names:
        base, _, rev = name.partition("@")
        if name != SINK and (base != "doubles" or (name != base and not rev)):
            raise argparse.ArgumentTypeError(f"{name!r}: this bench runs `doubles`, `doubles@REV` or `sink`")
    if not names:
        raise argparse.ArgumentTypeError("name at least one system")
    return names


@contextlib.contextmanager
def _sink() -> Iterator[tuple[str, str]]:
    """A sink process (bench/intake_sink.py) for the over-long prompts: its gRPC target and HTTP URL."""
    grpc_port, http_port = free_ports(2)
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    process = ctx.Process(target=intake_sink.run, args=(grpc_port, http_port, ready, stop))
    process.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the sink did not start listening within 60 s")
        yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}/v1/chat/completions"
    finally:
        stop.set()
        process.join(10)
        if process.is_alive():
            process.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shorts", type=int, default=40, help="short requests, idle and under load each")
    ap.add_argument("--senders", type=int, default=2, help="clients sending over-long prompts, per door")
    ap.add_argument(
        "--back-to-back",
        action="store_true",
        help="each sender sends its next over-long prompt as soon as the last is refused (default: bursts, "
        "every sender's prompt at once, again 0.25 s after the last refusal)",
    )
    ap.add_argument(
        "--systems",
        type=systems,
        default=["doubles"],
        help="comma-separated: doubles, doubles@REV (this repository at git revision REV), or sink (the "
        "over-long prompts to a sink on the same cores, the short requests to doubles)",
    )
    args = ap.parse_args(argv)
    outcomes = []
    for system in args.systems:
        (http_port,) = free_ports(1)
        overrides = {**PDSERVE_SYSTEMS["doubles"], "server.http_port": http_port}
        print(f"starting {system} with the HTTP door ...", flush=True)
        with contextlib.ExitStack() as stack:
            _, _, rev = system.partition("@")
            env, tree = stack.enter_context(revision(rev)) if rev else (None, None)
            target = stack.enter_context(pdserve(LOCAL_TOPOLOGY, overrides, env, tree))
            url = f"http://127.0.0.1:{http_port}/v1/chat/completions"
            sink = stack.enter_context(_sink()) if system == SINK else None
            outcome = asyncio.run(
                run(
                    target,
                    url,
                    shorts=args.shorts,
                    senders=args.senders,
                    burst=not args.back_to_back,
                    over_long_to=sink,
                )
            )
        outcomes.append((system, outcome))
    return report(outcomes)


if __name__ == "__main__":
    raise SystemExit(main())
