"""The live benchmark's figures against the replay's (`python -m bench.replay_vs_live`): each figure's error,
and pdserve's ratio to a cache-blind policy both ways, over live rounds and replays on several timings."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.live.systems import _parts
from bench.replay.sim import RequestRecord
from bench.slo import percentile


@dataclass(frozen=True)
class Outcome:
    """One run's figures, live or replayed: latencies in seconds, shares in [0, 1]."""

    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    cached_share: float  # prompt tokens served from a cache
    decode_prefill_share: float  # requests prefilled on their decode replica (no prefill hop)
    requests: int

    @staticmethod
    def of_live(result: dict[str, Any]) -> Outcome:
        paths = result["paths"]
        return Outcome(
            ttft_p50=result["ttft_s"]["p50"],
            ttft_p99=result["ttft_s"]["p99"],
            tpot_p50=result["tpot_s"]["p50"],
            tpot_p99=result["tpot_s"]["p99"],
            cached_share=result["cached_share"],
            decode_prefill_share=paths.get("local_prefill", 0.0) + paths.get("decode_full_prefill", 0.0),
            requests=result["requests"],
        )

    @staticmethod
    def of_replay(records: Sequence[RequestRecord]) -> Outcome:
        ttft = [r.ttft for r in records]
        tpot = [t for t in (r.tpot for r in records) if t is not None]
        prompt = sum(r.cached_tokens + r.computed_tokens for r in records)
        return Outcome(
            ttft_p50=percentile(ttft, 50),
            ttft_p99=percentile(ttft, 99),
            tpot_p50=percentile(tpot, 50),
            tpot_p99=percentile(tpot, 99),
            cached_share=sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
            decode_prefill_share=sum(r.local_prefill for r in records) / len(records) if records else 0.0,
            requests=len(records),
        )


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; nan where nothing was measured."""
    return (predicted - measured) / measured if measured else math.nan


def ratios(outcomes: dict[str, Outcome], systems: Sequence[str]) -> list[tuple[str, str, str, float]]:
    """(system, baseline, metric, ratio) of pdserve's system to each cache-blind one on its topology."""
    out = []
    for s in systems:
        name, policy, _ = _parts(s)
        if policy is None or name not in systems:
            continue
        for metric in ("ttft_p50", "ttft_p99", "tpot_p50", "cached_share"):
            a, b = getattr(outcomes[name], metric), getattr(outcomes[s], metric)
            out.append((name, s, metric, a / b if b else math.nan))
    return out


def compare(
    live_rounds: dict[str, list[Outcome]], replay: dict[str, list[Outcome]], systems: Sequence[str]
) -> dict[str, Any]:
    """Every figure live (the median of the live rounds, with their range), replayed (the median of the
    replays on each timing, with their range) and the error of the one median against the other; pdserve's
    ratios to the baselines both ways (live: each round's ratio, the median of the rounds; replay: each
    timing's ratio, the median of the timings)."""
    rows = []
    for s in systems:
        rounds, timings = live_rounds[s], replay[s]
        for field in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "cached_share", "decode_prefill_share"):
            values = [getattr(o, field) for o in rounds]
            predicted = [getattr(o, field) for o in timings]
            a, b = statistics.median(values), statistics.median(predicted)
            error = b - a if field.endswith("share") else relative_error(b, a)
            row = {"system": s, "metric": field, "live": a, "replay": b, "error": error}
            rows.append(
                row
                | {"live_low": min(values), "live_high": max(values)}
                | {"replay_low": min(predicted), "replay_high": max(predicted)}
            )

    def per(outcomes: dict[str, list[Outcome]], n: int) -> dict[tuple[str, str, str], list[float]]:
        out: dict[tuple[str, str, str], list[float]] = {}
        for i in range(n):
            for a, b, m, r in ratios({s: o[min(i, len(o) - 1)] for s, o in outcomes.items()}, systems):
                out.setdefault((a, b, m), []).append(r)
        return out

    per_round = per(live_rounds, min(len(r) for r in live_rounds.values()))
    per_timing = per(replay, max(len(r) for r in replay.values()))
    ratio_rows = []
    for (a, b, m), predicted in per_timing.items():
        values = per_round[(a, b, m)]
        live, r = statistics.median(values), statistics.median(predicted)
        ratio_rows.append(
            {
                "system": a,
                "baseline": b,
                "metric": m,
                "live": live,
                "live_low": min(values),
                "live_high": max(values),
                "replay": r,
                "replay_low": min(predicted),
                "replay_high": max(predicted),
                "error": relative_error(r, live),
            }
        )
    return {
        "figures": rows,
        "ratios": ratio_rows,
        "rounds": min(len(r) for r in live_rounds.values()),
        "timings": max(len(r) for r in replay.values()),
    }


def format_comparison(result: dict[str, Any], replays: str = "timings") -> str:
    """`replays`: what the replays were run on, one each (several timings, or rounds and timings)."""
    several = result.get("rounds", 1) > 1
    timings = result.get("timings", 1) > 1
    live = f"live, median of {result['rounds']} rounds (range)" if several else "live"
    replay = f"replay, median of {result['timings']} {replays} (range)" if timings else "replay"
    lines = [f"{'system':<26} {'metric':<22} {live:>9} {replay:>9} {'error':>8}"]

    def shown(r: dict[str, Any], fmt: Any, side: str = "live", spread: bool = several) -> str:
        around = f" ({fmt(r[side + '_low']).strip()}-{fmt(r[side + '_high']).strip()})" if spread else ""
        return str(fmt(r[side])) + around

    for r in result["figures"]:
        share = r["metric"].endswith("share")
        fmt = (lambda v: f"{v:9.3f}") if share else (lambda v: f"{1e3 * v:7.1f}ms")
        err = f"{r['error']:+8.3f}" if share else f"{r['error']:+8.0%}"
        predicted = shown(r, fmt, "replay", timings)
        lines.append(f"{r['system']:<26} {r['metric']:<22} {shown(r, fmt)} {predicted} {err}")
    if result["ratios"]:
        lines.append("")
        lines.append(f"{'pdserve / baseline':<48} {live:>9} {replay:>9} {'error':>8}")
        for r in result["ratios"]:
            what = f"{r['system']} / {r['baseline']} {r['metric']}"

            def fmt(v: float) -> str:
                return f"{v:9.3f}"

            lines.append(f"{what:<48} {shown(r, fmt)} {shown(r, fmt, 'replay', timings)} {r['error']:+8.0%}")
    return "\n".join(lines)
