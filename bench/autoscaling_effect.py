"""`python -m bench.autoscaling_effect`: fixed replica counts against the pools' autoscaling, by the replay of
the Azure conversation trace (an hour of a real chat service's arrivals) or of Claude Code sessions arriving
in a burst, on a topology's hardware and model.

Each deployment replays the same requests with pdserve's routing: the fixed one at `--prefill`/`--decode`
replicas throughout; the autoscaled ones start there, and the policy Serve's controller runs
(cluster/autoscaling.py, the topology's `pools.*.autoscaling`, or its defaults up to twice the fixed counts)
decides every two seconds on the simulated replicas' loads; a replica it starts takes `--start-s` before its
first request. Side by side: the share of requests within the SLO (TTFT and TPOT), goodput, replica-hours and
GPU-hours, and the replica counts the autoscaler went through; once per warm buffer (`--warm`).

The trace's hour is kept: `--copies N` plays it N times at once (copies shifted within a minute) to bring its
rate to what a cluster of such replicas serves (bench/replay/traces.py `load_azure`). `--trace claude-code`
replays agent sessions instead, starting at `--sessions-per-min` with five times that for ten minutes after
the first ten (`bursty_starts`); the per-minute oracle is then not printed (turns arrive as replies end).

    python -m bench.autoscaling_effect [-f deploy/h200-kimi-k2.yaml] [--copies 16] [--prefill 4 --decode 2]
        [--start-s 180] [--warm 0,1] [--json FILE]
    python -m bench.autoscaling_effect --trace claude-code --requests 60 --sessions-per-min 0.5 \
        --prefill 4 --decode 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

from bench.plan import Planner
from bench.replay.autoscaler import PoolScaling
from bench.replay.runner import replay_policy
from bench.replay.traces import AZURE_FILE, DEFAULT_TRACES_DIR, Trace, load_azure, load_trace
from bench.slo import Slo
from cluster.autoscaling import scale_targets
from cluster.topology import Autoscaling, Topology
from cluster.topology_file import load_topology

H200_EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "h200-kimi-k2.yaml"
TICK_S = 2.0  # the replicas' metrics push at a 10 s window (cluster/autoscaling.py: window / 5)
# The Claude Code arrival pattern: sessions start at a steady rate, five times it for ten minutes.
BURST_FACTOR = 5
QUIET_S, BURST_S = 600.0, 600.0


@dataclass(frozen=True)
class Row:
    deployment: str
    slo_share: float
    goodput_rps: float
    ttft_p99_s: float
    tpot_p99_s: float
    prefill_replica_h: float
    decode_replica_h: float
    gpu_h: float
    prefill_counts: str  # the fixed count, or the autoscaled pool's start and peak
    decode_counts: str


def pool_scaling(topo: Topology, role: str, fixed: int, warm: int, start_s: float) -> PoolScaling:
    """The pool's autoscaling as the topology sets it (its warm buffer replaced by `warm`), or the
    defaults from 1 to twice the fixed count."""
    pool = getattr(topo.pools, role)
    scaling = pool.autoscaling or Autoscaling(max_replicas=2 * fixed)
    scaling = msgspec.structs.replace(scaling, warm_replicas=warm)
    pools = msgspec.structs.replace(
        topo.pools, **{role: msgspec.structs.replace(pool, replicas=fixed, autoscaling=scaling)}
    )
    targets = scale_targets(msgspec.structs.replace(topo, pools=pools), role)  # type: ignore[arg-type]
    return PoolScaling(
        role=role,
        targets=targets,
        min_replicas=scaling.min_replicas,
        max_replicas=scaling.max_replicas,
        window_s=scaling.window_s,
        start_s=start_s,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-f", "--topology", type=Path, default=H200_EXAMPLE)
    p.add_argument("--trace", choices=["azure", "claude-code"], default="azure")
    p.add_argument("--copies", type=int, default=16, help="azure: the trace played this many times at once")
    p.add_argument(
        "--sessions-per-min",
        type=float,
        default=4.0,
        help="claude-code: sessions starting a minute, outside the burst",
    )
    p.add_argument(
        "--requests", type=int, default=None, help="first N requests (azure) or sessions (claude-code)"
    )
    p.add_argument("--prefill", type=int, default=4, help="the fixed deployment's prefill replicas")
    p.add_argument("--decode", type=int, default=2, help="the fixed deployment's decode replicas")
    p.add_argument("--start-s", type=float, default=180.0, help="a replica's start, to its first request")
    p.add_argument("--warm", default="0,1", help="warm buffers to replay, comma-separated")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    topo = load_topology(args.topology)
    if args.trace == "azure":
        trace = load_azure(DEFAULT_TRACES_DIR / AZURE_FILE, copies=args.copies, max_requests=args.requests)
        about = f"Azure conversation trace x{args.copies} ({trace.num_requests()} requests over an hour)"
    else:
        trace = load_trace("claude-code", limit=args.requests)
        starts = bursty_starts(len(trace.sessions), args.sessions_per_min / 60, seed=0)
        trace = dataclasses.replace(trace, session_starts=tuple(starts))
        about = (
            f"{len(trace.sessions)} Claude Code sessions starting at {args.sessions_per_min:g} a minute, "
            f"{BURST_FACTOR}x for {BURST_S / 60:g} minutes after the first {QUIET_S / 60:g}"
        )
    slo = Slo(ttft_s=topo.router.ttft_slo_ms / 1e3, tpot_s=topo.router.tpot_slo_ms / 1e3)
    planner = Planner(trace, topo, slo, {"time_scale": 1.0}, 0.0)
    cfg = msgspec.structs.replace(planner.base, prefill_replicas=args.prefill, decode_replicas=args.decode)
    gpus = {role: float(pool.gpus_per_replica) for role, pool in topo.pools.items()}
    print(
        f"{about}, "
        f"{args.topology.name}; SLO TTFT {slo.ttft_s:g} s, TPOT {1e3 * slo.tpot_s:g} ms; a replica starts in "
        f"{args.start_s:g} s",
        flush=True,
    )
    runs: list[tuple[str, list[PoolScaling]]] = [(f"fixed {args.prefill}P + {args.decode}D", [])]
    for warm in (int(w) for w in args.warm.split(",")):
        pools = [
            pool_scaling(topo, "prefill", args.prefill, warm, args.start_s),
            pool_scaling(topo, "decode", args.decode, warm, args.start_s),
        ]
        runs.append((f"autoscaled, warm {warm}", pools))
    rows = []
    for name, pools in runs:
        result, _ = replay_policy(
            trace, name, planner.factory, cfg, planner.bound, slo=slo, autoscaling=pools, tick_s=TICK_S
        )
        first = {"prefill": args.prefill, "decode": args.decode}
        peak = {"prefill": result.prefill_replicas_peak, "decode": result.decode_replicas_peak}
        counts = {
            role: f"{first[role]}, peak {peak[role]}" if pools else str(first[role])
            for role in ("prefill", "decode")
        }
        row = Row(
            deployment=name,
            slo_share=result.goodput_share,
            goodput_rps=result.goodput_rps,
            ttft_p99_s=result.ttft_p99_s,
            tpot_p99_s=result.tpot_p99_s,
            prefill_replica_h=result.prefill_replica_s / 3600,
            decode_replica_h=result.decode_replica_s / 3600,
            gpu_h=(result.prefill_replica_s * gpus["prefill"] + result.decode_replica_s * gpus["decode"])
            / 3600,
            prefill_counts=counts["prefill"],
            decode_counts=counts["decode"],
        )
        rows.append(row)
        print(f"  {name}: done in {result.wall_s:.0f} s", flush=True)
    print(format_rows(rows))
    fixed = {"prefill": args.prefill, "decode": args.decode}
    # Open loop only: a closed-loop session's turns arrive when its replies end, not at recorded times.
    bound = {} if trace.closed_loop else {role: per_minute_bound(trace, n, role) for role, n in fixed.items()}
    if bound:
        weighted = bound["prefill"] * args.prefill + bound["decode"] * args.decode
        total = weighted / (args.prefill + args.decode)
        print(
            f"A per-minute oracle (each minute the fixed count x that minute's work / the busiest minute's,"
            f" rounded up, started instantly; prefill's work its prompt tokens, decode's the tokens it"
            f" generates) would run {bound['prefill']:.2f}x the fixed prefill and {bound['decode']:.2f}x the"
            f" fixed decode replica-hours, {total:.2f}x in all."
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "oracle": bound}, indent=2))
    return 0


def bursty_starts(n: int, rate_per_s: float, *, seed: int) -> list[float]:
    """`n` session starts: a Poisson process at `rate_per_s`, BURST_FACTOR times it for BURST_S after
    QUIET_S."""
    rng = random.Random(seed)
    t, out = 0.0, list[float]()
    while len(out) < n:
        burst = QUIET_S <= t < QUIET_S + BURST_S
        t += rng.expovariate(rate_per_s * (BURST_FACTOR if burst else 1))
        out.append(t)
    return out


def per_minute_bound(trace: Trace, fixed: int, role: str) -> float:
    """The replica-hours of scaling each minute to its work, as a share of `fixed` replicas' (a floor for any
    autoscaler whose replicas serve as the fixed ones do at the busiest minute). A pool's work is its own:
    the prompt tokens arriving for prefill, the tokens to generate for decode. On the Azure hour they do not
    move together (its busiest minutes bring long prompts and short replies), so counting arrivals would
    misstate both pools."""
    work = Counter[int]()
    for r in trace.requests():
        work[int(r.arrival_s // 60)] += r.num_prompt_tokens if role == "prefill" else r.num_output_tokens
    peak = max(work.values())
    counts = [work.get(m, 0) for m in range(max(work) + 1)]
    return sum(math.ceil(fixed * c / peak) for c in counts) / (fixed * len(counts))


def format_rows(rows: list[Row]) -> str:
    base = rows[0]
    head = (
        "| deployment | within SLO | goodput req/s | TTFT p99 | TPOT p99 | prefill replica-h"
        " | decode replica-h | GPU-h | vs fixed |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "".join(
        f"| {r.deployment} | {r.slo_share:.3f} | {r.goodput_rps:.1f} | {r.ttft_p99_s:.2f} s |"
        f" {1e3 * r.tpot_p99_s:.1f} ms | {r.prefill_replica_h:.2f} ({r.prefill_counts}) |"
        f" {r.decode_replica_h:.2f} ({r.decode_counts}) | {r.gpu_h:.0f} | {r.gpu_h / base.gpu_h:.2f}x |\n"
        for r in rows
    )


if __name__ == "__main__":
    sys.exit(main())
