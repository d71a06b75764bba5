"""The router's CPU per streamed batch, alone: the real gRPC door (or `--door http`: the OpenAI door's SSE)
and request path (intake, decision, legs, token channel, output, metrics) in one process, fed by a STAND-IN
decode replica that streams fixed batches over the real token channel as fast as the router reads them; the
clients in another process. It measures the router's own per-batch work (and grpcio's), which the
side-by-side on a real engine (`bench.token_path_cpu`) cannot resolve on a noisy 2-core machine.

    .venv/bin/python -m bench.router_batch_cpu                   # the working tree
    .venv/bin/python -m bench.router_batch_cpu --rev d5829cb     # an earlier revision and the tree, in turn
    .venv/bin/python -m bench.router_batch_cpu --door http       # streamed chat completions on the HTTP door

Each measurement is a fresh process importing the router of the revision measured; printed: its CPU seconds
(gRPC's threads included; the stand-in's streaming too, the same in both) per streamed batch.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

CLIENTS = 16
HERE = Path(__file__).resolve()  # run by path: a revision measured may not have this module


async def _serve_and_measure(port: int, requests: int, batches: int, tokens: int, door: str) -> float:
    """The router on `port` (its `door`: grpc or http), driven by a client process; its CPU seconds over the
    measured requests."""
    from grpc_health.v1 import health_pb2

    from engine.messages import ClusterState, EngineRequest, ReplicaInfo, ReplyTo, TokenBatch
    from engine.tiny_model import ensure_tiny_model
    from engine.token_sender import TokenSender
    from router.config import LiveConfig
    from router.decision.decider import Decider
    from router.doors.grpc_service import PdserveService, start_grpc_server
    from router.generate import GeneratePath
    from router.intake.chat_encoder import SessionChatEncoder
    from router.intake.output_parser import OutputParsers
    from router.intake.prompt import PromptIntake
    from router.intake.tokenizer import PromptTokenizer
    from router.intake.validation import ModelLimits
    from router.legs.orchestrator import Orchestrator
    from router.legs.token_receiver import TokenReceiver
    from router.metrics import RouterMetrics
    from router.policy.selector import PdservePolicy
    from router.view.cluster_view import ClusterView

    d1 = ReplicaInfo(
        replica_id="D1",
        role="decode",
        node_id="n",
        kv_events_endpoint=None,
        kv_events_replay_endpoint=None,
        nixl_host="127.0.0.1",
        nixl_port=1,
        block_size=32,
    )

    class _Answer:
        def __init__(self, answer: Any) -> None:
            self._answer = answer

        def remote(self, *args: Any) -> Any:
            async def answer() -> Any:
                return self._answer(*args)

            return answer()

    class StandInRegistry:  # one decode replica, for a router of any revision (it polls by snapshot or sync)
        snapshot = _Answer(lambda: [d1])
        sync = _Answer(lambda report: ClusterState(replicas=[d1]))
        report_failed = _Answer(lambda *_: None)

    sender = TokenSender()

    async def stream(req: EngineRequest) -> AsyncIterator[TokenBatch]:
        ids, text = [100] * tokens, "ab" * tokens
        for _ in range(batches - 1):
            yield TokenBatch(token_ids=ids, text=text, replica_id="D1")
            await asyncio.sleep(0)  # an engine step
        end = len(req.prompt_token_ids)
        yield TokenBatch(
            token_ids=ids, text=text, finish_reason="length", num_prompt_tokens=end, replica_id="D1"
        )

    class StandInDecode:  # the leg channel's surface: a decode leg is `stream`, over the real token channel
        def generate(self, req: EngineRequest, reply_to: ReplyTo, replica_id: str) -> asyncio.Task[int]:
            return asyncio.ensure_future(sender.stream(reply_to, stream(req)))

    tokenizer = PromptTokenizer(ensure_tiny_model())
    view = ClusterView(StandInRegistry(), block_size=32)
    await view.refresh()
    metrics = RouterMetrics()
    # Intake takes the index's block size since 2026-12-06; an earlier revision measured may not.
    sized: dict[str, Any] = (
        {"block_size": 32} if "block_size" in inspect.signature(PromptIntake).parameters else {}
    )
    path = GeneratePath(
        intake=PromptIntake(
            tokenizer=tokenizer,
            chat_encoder=SessionChatEncoder(tokenizer),
            parsers=OutputParsers(tokenizer.hf_tokenizer, None, None),
            limits=ModelLimits(served_name="tiny-llama", max_model_len=2048, vocab_size=tokenizer.vocab_size),
            metrics=metrics,
            **sized,
        ),
        decider=Decider(
            view=view, policy=PdservePolicy(), block_size=32, has_prefill_pool=False, config=LiveConfig()
        ),
        legs=Orchestrator(
            StandInDecode(),  # type: ignore[arg-type]
            None,
            tokens=TokenReceiver(),
            block_size=32,
            config=LiveConfig(),
        ),
        metrics=metrics,
    )

    async def no_status() -> Any:
        raise RuntimeError("not served here")

    service = PdserveService(path, block_size=32, cluster_status=no_status)
    if door == "http":
        from router.doors.openai_http import HttpServer, build_app

        app = build_app(path, served_name="tiny-llama", max_model_len=2048, serving=lambda: True)
        http = HttpServer(app, "127.0.0.1", port)
        await http.start()
    else:
        server, health = await start_grpc_server(service, host="127.0.0.1", port=port)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
    clients = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE), "--clients", str(port), str(requests), door, stdout=asyncio.subprocess.PIPE
    )
    assert clients.stdout is not None
    await clients.stdout.readline()  # the clients' warm-up is done
    began = time.process_time()
    await clients.wait()
    spent = time.process_time() - began
    if door == "http":
        await http.stop()
    else:
        await server.stop(grace=None)
    if clients.returncode != 0:
        raise RuntimeError(f"the clients failed ({clients.returncode})")
    return spent


async def _clients(port: int, requests: int, door: str) -> None:
    """CLIENTS concurrent streams, `requests` in all, after one request each as a warm-up."""
    import grpc
    import httpx

    from pdserve_client.api import pdserve_pb2 as pb
    from pdserve_client.api import pdserve_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel, httpx.AsyncClient() as http:
        stub = pb_grpc.PdserveStub(channel)
        request = pb.GenerateRequest(prompt="hello there " * 20, sampling=pb.SamplingParams(max_tokens=1024))
        body = {"prompt": "hello there " * 20, "max_tokens": 1024, "stream": True}
        url = f"http://127.0.0.1:{port}/v1/completions"

        async def one() -> None:
            if door == "http":
                async with http.stream("POST", url, json=body, timeout=60) as response:
                    async for _ in response.aiter_lines():
                        pass
                return
            async for _ in stub.Generate(request):
                pass

        await asyncio.gather(*(one() for _ in range(CLIENTS)))
        print("warm", flush=True)
        left = [requests]

        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                await one()

        await asyncio.gather(*(client() for _ in range(CLIENTS)))


def _measure(tree: Path, args: argparse.Namespace) -> float:
    """CPU seconds per streamed batch of the router of `tree`, in a process of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, str(HERE), "--router", str(port)]
    command += [str(args.requests), str(args.batches), str(args.tokens), args.door]
    env = {**os.environ, "PYTHONPATH": str(tree)}  # that revision's router, not the installed tree's
    out = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    spent: float = json.loads(out.strip().splitlines()[-1])["cpu_s"]
    return spent / (args.requests * args.batches)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in ("--router", "--clients"):
        role, *rest = sys.argv[1:]
        if role == "--clients":
            asyncio.run(_clients(int(rest[0]), int(rest[1]), rest[2]))
        else:
            port, requests, batches, tokens = map(int, rest[:4])
            spent = asyncio.run(_serve_and_measure(port, requests, batches, tokens, rest[4]))
            print(json.dumps({"cpu_s": spent}))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default=None, help="an earlier revision, measured in turn with the working tree")
    ap.add_argument("--pairs", type=int, default=6, help="measurements of each (default 6)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--batches", type=int, default=64, help="streamed batches per request")
    ap.add_argument("--tokens", type=int, default=2, help="tokens per batch")
    ap.add_argument(
        "--door", choices=["grpc", "http"], default="grpc", help="the door the clients stream from"
    )
    args = ap.parse_args(argv)
    from bench.revision import REPO, extract

    with tempfile.TemporaryDirectory(prefix="pdserve-rev-") as tmp:
        trees = {"tree": REPO}
        if args.rev is not None:
            extract(args.rev, Path(tmp))
            trees = {args.rev: Path(tmp), "tree": REPO}
        per_batch: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(args.pairs):
            for name, tree in trees.items():
                per_batch[name].append(_measure(tree, args))
                print(f"{name:<12} {per_batch[name][-1] * 1e6:6.1f} µs/batch", flush=True)
    print(
        f"\n{args.door} door, {CLIENTS} clients, {args.requests} requests x {args.batches} batches"
        f" x {args.tokens} tokens:"
    )
    for name, xs in per_batch.items():
        med = statistics.median(xs)
        print(f"{name:<12} median {med * 1e6:6.1f} µs/batch, {med / args.tokens * 1e6:6.1f} µs/token "
              f"(min {min(xs) * 1e6:.1f}, max {max(xs) * 1e6:.1f})")  # fmt: skip
    if args.rev is not None:
        before, after = (statistics.median(per_batch[n]) for n in trees)
        print(f"tree / {args.rev}: {after / before:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
