"""`pdserve plan`: the cheapest P/D topology that meets the SLOs on a workload, by the replay.

    pdserve plan --trace claude-code --concurrency 64 -f deploy/h200-kimi-k2.yaml -o planned.yaml
    pdserve plan --trace mooncake --time-scale 2 --slo ttft=2,tpot=0.05 --attainment 0.95 -o planned.yaml

In: a workload (a bundled trace: Claude Code sessions with `--concurrency` of them in flight, or Mooncake's
requests at `--time-scale` times their recorded rate), the SLOs (default the topology's `router.ttft_slo_ms`
and `router.tpot_slo_ms`) and the share of requests that must meet both (`--attainment`), and from the
topology `-f`: the hardware and model (`router.service_time`), each pool's replica shape and the routing.

Out: that topology with the prefill and decode replica counts of the fewest GPUs (CPUs for CPU pools) whose
replay meets the SLOs, the inventory's node counts sized to hold them, and in its header the replay's TTFT and
TPOT percentiles and goodput, with the best aggregated deployment (no prefill pool) beside it. The file is
validated as `pdserve apply` would. The replay models every replica as `router.service_time` says (its
`gpus_per_replica`); the replica counts are searched on a staircase, assuming more replicas never hurt.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

from bench.replay.metrics import PolicyResult
from bench.replay.policies import select
from bench.replay.runner import replay_policy
from bench.replay.sim import SimConfig
from bench.replay.traces import DEFAULT_TRACES_DIR, Trace, infinite_cache_hit_ratio, load_trace
from bench.slo import Slo
from cluster.topology import Pool, Topology, TopologyError, selector_matches
from cluster.topology_file import load_topology, parse_topology
from router.service_time import ServiceTimeModel

DEFAULT_ATTAINMENT = 0.9
CACHE_FRAC = 0.02  # a measured engine's cache, as a share of the slice's unique blocks (`pdserve replay`)


@dataclass(frozen=True)
class Outcome:
    prefill: int
    decode: int
    cost: float
    result: PolicyResult

    def meets(self, attainment: float) -> bool:
        return self.result.goodput_share >= attainment


def cheapest_pd(
    meets: Callable[[int, int], bool], max_prefill: int, max_decode: int, cost: Callable[[int, int], float]
) -> tuple[int, int] | None:
    """The cheapest (prefill, decode) with `meets`, assuming more of either never hurts: a staircase down the
    frontier (for each prefill count, the fewest decode replicas that meet), at most 2 x max_prefill +
    max_decode calls. None if even the largest pair misses."""
    if not meets(max_prefill, max_decode):
        return None
    best: tuple[int, int] | None = None
    d = max_decode
    for p in range(1, max_prefill + 1):
        # Once one prefill count meets with d decode replicas, every larger one does: only the first asks.
        if best is None and not meets(p, d):
            continue  # too few prefill replicas for any decode count
        while d > 1 and meets(p, d - 1):
            d -= 1
        if best is None or cost(p, d) < cost(*best):
            best = (p, d)
    return best


def fewest(meets: Callable[[int], bool], most: int) -> int | None:
    """The smallest n in 1..most with `meets(n)` (binary search, assuming more never hurts); None if none."""
    if not meets(most):
        return None
    low, high = 1, most
    while low < high:
        mid = (low + high) // 2
        if meets(mid):
            high = mid
        else:
            low = mid + 1
    return low


class Planner:
    """Replays the workload on (prefill, decode) replica counts, each once."""

    def __init__(
        self, trace: Trace, topo: Topology, slo: Slo, load: dict[str, Any], attainment: float
    ) -> None:
        self.trace, self.topo, self.slo, self.attainment = trace, topo, slo, attainment
        router = topo.router
        (self.factory,) = select("pdserve", router).values()
        self.bound = infinite_cache_hit_ratio(trace)
        timing = router.service_time.timing()
        if isinstance(timing, ServiceTimeModel) and timing.kv_capacity_tokens() >= trace.block_tokens:
            capacity = int(timing.kv_capacity_tokens() // trace.block_tokens)  # a replica's KV, in blocks
        else:
            capacity = max(1, int(CACHE_FRAC * trace.unique_blocks()))
        self.base = SimConfig(
            capacity_blocks=capacity,
            timing=timing,
            readback_ttl_s=float(topo.pools.kv_readback_ttl_s) or None,
            readback_exports=router.kv_readback_exports,
            **load,
        )
        self.runs: dict[tuple[int, int], Outcome] = {}

    def cost(self, prefill: int, decode: int) -> float:
        return prefill * _replica_cost(self.topo.pools.prefill) + decode * _replica_cost(
            self.topo.pools.decode
        )

    def outcome(self, prefill: int, decode: int) -> Outcome:
        if (prefill, decode) not in self.runs:
            cfg = msgspec.structs.replace(self.base, prefill_replicas=prefill, decode_replicas=decode)
            result, _ = replay_policy(self.trace, "pdserve", self.factory, cfg, self.bound, slo=self.slo)
            self.runs[prefill, decode] = Outcome(prefill, decode, self.cost(prefill, decode), result)
            print(
                f"  {prefill} prefill + {decode} decode: goodput {result.goodput_share:.3f}, TTFT p99 "
                f"{result.ttft_p99_s:.2f} s, TPOT p99 {1e3 * result.tpot_p99_s:.1f} ms",
                flush=True,
            )
        return self.runs[prefill, decode]

    def meets(self, prefill: int, decode: int) -> bool:
        return self.outcome(prefill, decode).meets(self.attainment)


def _replica_cost(pool: Pool) -> float:
    """What a replica costs: its GPUs, or for a CPU engine its CPUs."""
    return float(pool.gpus_per_replica) if pool.uses_gpus else pool.cpus_per_replica


def planned_topology(base: dict[str, Any], topo: Topology, prefill: int, decode: int) -> dict[str, Any]:
    """`base` (the topology file's content) with the replica counts, and its inventory's node groups sized to
    hold them: each GPU pool's replicas on the first group its labels select."""
    out = yaml.safe_load(yaml.safe_dump(base))  # a deep copy
    pools = out.setdefault("pools", {})
    pools.setdefault("prefill", {})["replicas"] = prefill
    pools.setdefault("decode", {})["replicas"] = decode
    if topo.nodes is None:
        return out
    needed: dict[str, int] = {}
    for role, replicas in (("prefill", prefill), ("decode", decode)):
        pool: Pool = getattr(topo.pools, role)
        if not pool.uses_gpus or replicas == 0:
            continue
        group = next(
            (
                g
                for g in topo.nodes
                if selector_matches(pool.node_labels, g.labels) and g.gpus >= pool.node_gpus
            ),
            None,
        )
        if group is None:
            continue  # validation names the field at fault
        per_node = max(1, int(group.gpus // pool.node_gpus)) if pool.nodes_per_replica == 1 else 1
        needed[group.name] = needed.get(group.name, 0) + math.ceil(
            replicas * pool.nodes_per_replica / per_node
        )
    for group in out.get("nodes", []):
        if group["name"] in needed:
            group["count"] = needed[group["name"]]
    return out


def header(args: argparse.Namespace, slo: Slo, pd: Outcome, aggregated: Outcome | None) -> str:
    """The planned file's first lines: what it was planned for, and what the replay predicts."""

    def predicted(o: Outcome) -> str:
        r = o.result
        return (
            f"  TTFT p50 {r.ttft_p50_s:.2f} s, p99 {r.ttft_p99_s:.2f} s; TPOT p50"
            f" {1e3 * r.tpot_p50_s:.1f} ms, p99 {1e3 * r.tpot_p99_s:.1f} ms;"
            f" {r.goodput_share:.1%} of requests within the SLOs"
        )

    load = (
        f"{args.concurrency} sessions in flight" if args.trace == "claude-code" else f"x{args.time_scale:g}"
    )
    lines = [
        f"pdserve topology planned by `pdserve plan` from {args.file}",
        f"workload: the {args.trace} trace, {load}",
        f"SLOs: TTFT <= {slo.ttft_s:g} s and TPOT <= {1e3 * slo.tpot_s:g} ms, for {args.attainment:.0%}"
        " of requests",
        f"plan: {pd.prefill} prefill + {pd.decode} decode replicas (cost {pd.cost:g}); the replay predicts:",
        predicted(pd),
    ]
    if aggregated is not None:
        lines += [
            f"best aggregated: {aggregated.decode} decode replicas (cost {aggregated.cost:g}):",
            predicted(aggregated),
        ]
    else:
        lines.append(f"aggregated (no prefill pool): up to {2 * args.max_replicas} replicas miss the SLOs")
    return "".join(f"# {text}\n" for text in lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve plan", description=__doc__.split("\n\n")[0])
    p.add_argument("-f", "--file", type=Path, required=True, help="the topology to plan from")
    p.add_argument("-o", "--out", type=Path, required=True, help="where the planned topology goes")
    p.add_argument("--trace", choices=["claude-code", "mooncake", "azure"], required=True)
    p.add_argument("--traces-dir", type=Path, default=DEFAULT_TRACES_DIR)
    p.add_argument("--concurrency", type=int, default=None, help="claude-code: sessions in flight")
    p.add_argument("--time-scale", type=float, default=None, help="mooncake, azure: times the recorded rate")
    p.add_argument("--sessions", type=int, default=None, help="claude-code: sessions replayed (default all)")
    p.add_argument(
        "--requests", type=int, default=None, help="open-loop traces: first N requests (default all)"
    )
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--slo", default=None, help="e.g. ttft=5,tpot=0.05 (seconds; default the topology's)")
    p.add_argument("--attainment", type=float, default=DEFAULT_ATTAINMENT, help="share within the SLOs")
    p.add_argument("--max-replicas", type=int, default=16, help="per pool searched (aggregated: twice)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        topo = load_topology(args.file)
        base = yaml.safe_load(args.file.read_text())
    except (OSError, TopologyError) as exc:
        parser.error(f"argument -f/--file: {exc}")
    load = _load(parser, args)
    if not 0 < args.attainment <= 1:
        parser.error(f"argument --attainment: a share in (0, 1], got {args.attainment}")
    if args.max_replicas < 1:
        parser.error(f"argument --max-replicas: must be >= 1, got {args.max_replicas}")
    slo = Slo(ttft_s=topo.router.ttft_slo_ms / 1e3, tpot_s=topo.router.tpot_slo_ms / 1e3)
    if args.slo is not None:
        try:
            slo = msgspec.structs.replace(slo, **Slo.given(args.slo))
        except ValueError as exc:
            parser.error(f"argument --slo: {exc}")
    limit = args.sessions if args.trace == "claude-code" else args.requests
    try:
        trace = load_trace(args.trace, args.traces_dir, block_tokens=args.block_tokens, limit=limit, seed=0)
    except FileNotFoundError as exc:
        parser.error(f"argument --traces-dir: {exc}")
    planner = Planner(trace, topo, slo, load, args.attainment)
    print(
        f"planning on {trace.num_requests()} requests of {args.trace}; {topo.router.service_time.describe()}"
    )
    most = args.max_replicas
    found = cheapest_pd(planner.meets, most, most, planner.cost)
    if found is None:
        print(
            f"pdserve plan: even {most} prefill + {most} decode replicas miss the SLOs on "
            f"{args.attainment:.0%} of requests: raise --max-replicas, or relax --slo / --attainment",
            file=sys.stderr,
        )
        return 1
    pd = planner.outcome(*found)
    n = fewest(lambda d: planner.meets(0, d), 2 * most)
    aggregated = None if n is None else planner.outcome(0, n)
    planned = planned_topology(base, topo, *found)
    text = header(args, slo, pd, aggregated) + yaml.safe_dump(planned, sort_keys=False)
    try:
        parse_topology(text, str(args.out))
    except TopologyError as exc:
        print(f"pdserve plan: the planned topology does not validate: {exc}", file=sys.stderr)
        return 1
    args.out.write_text(text)
    print(header(args, slo, pd, aggregated), end="")
    print(f"written: {args.out} ({len(planner.runs)} replays)")
    return 0


def _load(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    if args.trace == "claude-code":
        if args.concurrency is None or args.concurrency < 1 or args.time_scale is not None:
            parser.error(
                "--trace claude-code: give --concurrency N (sessions in flight, >= 1), not --time-scale"
            )
        return {"concurrency": args.concurrency}
    if args.time_scale is None or args.time_scale <= 0 or args.concurrency is not None:
        parser.error(
            f"--trace {args.trace}: give --time-scale X (> 0, times the recorded rate), not --concurrency"
        )
    return {"time_scale": args.time_scale}


if __name__ == "__main__":
    sys.exit(main())
