"""`pdserve bench`: measure a running pdserve endpoint at the client, as a serving team would.

    pdserve bench --mode min-latency                       one request at a time
    pdserve bench --mode max-throughput                    every request at once
    pdserve bench --mode sweep --rates 1,2,4,8             open loop at each rate (Poisson by default)
    pdserve bench --mode rate --rate 4 --arrival gamma:0.5 one rate, bursty arrivals
    pdserve bench --mode concurrency --concurrency 16      closed loop: 16 clients back to back

Workload: `--input-len` / `--output-len` (fixed:N, normal:MEAN,STD, lognormal:MEAN,SIGMA), shared prefixes
(`--prefix-groups G --prefix-len L`). Warm-up requests (`--warmup`) are sent first and not counted. Reports
TTFT, TPOT, inter-token latency and end-to-end latency at P50/P95/P99, throughput, goodput under `--slo`,
the share of prompt tokens served from caches and of serving paths; `--json FILE` keeps everything, with the
endpoint's model and replicas, the versions and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import msgspec

from bench.live.arrivals import Arrivals
from bench.live.report import DEFAULT_SLO, RunResult, summarize, table
from bench.live.runner import closed_loop, open_loop, send
from bench.live.workload import Lengths, Workload
from bench.slo import Slo
from router.client import AsyncPdserveClient, PdserveError

MODES = ("min-latency", "max-throughput", "rate", "sweep", "concurrency")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="127.0.0.1:50051", help="the endpoint's host:port")
    p.add_argument("--token-env", default=None, help="environment variable holding the endpoint's token")
    p.add_argument("--tls", action="store_true", help="TLS with the system's trusted roots")
    p.add_argument("--mode", choices=MODES, default="sweep")
    p.add_argument("--rate", type=_positive, default=1.0, help="mode rate: requests per second")
    p.add_argument(
        "--rates", type=_rates, default=[0.5, 1.0, 2.0, 4.0], help="mode sweep: rates, e.g. 1,2,4,8"
    )
    p.add_argument("--concurrency", type=_count, default=8, help="mode concurrency: clients")
    p.add_argument(
        "--arrival", type=_arrivals, default=Arrivals("poisson"), help="poisson, constant, gamma:B"
    )
    p.add_argument("--num-requests", type=_count, default=32, help="requests per run")
    p.add_argument("--warmup", type=_count0, default=2, help="requests sent first and not counted")
    p.add_argument("--input-len", type=_lengths, default=Lengths("fixed", 256))
    p.add_argument("--output-len", type=_lengths, default=Lengths("fixed", 32))
    p.add_argument("--prefix-groups", type=_count0, default=0, help="groups sharing a prompt prefix")
    p.add_argument("--prefix-len", type=_count0, default=0, help="tokens of each group's shared prefix")
    p.add_argument(
        "--slo",
        type=_slo,
        default={},
        help="goodput's SLO: ttft=SECONDS,tpot=SECONDS (default ttft=2,tpot=0.1)",
    )
    p.add_argument("--timeout", type=_positive, default=600.0, help="deadline of each request (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the full report here")
    return p


def _typed(parse: Any) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _number(text: str, *, low: float, integer: bool) -> Any:
    value = int(text) if integer else float(text)
    if value < low:
        raise ValueError(f"{text}: must be >= {low:g}")
    return value


_positive = _typed(lambda t: _number(t, low=1e-9, integer=False))
_count = _typed(lambda t: _number(t, low=1, integer=True))
_count0 = _typed(lambda t: _number(t, low=0, integer=True))
_rates = _typed(lambda t: [_number(x, low=1e-9, integer=False) for x in t.split(",")])
_arrivals = _typed(Arrivals.parse)
_lengths = _typed(Lengths.parse)
_slo = _typed(Slo.given)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.slo = msgspec.structs.replace(DEFAULT_SLO, **args.slo)
    try:
        return asyncio.run(_bench(args))
    except PdserveError as exc:
        print(f"pdserve bench: {args.target}: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 2


async def _bench(args: argparse.Namespace) -> int:
    token = os.environ.get(args.token_env) if args.token_env else None
    if args.token_env and not token:
        print(f"pdserve bench: --token-env {args.token_env} is not set", file=sys.stderr)
        return 2
    async with AsyncPdserveClient(args.target, token=token, tls=args.tls) as client:
        (model, *_) = await client.list_models(timeout=30)
        workload = Workload(
            input_len=args.input_len,
            output_len=args.output_len,
            prefix_groups=args.prefix_groups,
            prefix_len=args.prefix_len,
            max_model_len=model.max_model_len,
        )
        print(
            f"pdserve bench: {args.target} ({model.id}), {workload.describe()}, mode {args.mode}", flush=True
        )
        for warm in workload.requests(args.warmup, seed=args.seed + 10_000):
            await send(client, warm, args.timeout)
        results = []
        for i, (label, run) in enumerate(_runs(args)):
            requests = workload.requests(args.num_requests, seed=args.seed + i)
            timed, seconds, offered = await run(client, requests)
            results.append(summarize(label, offered, timed, seconds, args.slo))
            r = results[-1]
            print(
                f"  {label}: {r.throughput_rps:.2f} req/s, TTFT p99 {1e3 * r.ttft_s['p99']:.0f} ms, "
                f"goodput {r.goodput_rps:.2f} req/s ({r.goodput_share:.0%})"
                + (f", failed {r.failed}" if r.failed else ""),
                flush=True,
            )
        replicas = await client.cluster_status(timeout=30)
    print(f"goodput: TTFT <= {args.slo.ttft_s:g} s and TPOT <= {1e3 * args.slo.tpot_s:g} ms")
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(_report(args, model, replicas, workload, results), indent=2))
    return 0 if all(not r.failed for r in results) else 1


def _runs(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(label, run) per measured run; a run sends its requests and returns (timed, seconds, offered rate)."""

    def at_rate(rate: float) -> Any:
        async def run(client: AsyncPdserveClient, requests: list[Any]) -> Any:
            offsets = args.arrival.offsets(len(requests), rate, args.seed)
            timed, seconds = await open_loop(client, requests, offsets, args.timeout)
            return timed, seconds, rate

        return run

    def closed(concurrency: int | None) -> Any:
        async def run(client: AsyncPdserveClient, requests: list[Any]) -> Any:
            timed, seconds = await closed_loop(client, requests, concurrency or len(requests), args.timeout)
            return timed, seconds, None

        return run

    if args.mode == "min-latency":
        return [("concurrency 1", closed(1))]
    if args.mode == "max-throughput":
        return [("all at once", closed(None))]
    if args.mode == "concurrency":
        return [(f"concurrency {args.concurrency}", closed(args.concurrency))]
    rates = [args.rate] if args.mode == "rate" else args.rates
    return [(f"rate {rate:g}/s", at_rate(rate)) for rate in rates]


def _report(
    args: argparse.Namespace, model: Any, replicas: Any, workload: Workload, results: list[RunResult]
) -> dict[str, Any]:
    from cluster.cli import version_line

    return {
        "target": args.target,
        "mode": args.mode,
        "arrival": str(args.arrival),
        "workload": workload.describe(),
        "slo": {"ttft_s": args.slo.ttft_s, "tpot_s": args.slo.tpot_s},
        "model": {"id": model.id, "max_model_len": model.max_model_len, "block_size": model.block_size},
        "replicas": [{"replica_id": r.replica_id, "role": r.role, "node_id": r.node_id} for r in replicas],
        "versions": version_line(),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "results": [r.as_dict() for r in results],
    }
