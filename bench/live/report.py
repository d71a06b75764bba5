"""What a benchmark run reports: latency percentiles, throughput, goodput, cache hits and serving paths."""

from __future__ import annotations

import heapq
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from dataclasses import field as dataclass_field

from bench.live.runner import Timed
from bench.live.targets import EngineCounts
from bench.slo import Slo, percentile

# Goodput's SLO when `--slo` does not say.
DEFAULT_SLO = Slo(ttft_s=2.0, tpot_s=0.1)


@dataclass(frozen=True)
class RunResult:
    label: str  # e.g. "rate 4/s", "concurrency 1"
    offered_rate: float | None  # requests per second sent (open loop), None for closed loop
    requests: int
    failed: dict[str, int]  # gRPC status -> count, of requests that did not finish OK
    duration_s: float
    throughput_rps: float
    output_tokens_per_s: float
    ttft_s: dict[str, float]  # p50 / p95 / p99
    tpot_s: dict[str, float]
    itl_s: dict[str, float]
    e2e_s: dict[str, float]
    goodput_rps: float  # requests meeting the SLO's TTFT and TPOT together, per second
    goodput_share: float
    cached_share: float  # prompt tokens served from a cache (engine-reported)
    paths: dict[str, float]  # serving path -> share of requests
    # Every finished request's ttft_s / tpot_s / e2e_s (for CDFs; plots can be redrawn from the JSON).
    samples_s: dict[str, list[float]]
    # Speculative decoding on the decode engines (None without): the share of drafted tokens accepted, and
    # the tokens each engine step made (1 + accepted per draft).
    spec_acceptance: float | None = None
    spec_tokens_per_step: float | None = None
    # Bytes NIXL moved per prompt token whose KV it moved (None: no KV moved, or an OpenAI server).
    kv_bytes_per_token: float | None = None
    # Which round of a side-by-side with `--rounds` (the systems run again, in alternating order).
    round: int = 1
    # Where the server says which decode replica served each request (pdserve): the share of requests sent
    # while another still ran on their replica ("share"), and the TPOT p50 of those ("tpot_p50_beside")
    # against the rest's ("tpot_p50_alone"). A request joining another's batch pays for it on a small engine.
    beside: dict[str, float] | None = None
    # Every request, in the order sent (`request_rows`): to find where a tail came from, request by request.
    requests_sent: list[dict[str, object]] = dataclass_field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(
    label: str,
    offered: float | None,
    timed: Sequence[Timed],
    duration_s: float,
    slo: Slo,
    engines: tuple[EngineCounts | None, EngineCounts | None] = (None, None),
) -> RunResult:
    """`engines`: the decode engines' counters before and after the run, where the target reports them."""
    ok = [t for t in timed if t.ok]
    failed = Counter(t.status for t in timed if not t.ok)

    def pcts(values: list[float]) -> dict[str, float]:
        return {f"p{q}": percentile(values, q) for q in (50, 95, 99)}

    samples = {
        "ttft_s": [t.ttft for t in ok if t.ttft is not None],
        "tpot_s": [t.tpot for t in ok if t.tpot is not None],
        "e2e_s": [t.e2e for t in ok if t.e2e is not None],
    }
    good = [t for t in ok if (t.ttft or 0.0) <= slo.ttft_s and (t.tpot is None or t.tpot <= slo.tpot_s)]
    prompt = sum(t.prompt_tokens for t in ok)
    paths = Counter(t.path for t in ok)
    before, after = engines
    speculation = after.speculation_since(before) if before and after else None
    return RunResult(
        label=label,
        offered_rate=offered,
        requests=len(timed),
        failed=dict(failed),
        duration_s=duration_s,
        throughput_rps=len(ok) / duration_s if duration_s > 0 else math.nan,
        output_tokens_per_s=sum(t.completion_tokens for t in ok) / duration_s if duration_s > 0 else math.nan,
        ttft_s=pcts(samples["ttft_s"]),
        tpot_s=pcts(samples["tpot_s"]),
        itl_s=pcts([x for t in ok for x in t.itl()]),
        e2e_s=pcts(samples["e2e_s"]),
        goodput_rps=len(good) / duration_s if duration_s > 0 else math.nan,
        goodput_share=len(good) / len(timed) if timed else math.nan,
        cached_share=sum(t.cached_tokens for t in ok) / prompt if prompt else 0.0,
        paths={p: n / len(ok) for p, n in paths.most_common()} if ok else {},
        samples_s=samples,
        spec_acceptance=None if speculation is None else speculation[0],
        spec_tokens_per_step=None if speculation is None else speculation[1],
        kv_bytes_per_token=after.kv_bytes_per_token_since(before) if before and after else None,
        beside=_beside([t for t in ok if t.decode_replica]),
        requests_sent=request_rows(timed),
    )


def request_rows(timed: Sequence[Timed]) -> list[dict[str, object]]:
    """Each request as sent, in order: its session and turn (the replay names it `SESSION/TURN`), when it was
    sent (seconds after the first), what the client and the server timed, and where it was served."""
    if not timed:
        return []
    order = sorted(timed, key=lambda t: t.sent)
    turns: Counter[str] = Counter()
    rows: list[dict[str, object]] = []
    for t in order:
        turn = turns[t.session_id] if t.session_id else None
        turns[t.session_id] += 1
        rows.append(
            {
                "session_id": t.session_id,
                "turn": turn,
                "sent_s": t.sent - order[0].sent,
                "status": t.status,
                "ttft_s": t.ttft,
                "tpot_s": t.tpot,
                "e2e_s": t.e2e,
                "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens,
                "path": t.path,
                "decode_replica": t.decode_replica,
                "server_ttft_s": t.server_ttft,
                "stages_s": dict(t.stages),
            }
        )
    return rows


def _beside(placed: Sequence[Timed]) -> dict[str, float] | None:
    """`RunResult.beside` over the finished requests whose decode replica is known."""
    if not placed:
        return None
    by_replica: defaultdict[str, list[Timed]] = defaultdict(list)
    for t in placed:
        by_replica[t.decode_replica].append(t)
    sent_beside = 0
    alone: list[float] = []
    beside: list[float] = []
    for requests in by_replica.values():
        running: list[float] = []  # the end times of the requests sent before, a heap
        for t in sorted(requests, key=lambda t: t.sent):
            while running and running[0] <= t.sent:
                heapq.heappop(running)
            sent_beside += bool(running)
            if t.tpot is not None:
                (beside if running else alone).append(t.tpot)
            heapq.heappush(running, t.sent if t.end is None else t.end)
    return {
        "share": sent_beside / len(placed),
        "tpot_p50_alone": percentile(alone, 50),
        "tpot_p50_beside": percentile(beside, 50),
    }


def beside_text(r: RunResult) -> str:
    """`RunResult.beside` for a run's one-line summary ("" where the server does not say)."""
    if r.beside is None:
        return ""
    b = r.beside
    return (
        f", {b['share']:.0%} sent to a replica running another "
        f"(TPOT p50 {1e3 * b['tpot_p50_beside']:.1f} ms, alone {1e3 * b['tpot_p50_alone']:.1f})"
    )


def table(results: Sequence[RunResult]) -> str:
    """Side by side, one row per run; latencies in milliseconds."""
    w = max([26, *(len(r.label) for r in results)])
    head = (
        f"{'run':<{w}} {'req/s':>6} {'tok/s':>7} {'ttft p50/p95/p99 ms':>21} {'tpot p50/p99':>13} "
        f"{'itl p50/p99':>12} {'e2e p50/p99 ms':>15} {'good/s':>6} {'good':>5} {'cached':>6} {'fail':>4} "
        f"{'accept/step':>11} {'KV B/tok':>8}"
    )
    lines = [head]
    for r in results:

        def ms(d: dict[str, float], *keys: str) -> str:
            return "/".join("-" if math.isnan(d[k]) else f"{1e3 * d[k]:.0f}" for k in keys)

        lines.append(
            f"{r.label:<{w}} {r.throughput_rps:>6.2f} {r.output_tokens_per_s:>7.0f} "
            f"{ms(r.ttft_s, 'p50', 'p95', 'p99'):>21} {ms(r.tpot_s, 'p50', 'p99'):>13} "
            f"{ms(r.itl_s, 'p50', 'p99'):>12} {ms(r.e2e_s, 'p50', 'p99'):>15} {r.goodput_rps:>6.2f} "
            f"{r.goodput_share:>5.2f} {r.cached_share:>6.2f} {sum(r.failed.values()):>4} "
            f"{_speculation(r):>11} {_kv_bytes(r):>8}"
        )
    return "\n".join(lines)


def _speculation(r: RunResult) -> str:
    """Acceptance rate / tokens a step; "-" without speculation."""
    if r.spec_acceptance is None or r.spec_tokens_per_step is None:
        return "-"
    return f"{r.spec_acceptance:.2f}/{r.spec_tokens_per_step:.2f}"


def _kv_bytes(r: RunResult) -> str:
    return "-" if r.kv_bytes_per_token is None else f"{r.kv_bytes_per_token:.0f}"


# (column, RunResult field, percentile or None): what the ratio table compares.
RATIO_COLUMNS = (
    ("ttft p50", "ttft_s", "p50"),
    ("ttft p99", "ttft_s", "p99"),
    ("tpot p50", "tpot_s", "p50"),
    ("tpot p99", "tpot_s", "p99"),
    ("e2e p50", "e2e_s", "p50"),
    ("req/s", "throughput_rps", None),
    ("good/s", "goodput_rps", None),
)


def ratio_rows(runs: Mapping[str, Sequence[RunResult]], baseline: str) -> list[dict[str, object]]:
    """Each system's runs over the baseline's run with the same label in the same round, column by column."""
    base = {(r.label, r.round): r for r in runs[baseline]}

    def value(r: RunResult, field: str, q: str | None) -> float:
        v = getattr(r, field)
        return float(v[q] if q is not None else v)

    rows: list[dict[str, object]] = []
    for system, results in runs.items():
        if system == baseline:
            continue
        for r in results:
            b = base.get((r.label, r.round))
            if b is None:
                continue
            row: dict[str, object] = {"system": system, "run": r.label, "round": r.round}
            for name, field, q in RATIO_COLUMNS:
                den = value(b, field, q)
                row[name] = value(r, field, q) / den if den and not math.isnan(den) else math.nan
            rows.append(row)
    return rows
