"""`pdserve bench`: measure a running pdserve endpoint at the client, as a serving team would.

    pdserve bench --mode min-latency                       one request at a time
    pdserve bench --mode max-throughput                    every request at once
    pdserve bench --mode sweep --rates 1,2,4,8             open loop at each rate (Poisson by default)
    pdserve bench --mode rate --rate 4 --arrival gamma:0.5 one rate, bursty arrivals
    pdserve bench --mode concurrency --concurrency 16      closed loop: 16 clients back to back
    pdserve bench --mode sessions --sessions 4             agent sessions from a trace folder (Claude Code),
                                                           turn by turn with their think/tool gaps
    pdserve bench --side-by-side --mode sweep              pdserve P/D, pdserve aggregated and a plain
                                                           `vllm serve`, started here in turn, with ratios
    pdserve bench --side-by-side aggregated@REV,aggregated  before (git revision REV) against after
    pdserve bench --side-by-side aggregated+http,vllm      pdserve's OpenAI door against `vllm serve`: the
                                                           same protocol and client
    pdserve bench --side-by-side aggregated2,aggregated2:round_robin --mode sessions --rounds 3
                                                           pdserve's routing against a cache-blind one,
                                                           three rounds in alternating order
    pdserve bench --side-by-side pd-ngram,pd --temperature 0
                                                           ngram speculative decoding against none
    pdserve bench --side-by-side pd-fp8,pd                  an fp8 KV cache against the model's dtype

Workload: `--input-len` / `--output-len` (fixed:N, normal:MEAN,STD, lognormal:MEAN,SIGMA), shared prefixes
(`--prefix-groups G --prefix-len L`). Warm-up requests (`--warmup`, then up to the run's longest prompt) are
sent first and not counted. Reports TTFT, TPOT, inter-token latency and end-to-end latency at P50/P95/P99,
throughput, goodput under `--slo`, the share of prompt tokens served from caches and of serving paths, and
from a pdserve cluster's decode engines the speculative acceptance (accepted / drafted tokens, tokens a step)
and the KV bytes NIXL moved per token; `--json FILE` keeps everything, with the endpoint's model and replicas,
the versions and the machine; `--plots DIR` draws latency and goodput against the rate, and latency CDFs.
`--target`: a pdserve gRPC endpoint (host:port) or an OpenAI-compatible server (http://host:port).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import yaml

from bench.live.arrivals import Arrivals
from bench.live.plots import PlotsUnavailable, pyplot, write_plots
from bench.live.progress import Progress
from bench.live.report import DEFAULT_SLO, RunResult, beside_text, summarize, table
from bench.live.runner import Send, Timed, closed_loop, open_loop, session_loop
from bench.live.sessions import plan_sessions
from bench.live.side_by_side import SystemDidNotStart, measure_systems, summary
from bench.live.systems import DEFAULT_SYSTEMS, POLICIES, REPO, SYSTEMS, known
from bench.live.targets import Served, TargetError, counted, open_target
from bench.live.workload import Lengths, Request, Workload
from bench.replay.traces import DEFAULT_TRACES_DIR
from bench.slo import Slo

LOCAL_TOPOLOGY = REPO / "deploy" / "local.yaml"
MODES = ("min-latency", "max-throughput", "rate", "sweep", "concurrency", "sessions")


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
    p.add_argument("--sessions", type=_count, default=4, help="mode sessions: sessions (a seeded sample)")
    p.add_argument("--max-turns", type=_count, default=8, help="mode sessions: turns of each session")
    p.add_argument(
        "--gap-scale", type=_positive0, default=1.0, help="mode sessions: times the recorded think/tool gaps"
    )
    p.add_argument(
        "--traces-dir",
        type=Path,
        default=DEFAULT_TRACES_DIR,
        help="mode sessions: a folder holding claude-code/sessions/*.json[.gz|.xz] (default: bundled)",
    )
    p.add_argument("--warmup", type=_count0, default=2, help="requests sent first and not counted")
    p.add_argument("--input-len", type=_lengths, default=Lengths("fixed", 256))
    p.add_argument("--output-len", type=_lengths, default=Lengths("fixed", 32))
    p.add_argument("--prefix-groups", type=_count0, default=0, help="groups sharing a prompt prefix")
    p.add_argument("--prefix-len", type=_count0, default=0, help="tokens of each group's shared prefix")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="every request's sampling temperature (default: the server's); 0: greedy, as speculative "
        "decoding's acceptance of a random-weight model needs",
    )
    p.add_argument(
        "--repeat-period",
        type=_count0,
        default=0,
        help="each prompt repeats a random run of this many tokens (text that repeats itself, what ngram "
        "speculation drafts from); 0: random throughout",
    )
    p.add_argument(
        "--slo",
        type=_slo,
        default={},
        help="goodput's SLO: ttft=SECONDS,tpot=SECONDS (default ttft=2,tpot=0.1)",
    )
    p.add_argument("--timeout", type=_positive, default=600.0, help="deadline of each request (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the full report here")
    p.add_argument("--plots", type=Path, default=None, help="write PNG plots into this folder")
    p.add_argument(
        "--side-by-side",
        type=_systems,
        nargs="?",
        const=list(DEFAULT_SYSTEMS),
        default=None,
        metavar="SYSTEMS",
        help="start each system here in turn, the same workload on each (default "
        f"{','.join(DEFAULT_SYSTEMS)}; from {', '.join(SYSTEMS)}; NAME@REV: this repository at git revision "
        "REV; NAME:POLICY: routed by a cache-blind router.policy, round_robin or least_loaded)",
    )
    p.add_argument(
        "--rounds", type=_count, default=1, help="side by side: the systems N times, in alternating order"
    )
    p.add_argument(
        "--topology",
        type=Path,
        default=None,
        help="the cluster's topology file, kept in the JSON; side by side: what the systems are built from "
        "(default deploy/local.yaml)",
    )
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
_positive0 = _typed(lambda t: _number(t, low=0, integer=False))
_rates = _typed(lambda t: [_number(x, low=1e-9, integer=False) for x in t.split(",")])
_arrivals = _typed(Arrivals.parse)
_lengths = _typed(Lengths.parse)
_slo = _typed(Slo.given)


def _parse_systems(text: str) -> list[str]:
    chosen = text.split(",")
    if unknown := [s for s in chosen if not known(s)]:
        raise ValueError(
            f"unknown system {', '.join(unknown)}: choose from {', '.join(SYSTEMS)}; a pdserve one as "
            f"NAME@REV (a git revision) or NAME:POLICY ({', '.join(POLICIES)})"
        )
    if len(set(chosen)) != len(chosen):
        raise ValueError("each system once")
    return chosen


_systems = _typed(_parse_systems)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.slo = msgspec.structs.replace(DEFAULT_SLO, **args.slo)
    args.token = os.environ.get(args.token_env) if args.token_env else None
    if args.token_env and not args.token:
        return _fail(f"--token-env {args.token_env} is not set")
    try:
        if args.rounds > 1 and (not args.side_by_side or args.plots is not None):
            return _fail("--rounds: only with --side-by-side, and without --plots (a plot draws one round)")
        if args.plots is not None:
            pyplot()  # before any run: a missing plotting library is not found out at the end
        if args.side_by_side:
            return _side_by_side(args)
        served, workload, results = asyncio.run(measure(args, args.target))
    except (TargetError, PlotsUnavailable, FileNotFoundError) as exc:  # the last: --traces-dir
        return _fail(str(exc))
    print(table(results))
    report = _report(args, {args.target: (served, results)}, workload)
    _write(args, report, {"": results})
    return 0 if all(not r.failed for r in results) else 1


def _fail(message: str) -> int:
    print(f"pdserve bench: {message}", file=sys.stderr)
    return 2


def _side_by_side(args: argparse.Namespace) -> int:
    try:
        measured, workload = measure_systems(
            args.side_by_side,
            args.rounds,
            args.topology or LOCAL_TOPOLOGY,
            lambda address: asyncio.run(measure(args, address)),
        )
    except SystemDidNotStart as exc:
        return _fail(str(exc))
    runs = {system: results for system, (_, results) in measured.items()}
    print(summary(runs, args.side_by_side[-1], args.rounds))
    _write(args, _report(args, measured, workload), runs)
    return 0 if all(not r.failed for rs in runs.values() for r in rs) else 1


async def measure(args: argparse.Namespace, address: str) -> tuple[Served, str, list[RunResult]]:
    """Warm-up, then the mode's runs against `address`, each with the same seeded requests on any target.
    (what it serves, the workload in words, one result per run)."""
    target = open_target(address, token=args.token, tls=args.tls, temperature=args.temperature)
    try:
        served = await target.served()
        workload = Workload(
            input_len=args.input_len,
            output_len=args.output_len,
            prefix_groups=args.prefix_groups,
            prefix_len=args.prefix_len,
            repeat_period=args.repeat_period,
            max_model_len=served.max_model_len,
        )
        runs, described, longest = _runs(args, workload)
        print(f"pdserve bench: {address} ({served.model}), {described}, mode {args.mode}", flush=True)
        counts = await target.engine_counts()
        warm = workload.warmup(args.warmup, longest, seed=args.seed + 10_000)
        warmed = [await target.send(w, args.timeout) for w in warm]
        # The engines' counters reach the cluster's status with a heartbeat: a run's window starts once they
        # count the warm-up, or the run's would be read early, mid-request (KV bytes moved, tokens not yet).
        before = await counted(target, counts, sum(t.ok for t in warmed))
        results = []
        for label, count, run in runs:
            progress = Progress(label, count)
            timed, seconds, offered = await run(target.send, progress)
            progress.close()
            after = await counted(target, before, sum(t.ok for t in timed))
            r = summarize(label, offered, timed, seconds, args.slo, engines=(before, after))
            results.append(r)
            before = after
            print(
                f"  {label}: {r.throughput_rps:.2f} req/s, TTFT p99 {1e3 * r.ttft_s['p99']:.0f} ms, "
                f"goodput {r.goodput_rps:.2f} req/s ({r.goodput_share:.0%})"
                + (f", failed {r.failed}" if r.failed else "")
                + (
                    f", {r.spec_acceptance:.0%} of drafts accepted, {r.spec_tokens_per_step:.2f} tokens/step"
                    if r.spec_acceptance is not None and r.spec_tokens_per_step is not None
                    else ""
                )
                + beside_text(r),
                flush=True,
            )
        return served, described, results
    finally:
        await target.aclose()


# async (send, progress) -> (timed requests, seconds, offered rate or None)
Run = Callable[[Send, Progress], Awaitable[tuple[list[Timed], float, float | None]]]


# (label, requests, run) per measured run, the workload in words, and the longest prompt it sends
Runs = tuple[list[tuple[str, int, Run]], str, int]


def _runs(args: argparse.Namespace, workload: Workload) -> Runs:

    def requests(i: int) -> list[Request]:
        return workload.requests(args.num_requests, seed=args.seed + i)

    def at_rate(rate: float, i: int) -> Run:
        async def run(send: Send, progress: Progress) -> Any:
            offsets = args.arrival.offsets(args.num_requests, rate, args.seed)
            timed, seconds = await open_loop(send, requests(i), offsets, args.timeout, progress)
            return timed, seconds, rate

        return run

    def closed(concurrency: int | None) -> Run:
        async def run(send: Send, progress: Progress) -> Any:
            n = concurrency or args.num_requests
            timed, seconds = await closed_loop(send, requests(0), n, args.timeout, progress)
            return timed, seconds, None

        return run

    n, what = args.num_requests, workload.describe()
    if args.mode == "sessions":
        return _sessions_run(args, workload.max_model_len)
    if args.mode in ("min-latency", "max-throughput", "concurrency"):
        c = {"min-latency": 1, "max-throughput": None, "concurrency": args.concurrency}[args.mode]
        label = {1: "concurrency 1", None: "all at once"}.get(c, f"concurrency {c}")
        return [(label, n, closed(c))], what, max(len(r.token_ids) for r in requests(0))
    rates = [args.rate] if args.mode == "rate" else args.rates
    longest = max(len(r.token_ids) for i in range(len(rates)) for r in requests(i))
    return [(f"rate {rate:g}/s", n, at_rate(rate, i)) for i, rate in enumerate(rates)], what, longest


def _sessions_run(args: argparse.Namespace, max_model_len: int) -> Runs:
    """Agent sessions starting at `--rate` sessions per second (`--arrival`), turn by turn."""
    plan = plan_sessions(
        num_sessions=args.sessions,
        max_turns=args.max_turns,
        max_model_len=max_model_len,
        max_output=int(args.output_len.mean),
        gap_scale=args.gap_scale,
        seed=args.seed,
        traces_dir=args.traces_dir,
    )
    sessions = [[(t.request, t.gap_s) for t in turns] for turns in plan.sessions]

    async def run(send: Send, progress: Progress) -> Any:
        starts = args.arrival.offsets(len(sessions), args.rate, args.seed)
        timed, seconds = await session_loop(send, sessions, starts, args.timeout, progress)
        return timed, seconds, None

    turns = sum(len(s) for s in sessions)
    described = plan.describe(str(args.traces_dir)) + f", gaps x{args.gap_scale:g}"
    longest = max(len(r.token_ids) for s in sessions for r, _ in s)
    return [(f"{len(sessions)} sessions", turns, run)], described, longest


def _write(args: argparse.Namespace, report: dict[str, Any], runs: dict[str, list[RunResult]]) -> None:
    print(f"goodput: TTFT <= {args.slo.ttft_s:g} s and TPOT <= {1e3 * args.slo.tpot_s:g} ms")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"report: {args.json}")
    if args.plots is not None:
        for path in write_plots(runs, args.plots):
            print(f"plot: {path}")


def _report(
    args: argparse.Namespace, measured: dict[str, tuple[Served, list[RunResult]]], workload: str
) -> dict[str, Any]:
    from cluster.cli import version_line

    systems = {
        name: {
            "model": {
                "id": served.model,
                "max_model_len": served.max_model_len,
                "block_size": served.block_size,
            },
            "replicas": list(served.replicas),
            "results": [r.as_dict() for r in results],
        }
        for name, (served, results) in measured.items()
    }
    report: dict[str, Any] = {
        "mode": args.mode,
        "arrival": str(args.arrival),
        "workload": workload,
        "slo": {"ttft_s": args.slo.ttft_s, "tpot_s": args.slo.tpot_s},
        "versions": version_line(),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "cpu": _cpu_model(),
        },
    }
    topology = args.topology or (LOCAL_TOPOLOGY if args.side_by_side else None)
    if topology is not None:
        report["topology"] = {"file": str(topology), "content": yaml.safe_load(topology.read_text())}
    if args.side_by_side:
        return {**report, "systems": systems}
    (only,) = systems.values()
    return {**report, "target": args.target, **only}


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), ""
    )
