"""`python -m bench.speculation_effect`: what speculative decoding and an fp8 KV cache buy at H200 scale, by
the service-time model and the replay, on the H200 example (deploy/h200-kimi-k2.yaml: Kimi-K2 on 8xH200
replicas with EAGLE-3 and an fp8 KV cache) against the same with neither, and with the fp8 cache alone.

For each, from the model: the KV bytes a token (what NIXL moves), the tokens of KV a replica holds and the
agent sessions that is (at the Claude Code sessions' mean peak context), a 32k-token prompt's KV transfer,
the time per output token of one session and of as many as the replica holds, and that batch's tokens/s.
Then the replay of the Claude Code sessions with pdserve's routing, each variant's cache as large as its KV
capacity, all at the load that puts the example as deployed at 60% prefill utilisation: hits, TTFT, TPOT and
goodput side by side.

    python -m bench.speculation_effect [--topology deploy/h200-kimi-k2.yaml] [--sessions N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

from bench.replay.policies import select
from bench.replay.runner import replay_policy, set_load
from bench.replay.sim import SimConfig
from bench.replay.traces import DEFAULT_TRACES_DIR, Trace, infinite_cache_hit_ratio, load_trace
from bench.slo import Slo
from cluster.topology import Topology
from cluster.topology_file import load_topology
from router.service_time import ServiceTime, ServiceTimeModel

H200_EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "h200-kimi-k2.yaml"
PROMPT_TOKENS = 32_768
# KV cache dtypes of a byte an element (everything else in vLLM's names is taken as 2 bytes: bf16).
ONE_BYTE_KV = ("fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class Variant:
    name: str
    kv_bytes_per_token: float
    kv_capacity_tokens: float
    sessions_held: float
    transfer_32k_s: float
    tpot_one_s: float  # seconds per output token, one session decoding
    full_batch: int  # the sessions the replica's KV holds, decoding together
    tpot_full_s: float
    hit_vs_bound: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    tpot_p50_s: float = 0.0
    tpot_p99_s: float = 0.0
    goodput_share: float = 0.0


def variants(topo: Topology) -> dict[str, ServiceTime]:
    """The topology's service time as deployed, and without its speculation and fp8 KV cache (a bf16 one)."""
    deployed = topo.router.service_time
    if deployed.measured is not None:
        raise ValueError(
            "router.service_time.measured: this compares modelled hardware, not a measured engine"
        )
    shape = deployed.model
    bf16_bytes = shape.kv_bytes_per_token * (2 if topo.model.kv_cache_dtype in ONE_BYTE_KV else 1)
    bf16 = msgspec.structs.replace(
        deployed, speculation=None, model=msgspec.structs.replace(shape, kv_bytes_per_token=bf16_bytes)
    )
    out = {"bf16 KV, no speculation": bf16}
    fp8 = msgspec.structs.replace(
        bf16, model=msgspec.structs.replace(shape, kv_bytes_per_token=bf16_bytes / 2)
    )
    out["fp8 KV"] = fp8
    if deployed.speculation is not None:
        out[f"fp8 KV + speculation ({deployed.speculation.draft_tokens} drafts)"] = msgspec.structs.replace(
            fp8, speculation=deployed.speculation
        )
    return out


def session_peak_tokens(trace: Trace) -> float:
    """The mean over sessions of a session's longest prompt: the context a live session holds at its end."""
    return statistics.fmean(max(r.num_prompt_tokens for r in s.requests) for s in trace.sessions)


def modelled(name: str, service: ServiceTime, context: float) -> Variant:
    timing = service.timing()
    assert isinstance(timing, ServiceTimeModel)
    capacity = timing.kv_capacity_tokens()
    full = max(1, int(capacity // context))
    return Variant(
        name=name,
        kv_bytes_per_token=service.model.kv_bytes_per_token,
        kv_capacity_tokens=capacity,
        sessions_held=capacity / context,
        transfer_32k_s=timing.transfer_s(PROMPT_TOKENS),
        tpot_one_s=timing.tpot_s(1, int(context)),
        full_batch=full,
        tpot_full_s=timing.tpot_s(full, int(full * context)),
    )


def replayed(
    trace: Trace, services: dict[str, ServiceTime], topo: Topology, variants_: list[Variant], log: bool
) -> list[Variant]:
    """Each variant replayed with pdserve's routing, its cache its KV capacity, all at the load that puts the
    topology as deployed (the last variant) at 60% prefill utilisation."""
    router = topo.router
    (factory,) = select("pdserve", router).values()
    bound = infinite_cache_hit_ratio(trace)
    slo = Slo(ttft_s=router.ttft_slo_ms / 1e3, tpot_s=router.tpot_slo_ms / 1e3)

    def config(v: Variant) -> SimConfig:
        return SimConfig(
            prefill_replicas=8,
            decode_replicas=8,
            capacity_blocks=max(1, int(v.kv_capacity_tokens // trace.block_tokens)),
            timing=services[v.name].timing(),
        )

    load = set_load(
        trace,
        config(variants_[-1]),
        0.6,
        reference=("pdserve", factory),
        pilot_rounds=2,
        log=lambda m: print(m, flush=True) if log else None,
    )
    out = []
    for v in variants_:
        cfg = msgspec.structs.replace(config(v), concurrency=load.concurrency)
        r, _ = replay_policy(trace, "pdserve", factory, cfg, bound, slo=slo)
        out.append(
            Variant(
                **{
                    **asdict(v),
                    "hit_vs_bound": r.hit_vs_bound,
                    "ttft_p50_s": r.ttft_p50_s,
                    "ttft_p99_s": r.ttft_p99_s,
                    "tpot_p50_s": r.tpot_p50_s,
                    "tpot_p99_s": r.tpot_p99_s,
                    "goodput_share": r.goodput_share,
                }
            )
        )
    return out


def table(rows: list[Variant], context: float) -> str:
    head = (
        f"{'':<32}{'KV B/tok':>9}{'KV tokens':>11}{'sessions':>9}{'32k pull':>9}{'tpot 1':>9}"
        f"{'batch':>6}{'its tpot':>9}{'tok/s':>7}"
    )
    lines = [
        f"the model (a session holds {context / 1e3:.0f}k tokens: the Claude Code sessions' mean peak):",
        head,
    ]
    for v in rows:
        lines.append(
            f"{v.name:<32}{v.kv_bytes_per_token:>9.0f}{v.kv_capacity_tokens / 1e6:>10.2f}M"
            f"{v.sessions_held:>9.1f}{1e3 * v.transfer_32k_s:>7.0f}ms{1e3 * v.tpot_one_s:>7.1f}ms"
            f"{v.full_batch:>6}{1e3 * v.tpot_full_s:>7.1f}ms{v.full_batch / v.tpot_full_s:>7.0f}"
        )
    if any(v.ttft_p50_s for v in rows):
        lines += [
            "",
            "the replay (Claude Code sessions, pdserve's routing, 8 prefill + 8 decode replicas, each cache"
            " its KV capacity, one load):",
            f"{'':<32}{'hit/bound':>10}{'ttft p50':>10}{'ttft p99':>10}{'tpot p50':>10}{'tpot p99':>10}"
            f"{'good':>6}",
        ]
        for v in rows:
            lines.append(
                f"{v.name:<32}{v.hit_vs_bound:>10.3f}{v.ttft_p50_s:>9.2f}s{v.ttft_p99_s:>9.2f}s"
                f"{1e3 * v.tpot_p50_s:>8.1f}ms{1e3 * v.tpot_p99_s:>8.1f}ms{v.goodput_share:>6.2f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.speculation_effect", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--topology", type=Path, default=H200_EXAMPLE)
    p.add_argument("--traces-dir", type=Path, default=DEFAULT_TRACES_DIR)
    p.add_argument("--sessions", type=int, default=None, help="Claude Code sessions replayed (default all)")
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--no-replay", action="store_true", help="the model's table only (seconds, not minutes)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    topo = load_topology(args.topology)
    try:
        services = variants(topo)
    except ValueError as exc:
        p.error(str(exc))
    trace = load_trace(
        "claude-code", args.traces_dir, block_tokens=args.block_tokens, limit=args.sessions, seed=0
    )
    context = session_peak_tokens(trace)
    rows = [modelled(name, service, context) for name, service in services.items()]
    print(f"{args.topology}: {topo.router.service_time.describe()}", flush=True)
    if not args.no_replay:
        rows = replayed(trace, services, topo, rows, log=True)
    print(table(rows, context))
    if args.json is not None:
        args.json.write_text(json.dumps({"context_tokens": context, "variants": [asdict(v) for v in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
