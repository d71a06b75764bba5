"""The live benchmark's requests against the replay's, one by one (`python -m bench.replay_vs_live`).

`pdserve bench --json` lists every request it sent (`requests_sent`: session, turn, the client's and the
server's times, where it was decoded); the replay names the same request `SESSION/TURN`
(bench/replay/live_sessions.py). Matched, they show which requests make a tail and why the replay misses
them (`request_tail`), and the replay can be run again with every request where the live run placed it
(`LivePlacement`), which tells a cache-blind policy's placement apart from the engines' times.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from bench.replay.sim import RequestRecord
from router.errors import NoReplicaError
from router.messages import Decision, ReplicaView, RouteRequest
from router.policy.cache_blind import decision_of
from router.policy.types import PrefixLookup


class LivePlacement:
    """Each request decoded on the replica the live run decoded it on, and prefilled there where the live run
    did (matched by `SESSION/TURN`; live replicas named in sorted order as the replay's `d0`, `d1`, ...).
    A cache-blind policy's choice turns on how many requests arrived before this one, which differs between
    live and replay by a request or two; with the live run's choices, what is left of an error is the
    engines' times."""

    name = "as_live"

    def __init__(self, rows: Sequence[dict[str, Any]]) -> None:
        live_ids = sorted({str(r["decode_replica"]) for r in rows if r["decode_replica"]})
        names = {rid: f"d{i}" for i, rid in enumerate(live_ids)}
        self._placed = {
            f"{r['session_id']}/{r['turn']}": (names[str(r["decode_replica"])], r["path"] != "disaggregated")
            for r in rows
            if r["decode_replica"]
        }

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        placed = self._placed.get(req.request_id)
        if placed is None:
            raise NoReplicaError(f"{req.request_id}: the live run did not serve it")
        replica, local = placed
        d = next((v for v in decode if v.replica_id == replica), None)
        if d is None:
            raise NoReplicaError(f"{req.request_id}: the replay has no decode replica {replica}")
        if not local and len(prefill) != 1:
            raise NoReplicaError("the live run names decode replicas only: one prefill replica at most")
        return decision_of(req, None if local else prefill[0], d, cache, 0.0, "as_live")

    def on_finish(self, req: RouteRequest, d: Decision) -> None:
        return None


def _beside_count(at: float, replica: str, spans: Sequence[tuple[str, float, float]]) -> int:
    """Requests on `replica` sent before `at` and not finished by it."""
    return sum(1 for r, start, end in spans if r == replica and start < at < end)


def request_tail(
    live_rows: Sequence[dict[str, Any]], records: Sequence[RequestRecord], slowest: int = 5
) -> dict[str, Any]:
    """One live round against the replay, request by request (matched as `SESSION/TURN`): the median error
    of a request's TTFT over all of them and over the live run's slowest tenth, and the slowest `slowest`
    requests with what the server timed of each and what the replay predicted for it."""
    by_id = {r.request_id: r for r in records}
    live_spans = [
        (str(r["decode_replica"]), float(r["sent_s"]), float(r["sent_s"]) + float(r["e2e_s"]))
        for r in live_rows
        if r["e2e_s"] is not None
    ]
    replay_spans = [(r.decode_replica, r.arrival, r.finish) for r in records]
    matched = []
    for row in live_rows:
        rec = by_id.get(f"{row['session_id']}/{row['turn']}")
        if rec is None or row["ttft_s"] is None:
            continue
        stages = row["stages_s"]
        server_ttft = row["server_ttft_s"]
        matched.append(
            {
                "request": rec.request_id,
                "live_ttft_s": row["ttft_s"],
                "replay_ttft_s": rec.ttft,
                # Outside the router's clock: gRPC in and out, and the client, on the same cores.
                "outside_router_s": None if server_ttft is None else row["ttft_s"] - server_ttft,
                "engine_s": stages.get("prefill_leg", 0.0) + stages.get("first_token", 0.0) or None,
                "live_cached": row["cached_tokens"],
                "replay_cached": rec.cached_tokens,
                "prompt_tokens": row["prompt_tokens"],
                "live_beside": _beside_count(float(row["sent_s"]), str(row["decode_replica"]), live_spans),
                "replay_beside": _beside_count(rec.arrival, rec.decode_replica, replay_spans),
            }
        )
    if not matched:
        return {"matched": 0, "slowest": []}
    matched.sort(key=lambda m: m["live_ttft_s"], reverse=True)
    tenth = matched[: max(1, len(matched) // 10)]

    def median_error(rows: Sequence[dict[str, Any]]) -> float:
        return statistics.median(m["replay_ttft_s"] - m["live_ttft_s"] for m in rows)

    return {
        "matched": len(matched),
        "median_error_s": median_error(matched),
        "slowest_tenth_median_error_s": median_error(tenth),
        "slowest": matched[:slowest],
    }


def format_tails(tails: dict[str, list[dict[str, Any]]]) -> str:
    """`request_tail` of every system's rounds, as text."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1e3 * v:.1f}"

    lines = [
        "request by request (replay - live TTFT, median; the slowest: live ms = outside the router + in it, "
        "of which the engine legs; cached tokens and requests beside it on its replica, live / replay)"
    ]
    for system, rounds in tails.items():
        for n, t in enumerate(rounds, 1):
            if not t["matched"]:
                lines.append(f"{system} r{n}: no request matched")
                continue
            lines.append(
                f"{system} r{n}: {t['matched']} matched, error {ms(t['median_error_s'])} ms, "
                f"slowest tenth {ms(t['slowest_tenth_median_error_s'])} ms"
            )
            for m in t["slowest"]:
                inside = None if m["outside_router_s"] is None else m["live_ttft_s"] - m["outside_router_s"]
                lines.append(
                    f"  {m['request']:<22} live {ms(m['live_ttft_s']):>6} = {ms(m['outside_router_s']):>5} + "
                    f"{ms(inside):>6} (engine {ms(m['engine_s']):>6})  replay {ms(m['replay_ttft_s']):>6}  "
                    f"cached {m['live_cached']}/{m['replay_cached']} of {m['prompt_tokens']}  "
                    f"beside {m['live_beside']}/{m['replay_beside']}"
                )
    return "\n".join(lines)
