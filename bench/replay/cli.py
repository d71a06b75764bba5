"""`pdserve replay` / `python -m bench.replay`: replay a real trace through every routing policy.

Example (the issue's Claude Code setting):
    python -m bench.replay --trace claude-code --replicas 8 --cache-frac 0.02 --target-util 0.6 --json cc.json

Cluster: `--replicas` prefill replicas (the pool whose caches and load the targets are about) and
`--decode-replicas` decode replicas (default: as many), every replica what the topology's
`router.service_time` says (default: one 8x H200 node serving DeepSeek-V3). pdserve routes with the
topology's `router` section (`--topology FILE`, the file `pdserve up` and `pdserve apply` take).
Per-replica cache capacity, prefill and decode alike, is `--cache-frac` x the slice's unique blocks.
`--routers N` puts N routers in front (the topology's `server.routers`), each request to one drawn at random,
each router with its own policy state and load accounting, reporting its load to the others every
`--router-sync-s` seconds (bench/replay/sim.py); the load is set as for one router.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from bench.replay.bounds import belady_hit_ratio, pooled_lru_hit_ratio
from bench.replay.metrics import DEFAULT_SLO, PolicyResult, format_table
from bench.replay.policies import describe_pdserve, select
from bench.replay.runner import replay_policy, set_load
from bench.replay.sim import RequestRecord, SimConfig
from bench.replay.traces import (
    DEFAULT_TRACES_DIR,
    Trace,
    infinite_cache_hit_ratio,
    load_trace,
    trace_files,
)
from bench.slo import Slo
from cluster.topology import Topology, TopologyError
from cluster.topology_file import load_topology


class ReplayReport(msgspec.Struct, kw_only=True):
    trace: str
    slice: str
    block_tokens: int
    unique_blocks: int
    capacity_blocks: int
    bound: float
    config: SimConfig
    results: list[PolicyResult]


def _number(
    kind: type[int] | type[float], *, low: float, low_open: bool = False, high: float | None = None
) -> Callable[[str], int | float]:
    """An argparse type: a number of `kind` at least `low` (above it with `low_open`), at most `high`."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if value < low or (low_open and value == low) or (high is not None and value > high):
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            if high is not None:
                bound += f" and <= {high:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


_COUNT = _number(int, low=1)
_COUNT0 = _number(int, low=0)
_POSITIVE = _number(float, low=0, low_open=True)
_NON_NEGATIVE = _number(float, low=0)
_FRACTION = _number(float, low=0, low_open=True, high=1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", choices=["claude-code", "mooncake", "azure"], required=True)
    p.add_argument("--traces-dir", type=Path, default=DEFAULT_TRACES_DIR)
    p.add_argument("--replicas", type=_COUNT0, default=8, help="prefill replicas (default 8)")
    p.add_argument(
        "--decode-replicas", type=_COUNT, default=None, help="decode replicas (default: --replicas)"
    )
    p.add_argument(
        "--cache-frac", type=_FRACTION, default=0.02, help="per-replica capacity / slice unique blocks"
    )
    p.add_argument("--block-tokens", type=_COUNT, default=512, help="router/engine block size in tokens")
    p.add_argument(
        "--sessions", type=_COUNT, default=None, help="claude-code: sessions in the slice (default all)"
    )
    p.add_argument(
        "--requests", type=_COUNT, default=None, help="open-loop traces: first N requests (default all)"
    )
    p.add_argument("--seed", type=int, default=0, help="session sample and order, start stagger")
    p.add_argument(
        "--target-util", type=_FRACTION, default=0.6, help="prefill utilisation the load is set for"
    )
    p.add_argument(
        "--reference-policy",
        default="least_loaded",
        help="policy the pilot runs set the load with (default least_loaded: neutral, no cache awareness; "
        "every policy then runs at the same offered load)",
    )
    p.add_argument("--pilot-rounds", type=_COUNT0, default=4, help="pilot runs correcting the analytic load")
    p.add_argument("--concurrency", type=_COUNT, default=None, help="claude-code: fix sessions in flight")
    p.add_argument("--time-scale", type=_POSITIVE, default=None, help="open-loop traces: fix the speed-up")
    p.add_argument("--gap-scale", type=_NON_NEGATIVE, default=1.0, help="multiplies every tool/think gap")
    p.add_argument("--max-gap-s", type=_NON_NEGATIVE, default=300.0, help="caps every tool/think gap (s)")
    p.add_argument("--policies", default="all", help="'all' or comma-separated names")
    p.add_argument(
        "--routers",
        type=_COUNT,
        default=1,
        help="routers in front of the cluster (server.routers; default 1): each request (every turn of a "
        "session) reaches one drawn at random, which decides it with its own policy state (sessions, recent "
        "work) and load accounting; the load is set as for one router, so runs compare at the same load",
    )
    p.add_argument(
        "--router-sync-s",
        type=_POSITIVE,
        default=1.0,
        help="with --routers > 1: seconds between the routers' load reports; each adds the others' work in "
        "flight as of the last report (default 1, the registry's poll)",
    )
    p.add_argument(
        "--topology",
        type=Path,
        default=None,
        help="a topology file: pdserve's router section (routing settings, service_time) and pools' "
        "kv_readback_ttl_s (readback, for every policy) come from it (default: the defaults)",
    )
    p.add_argument(
        "--bounds",
        action="store_true",
        help="also print the hit-ratio ceilings of pooled caches (bench.replay.bounds; ~10-30 s)",
    )
    p.add_argument(
        "--slo",
        type=_slo,
        default=None,
        help="what goodput counts, e.g. ttft=5,tpot=0.05 (seconds; default the topology's "
        "router.ttft_slo_ms and router.tpot_slo_ms)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the full report here")
    p.add_argument(
        "--records",
        type=Path,
        default=None,
        help="write every request's record here, by policy (JSON: arrival, prefill start/end, first token, "
        "replicas, cached/computed tokens, the router that decided it): which requests make a tail",
    )
    return p


def _slo(text: str) -> dict[str, float]:
    try:
        return Slo.given(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    topo = Topology()
    if args.topology is not None:
        try:
            topo = load_topology(args.topology)
        except (OSError, TopologyError) as e:
            parser.error(f"argument --topology: {e}")
    router = topo.router
    try:
        policies = select(args.policies, router)
    except ValueError as e:
        parser.error(f"argument --policies: {e}")
    limit = args.sessions if args.trace == "claude-code" else args.requests
    try:
        trace = load_trace(
            args.trace, args.traces_dir, block_tokens=args.block_tokens, limit=limit, seed=args.seed
        )
    except FileNotFoundError as e:
        # A missing file (OS error: errno text and path) or a trace folder without sessions (the message).
        parser.error(f"argument --traces-dir: {f'{e.strerror}: {e.filename}' if e.filename else e}")
    unique = trace.unique_blocks()
    capacity = max(1, int(args.cache_frac * unique))
    bound = infinite_cache_hit_ratio(trace)
    what = "sessions" if trace.closed_loop else "requests"
    slice_desc = f"{len(trace.sessions) if trace.closed_loop else trace.num_requests()} {what}"
    print(f"data: {trace_files(trace.name, args.traces_dir)}", flush=True)
    print(
        f"trace {trace.name}: {slice_desc}, {trace.num_requests()} requests, "
        f"block {trace.block_tokens} tokens, {unique} unique blocks, capacity {capacity} blocks/replica, "
        f"infinite-cache bound {bound:.4f}",
        flush=True,
    )
    pooled = None
    if args.bounds:
        pooled = _print_bounds(trace, capacity, args.replicas, args.decode_replicas or args.replicas, bound)
    default = msgspec.structs.replace(
        DEFAULT_SLO, ttft_s=router.ttft_slo_ms / 1e3, tpot_s=router.tpot_slo_ms / 1e3
    )
    slo = msgspec.structs.replace(default, **(args.slo or {}))
    cfg = SimConfig(
        prefill_replicas=args.replicas,
        decode_replicas=args.decode_replicas or args.replicas,
        capacity_blocks=capacity,
        gap_scale=args.gap_scale,
        max_gap_s=args.max_gap_s,
        seed=args.seed,
        timing=router.service_time.timing(),
        readback_ttl_s=float(topo.pools.kv_readback_ttl_s) or None,
        readback_exports=router.kv_readback_exports,
        routers=args.routers,
        router_sync_s=args.router_sync_s,
    )
    fixed = args.concurrency if trace.closed_loop else args.time_scale
    if fixed is not None:
        cfg = msgspec.structs.replace(cfg, **{"concurrency" if trace.closed_loop else "time_scale": fixed})
    else:
        ref = select(args.reference_policy, router)
        cfg = set_load(
            trace,
            cfg,
            args.target_util,
            reference=next(iter(ref.items())),
            pilot_rounds=args.pilot_rounds,
            log=lambda m: print(m, flush=True),
        )
    knob = f"concurrency {cfg.concurrency}" if trace.closed_loop else f"time scale {cfg.time_scale:.3f}"
    print(f"load: {knob}", flush=True)
    print(f"service time: {router.service_time.describe()}", flush=True)
    if cfg.routers > 1:
        print(
            f"routers: {cfg.routers}, each request to one at random, "
            f"load reports every {cfg.router_sync_s:g} s",
            flush=True,
        )
    if "pdserve" in policies:
        readback = "off" if cfg.readback_ttl_s is None else f"{cfg.readback_ttl_s:g} s"
        if cfg.readback_ttl_s is not None:
            readback += ", exports " + ("on" if cfg.readback_exports else "off")
        pdserve = describe_pdserve(router)
        print(f"{pdserve}; readback {readback}", flush=True)
    results = []
    records: dict[str, list[RequestRecord]] = {}
    for name, factory in policies.items():
        r, records[name] = replay_policy(trace, name, factory, cfg, bound, slo=slo, pooled=pooled)
        results.append(r)
        print(
            f"  {name}: hit/bound {r.hit_vs_bound:.3f} max/mean {r.load_max_over_mean:.3f} "
            f"(window {r.load_max_over_mean_window:.3f}, busy {r.busy_max_over_mean:.3f}) "
            f"util {r.prefill_util:.2f} ttft p99 {r.ttft_p99_s:.2f}s ({r.wall_s:.1f}s)",
            flush=True,
        )
    print(f"goodput: TTFT <= {slo.ttft_s:g} s and TPOT <= {1e3 * slo.tpot_s:g} ms", flush=True)
    print(format_table(results))
    if args.json is not None:
        report = ReplayReport(
            trace=trace.name,
            slice=slice_desc,
            block_tokens=trace.block_tokens,
            unique_blocks=unique,
            capacity_blocks=capacity,
            bound=bound,
            config=cfg,
            results=results,
        )
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    if args.records is not None:
        args.records.write_bytes(msgspec.json.encode(records))
    return 0


def _print_bounds(trace: Trace, capacity: int, prefill: int, decode: int, bound: float) -> float:
    """Print the pooled ceilings; returns the prefill caches' pooled LRU ceiling (the `hit/pool` column)."""
    ceilings = []
    for what, n in (("the prefill caches", prefill), ("all caches", prefill + decode)):
        lru = pooled_lru_hit_ratio(trace, capacity * n)
        opt = belady_hit_ratio(trace, capacity * n)
        print(
            f"ceiling with {what} pooled ({n} x {capacity} blocks): LRU {lru:.4f} ({lru / bound:.3f} of the "
            f"bound), optimal replacement {opt:.4f} ({opt / bound:.3f})",
            flush=True,
        )
        ceilings.append(lru)
    return ceilings[0]


if __name__ == "__main__":
    sys.exit(main())
