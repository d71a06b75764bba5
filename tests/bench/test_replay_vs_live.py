"""The replay of the live benchmark's sessions, and its comparison with a live run (bench/replay_vs_live.py;
the figures in bench/replay/live_compare.py, request by request in bench/replay/live_requests.py).

The live side is `pdserve bench --mode sessions` (tests/bench/test_live_bench.py runs it against a cluster);
here a live report is given, so what is tested is that the replay runs the very workload the live run sent
and that the comparison reports each error and ratio."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest

from bench.live.arrivals import Arrivals
from bench.live.sessions import plan_sessions
from bench.replay.live_compare import Outcome, compare, format_comparison
from bench.replay.live_requests import format_tails, request_tail
from bench.replay.live_sessions import trace_of_plan
from bench.replay.policies import available_policies
from bench.replay.runner import replay_policy
from bench.replay.sim import RequestRecord, SimConfig
from bench.replay.traces import infinite_cache_hit_ratio
from bench.replay_vs_live import main
from router.block_hash import hash_blocks
from router.service_time import MeasuredEngine, MeasuredTiming

FIT = MeasuredTiming(
    prefill_fixed_s=7e-3,
    prefill_token_s=14e-6,
    prefill_pair_s=0.0,
    decode_step_s=3e-3,
    decode_seq_s=50e-6,
    decode_context_token_s=0.3e-6,
    transfer_fixed_s=3e-3,
    transfer_token_s=0.2e-6,
)


def _plan(sessions: int = 4) -> object:
    return plan_sessions(
        num_sessions=sessions, max_turns=4, max_model_len=2048, max_output=16, gap_scale=0.1, seed=0
    )


def test_the_trace_carries_the_live_prompts_hashed_as_the_router_hashes_them() -> None:
    plan = _plan()
    starts = [0.0, 0.5, 1.0, 1.5]
    trace = trace_of_plan(plan, starts, block_tokens=32)  # type: ignore[arg-type]
    assert trace.session_starts == tuple(starts)
    for turns, session in zip(plan.sessions, trace.sessions, strict=True):  # type: ignore[attr-defined]
        for turn, req in zip(turns, session.requests, strict=True):
            assert req.block_hashes == tuple(hash_blocks(turn.request.token_ids, 32))
            assert req.num_prompt_tokens == len(turn.request.token_ids)
            assert req.num_output_tokens == turn.request.max_tokens
            assert req.gap_s == turn.gap_s
            # A simulated BlockStored event carries the block's real token ids.
            assert trace.hasher.tokens(list(req.block_hashes[:1])) == turn.request.token_ids[:32]
    # A turn extends its previous one, so it shares its blocks: the bound is far from zero.
    assert infinite_cache_hit_ratio(trace) > 0.5
    with pytest.raises(ValueError, match="3 start times for 4 sessions"):
        trace_of_plan(plan, starts[:3], block_tokens=32)  # type: ignore[arg-type]


def test_the_replay_starts_each_session_at_its_time_and_counts_every_turn() -> None:
    plan = _plan()
    starts = Arrivals("poisson").offsets(4, 2.0, 0)
    trace = trace_of_plan(plan, starts, block_tokens=32)  # type: ignore[arg-type]
    cfg = SimConfig(
        prefill_replicas=0,
        decode_replicas=2,
        gap_scale=1.0,
        max_gap_s=math.inf,
        timing=MeasuredEngine(fit=FIT),
    )
    _, records = replay_policy(
        trace, "pdserve", available_policies()["pdserve"], cfg, infinite_cache_hit_ratio(trace)
    )
    assert len(records) == trace.num_requests()
    assert all(r.in_window for r in records)
    firsts = {r.session_id: r.arrival for r in records if r.request_id.endswith("/0")}
    assert sorted(firsts.values()) == pytest.approx(sorted(starts))
    # Each later turn is sent its gap after the previous reply finished.
    by_id = {r.request_id: r for r in records}
    for session in trace.sessions:
        for prev, nxt in zip(session.requests, session.requests[1:], strict=False):
            assert by_id[nxt.request_id].arrival == pytest.approx(by_id[prev.request_id].finish + nxt.gap_s)


def _live_result(ttft: float, tpot: float, cached: float, local: float) -> dict[str, object]:
    return {
        "ttft_s": {"p50": ttft, "p95": ttft, "p99": 2 * ttft},
        "tpot_s": {"p50": tpot, "p95": tpot, "p99": 2 * tpot},
        "cached_share": cached,
        "paths": {"local_prefill": local, "disaggregated": 1 - local},
        "requests": 10,
    }


def _live_report(systems: list[str], rows: list[dict[str, object]] | None = None) -> dict[str, object]:
    """A live report of one round of `systems`, each request as sent (`rows`) when given."""
    result = _live_result(0.02, 0.004, 0.8, 1.0) | ({} if rows is None else {"requests_sent": rows})
    return {"systems": {s: {"model": {"max_model_len": 2048}, "results": [result]} for s in systems}}


def test_the_comparison_states_each_error_and_pdserves_ratio_to_a_baseline_both_ways() -> None:
    live = {
        "a": [Outcome.of_live(_live_result(0.020, 0.005, 0.8, 1.0))],
        "a:round_robin": [Outcome.of_live(_live_result(0.040, 0.005, 0.6, 1.0))],
    }
    replay = {
        "a": Outcome(ttft_p50=0.022, ttft_p99=0.04, tpot_p50=0.004, tpot_p99=0.01, cached_share=0.78,
                     decode_prefill_share=1.0, requests=10),
        "a:round_robin": Outcome(ttft_p50=0.022, ttft_p99=0.08, tpot_p50=0.005, tpot_p99=0.01,
                                 cached_share=0.65, decode_prefill_share=1.0, requests=10),
    }  # fmt: skip
    result = compare(live, {s: [o] for s, o in replay.items()}, ["a", "a:round_robin"])
    rows = {(r["system"], r["metric"]): r for r in result["figures"]}
    assert rows[("a", "ttft_p50")]["error"] == pytest.approx(0.1)  # relative for latencies
    assert rows[("a", "tpot_p50")]["error"] == pytest.approx(-0.2)
    assert rows[("a", "cached_share")]["error"] == pytest.approx(-0.02)  # absolute for shares
    ratio = {r["metric"]: r for r in result["ratios"]}
    assert ratio["ttft_p50"]["live"] == pytest.approx(0.5)
    assert ratio["ttft_p50"]["replay"] == pytest.approx(1.0)
    assert ratio["ttft_p50"]["error"] == pytest.approx(1.0)
    assert ratio["cached_share"]["replay"] == pytest.approx(0.78 / 0.65)


def test_live_rounds_give_each_figures_median_and_each_ratio_read_within_its_round() -> None:
    def live(*ttfts: float) -> list[Outcome]:
        return [Outcome.of_live(_live_result(t, 0.005, 0.8, 1.0)) for t in ttfts]

    # Round 2 ran everything slower; pdserve's TTFT was half the baseline's in two rounds of three.
    rounds = {"a": live(0.010, 0.030, 0.012), "a:round_robin": live(0.020, 0.060, 0.010)}
    replay = {s: [Outcome.of_live(_live_result(0.015, 0.005, 0.8, 1.0))] for s in rounds}
    result = compare(rounds, replay, ["a", "a:round_robin"])
    assert result["rounds"] == 3
    ttft = next(r for r in result["figures"] if (r["system"], r["metric"]) == ("a", "ttft_p50"))
    assert (ttft["live"], ttft["live_low"], ttft["live_high"]) == (0.012, 0.010, 0.030)
    assert ttft["error"] == pytest.approx(0.015 / 0.012 - 1)
    ratio = next(r for r in result["ratios"] if r["metric"] == "ttft_p50")
    # Not the ratio of the two medians (0.012 / 0.020): each round's ratio, then their median.
    assert (ratio["live"], ratio["live_low"], ratio["live_high"]) == pytest.approx((0.5, 0.5, 1.2))
    assert "median of 3 rounds" in format_comparison(result)


def test_replays_on_several_timings_give_each_figures_median_and_range_and_each_ratio_per_timing() -> None:
    def outcome(ttft: float) -> Outcome:
        return Outcome.of_live(_live_result(ttft, 0.005, 0.8, 1.0))

    live = {"a": [outcome(0.02)], "a:round_robin": [outcome(0.04)]}
    # The machine ran at a different speed in each timing: every replay moves, pdserve's ratio less.
    replay = {
        "a": [outcome(t) for t in (0.010, 0.030, 0.018)],
        "a:round_robin": [outcome(t) for t in (0.020, 0.050, 0.040)],
    }
    result = compare(live, replay, ["a", "a:round_robin"])
    assert result["timings"] == 3
    ttft = next(r for r in result["figures"] if (r["system"], r["metric"]) == ("a", "ttft_p50"))
    assert (ttft["replay"], ttft["replay_low"], ttft["replay_high"]) == (0.018, 0.010, 0.030)
    assert ttft["error"] == pytest.approx(0.018 / 0.02 - 1)
    ratio = next(r for r in result["ratios"] if r["metric"] == "ttft_p50")
    # Each timing's ratio (0.5, 0.6, 0.45), then their median: not 0.018 / 0.040.
    assert (ratio["replay"], ratio["replay_low"], ratio["replay_high"]) == pytest.approx((0.5, 0.45, 0.6))
    text = format_comparison(result)
    assert "replay, median of 3 timings (range)" in text
    assert "18.0ms (10.0ms-30.0ms)" in text


def test_a_live_report_is_replayed_system_by_system(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timing = tmp_path / "timing.json"
    timing.write_text(json.dumps({"fit": {k: getattr(FIT, k) for k in FIT.__struct_fields__}}))
    systems = ["aggregated2", "aggregated2:round_robin"]
    report = _live_report(systems)
    live = tmp_path / "live.json"
    live.write_text(json.dumps(report))
    out = tmp_path / "cmp.json"
    argv = ["--timing", str(timing), "--live", str(live), "--systems", ",".join(systems), "--sessions", "4"]
    assert main([*argv, "--max-turns", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "service time: a measured engine: prefill 7.0 ms" in printed
    doc = json.loads(out.read_text())
    # Two decode engines, no prefill pool: every turn prefilled on decode; pdserve keeps sessions on their
    # replica, round robin does not.
    (replayed,) = doc["replay"]["aggregated2"]  # one timing, one replay
    assert replayed["decode_prefill_share"] == 1.0
    assert replayed["cached_share"] > doc["replay"]["aggregated2:round_robin"][0]["cached_share"]


def test_a_system_can_be_replayed_with_its_own_timing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def write(path: Path, fit: MeasuredTiming) -> str:
        path.write_text(json.dumps({"fit": msgspec.to_builtins(fit)}))
        return str(path)

    slow = msgspec.structs.replace(FIT, decode_step_s=0.03)
    systems = ["aggregated2", "aggregated2:round_robin", "pd-auto"]
    live = tmp_path / "live.json"
    live.write_text(json.dumps(_live_report(systems)))
    out = tmp_path / "cmp.json"
    argv = ["--timing", write(tmp_path / "t.json", FIT), "--live", str(live), "--systems", ",".join(systems)]
    argv += ["--timing-for", f"aggregated2={write(tmp_path / 'a2.json', slow)}", "--sessions", "4"]
    assert main([*argv, "--max-turns", "4", "--json", str(out)]) == 0
    assert "aggregated2: a measured engine: prefill 7.0 ms + 14.0 us a token, decode step 30.0 ms" in (
        capsys.readouterr().out
    )
    replay = {s: outcome for s, (outcome,) in json.loads(out.read_text())["replay"].items()}
    # Both aggregated2 systems decode at 30 ms a step, pd-auto at its own 3 ms.
    assert replay["aggregated2"]["tpot_p50"] > 0.03 and replay["aggregated2:round_robin"]["tpot_p50"] > 0.03
    assert replay["pd-auto"]["tpot_p50"] < 0.01
    with pytest.raises(SystemExit):
        main([*argv[:6], "--timing-for", "aggregated2:round_robin=" + str(tmp_path / "a2.json")])


def test_a_timing_file_that_is_not_a_fit_and_a_system_without_engines_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(["--timing", str(bad), "--live", str(bad)])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["--timing", str(bad), "--systems", "doubles"])


def _first_turns(sessions: int, x: float) -> list[RequestRecord]:
    """Every session started at once on two decode replicas; the first turns in the order they arrived."""
    plan = _plan(sessions)
    trace = trace_of_plan(plan, [0.0] * sessions, block_tokens=32)  # type: ignore[arg-type]
    fit = msgspec.structs.replace(FIT, prefill_contention=x, decode_contention=x)
    cfg = SimConfig(
        prefill_replicas=0,
        decode_replicas=2,
        gap_scale=1.0,
        max_gap_s=math.inf,
        timing=MeasuredEngine(fit=fit),
    )
    _, records = replay_policy(trace, "least_loaded", available_policies()["least_loaded"], cfg, 0.5)
    return [r for r in records if r.request_id.endswith("/0")]


def test_with_contention_a_turn_is_slower_while_another_runs_elsewhere_and_not_alone() -> None:
    assert [r.ttft for r in _first_turns(1, 0.0)] == [r.ttft for r in _first_turns(1, 0.5)]
    quiet, contended = _first_turns(2, 0.0), _first_turns(2, 0.5)
    assert {r.decode_replica for r in quiet} == {"d0", "d1"}
    # One other request in flight: 1 + 0.5 x sqrt(1). The first turn's prefill started before the second
    # arrived (a prefill's slowdown is set when it starts); its first decode step is slowed, as is all of the
    # second turn's.
    first, second = quiet
    prefill = first.prefill_end - first.prefill_start
    assert contended[0].ttft == pytest.approx(prefill + 1.5 * (first.ttft - prefill))
    assert contended[1].ttft == pytest.approx(1.5 * second.ttft)
    assert all(c.tpot > q.tpot for c, q in zip(contended, quiet, strict=True))  # type: ignore[operator]


def test_a_live_run_is_kept_beside_the_comparison_to_replay_again_with_another_timing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timing = tmp_path / "timing.json"
    timing.write_text(json.dumps({"fit": msgspec.to_builtins(FIT)}))
    systems = ["aggregated2", "aggregated2:round_robin"]
    report = _live_report(systems)
    runs: list[list[str]] = []

    def live_bench(argv: list[str]) -> int:  # stands in for `pdserve bench --side-by-side ... --json OUT`
        runs.append(argv)
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(report))
        return 0

    monkeypatch.setattr("bench.replay_vs_live.live_cli.main", live_bench)
    argv = ["--timing", str(timing), "--systems", ",".join(systems), "--sessions", "4", "--max-turns", "4"]
    first = tmp_path / "cmp.json"
    assert main([*argv, "--rounds", "2", "--json", str(first)]) == 0
    assert runs[0][runs[0].index("--rounds") + 1] == "2"  # the live run's rounds
    kept = tmp_path / "cmp.live.json"
    assert json.loads(kept.read_text()) == report
    again = tmp_path / "again.json"
    assert main([*argv, "--live", str(kept), "--json", str(again)]) == 0
    assert len(runs) == 1  # the second comparison replayed the kept run instead of running live
    assert json.loads(again.read_text())["live"] == json.loads(first.read_text())["live"]


def test_live_requests_are_matched_to_the_replays_by_session_and_turn_and_the_slowest_explained() -> None:
    def live(session: str, sent: float, ttft: float | None, replica: str, **kw: object) -> dict[str, object]:
        row: dict[str, object] = {
            "session_id": session,
            "turn": 0,
            "sent_s": sent,
            "ttft_s": ttft,
            "e2e_s": None if ttft is None else 1.0,
            "decode_replica": replica,
            "cached_tokens": 0,
            "prompt_tokens": 100,
            "server_ttft_s": None,
            "stages_s": {},
        }
        return row | kw

    def replayed(rid: str, arrival: float, ttft: float, finish: float, replica: str) -> RequestRecord:
        return RequestRecord(
            request_id=rid, session_id=rid.split("/")[0], arrival=arrival, num_blocks=1,
            first_token=arrival + ttft, finish=finish, decode_replica=replica, cached_tokens=32,
        )  # fmt: skip

    b_stages = {"prefill_leg": 0.04, "first_token": 0.01}
    rows = [
        live("a", 0.0, 0.010, "r1"),
        live("b", 0.5, 0.090, "r1", server_ttft_s=0.060, stages_s=b_stages, cached_tokens=32),
        live("c", 0.6, 0.020, "r2"),
        live("gone", 0.7, None, "r2"),  # failed: nothing to compare
    ]
    records = [
        replayed("a/0", 0.0, 0.012, 0.5, "r1"),
        replayed("b/0", 0.5, 0.030, 1.0, "r2"),  # the replay put it elsewhere, alone
        replayed("c/0", 0.6, 0.020, 1.0, "r2"),
    ]
    tail = request_tail(rows, records, slowest=2)
    assert tail["matched"] == 3
    assert tail["median_error_s"] == pytest.approx(0.0)  # +2 ms, -60 ms, 0
    assert tail["slowest_tenth_median_error_s"] == pytest.approx(-0.060)  # b alone is the slowest tenth
    b, c = tail["slowest"]
    assert (b["request"], c["request"]) == ("b/0", "c/0")
    assert b["outside_router_s"] == pytest.approx(0.030) and b["engine_s"] == pytest.approx(0.05)
    assert (b["live_cached"], b["replay_cached"]) == (32, 32)
    # Live, b was sent while a ran on r1; the replay put it on r2 before c was sent there.
    assert (b["live_beside"], b["replay_beside"]) == (1, 0)
    text = format_tails({"aggregated2": [tail, request_tail(rows, [])]})
    assert "aggregated2 r1: 3 matched, error 0.0 ms, slowest tenth -60.0 ms" in text
    assert "b/0" in text and "live   90.0 =  30.0 +   60.0 (engine   50.0)  replay   30.0" in text
    assert "aggregated2 r2: no request matched" in text


def test_several_timing_files_are_each_replayed_and_the_live_router_estimates_with_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = []
    for name, fit in (("t1.json", FIT), ("t2.json", msgspec.structs.replace(FIT, decode_step_s=0.03))):
        (tmp_path / name).write_text(json.dumps({"fit": msgspec.to_builtins(fit)}))
        files.append(str(tmp_path / name))
    systems = ["aggregated2", "aggregated2:round_robin"]
    report = _live_report(systems)
    live = tmp_path / "live.json"
    live.write_text(json.dumps(report))
    out = tmp_path / "cmp.json"
    argv = ["--timing", ",".join(files), "--live", str(live), "--systems", ",".join(systems)]
    assert main([*argv, "--sessions", "4", "--max-turns", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "service time: a measured engine: prefill 7.0 ms + 14.0 us a token, decode step 3.0 ms" in printed
    assert f"and {files[1]}: a measured engine: prefill 7.0 ms + 14.0 us a token, decode step 30.0" in printed
    doc = json.loads(out.read_text())
    quick, slow = doc["replay"]["aggregated2"]
    assert slow["tpot_p50"] > 0.03 > quick["tpot_p50"]
    assert doc["fit"]["decode_step_s"] == FIT.decode_step_s and len(doc["fits"]) == 2
    with pytest.raises(SystemExit):
        main(["--timing", ",", "--live", str(live)])


def test_a_cache_blind_run_is_replayed_again_with_each_request_where_the_live_round_put_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timing = tmp_path / "timing.json"
    timing.write_text(json.dumps({"fit": msgspec.to_builtins(FIT)}))
    plan = plan_sessions(
        num_sessions=4, max_turns=4, max_model_len=2048, max_output=32, gap_scale=0.1, seed=0
    )
    # Live, every session kept to one replica (its index's parity), whatever the policy was.
    rows = [
        {"session_id": turns[0].request.session_id, "turn": n, "decode_replica": f"live-{i % 2}",
         "path": "local_prefill", "sent_s": 0.1 * (i + n), "ttft_s": 0.02, "e2e_s": 0.1, "status": "OK",
         "cached_tokens": 0, "prompt_tokens": 100, "server_ttft_s": None, "stages_s": {}}
        for i, turns in enumerate(plan.sessions)  # type: ignore[attr-defined]
        for n in range(len(turns))
    ]  # fmt: skip
    systems = ["aggregated2", "aggregated2:round_robin"]
    report = _live_report(systems, rows)
    live = tmp_path / "live.json"
    live.write_text(json.dumps(report))
    out = tmp_path / "cmp.json"
    argv = ["--timing", str(timing), "--live", str(live), "--systems", ",".join(systems), "--sessions", "4"]
    assert main([*argv, "--max-turns", "4", "--json", str(out)]) == 0
    assert "the replay with every request where each live round put it" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    replayed = {(f["system"], f["metric"]): f["replay"] for f in doc["figures"]}
    placed = {(f["system"], f["metric"]): f["replay"] for f in doc["as_placed"]["figures"]}
    # Round robin's own choices split sessions; placed as live, its sessions stay put and hit as pdserve's.
    assert replayed[("aggregated2:round_robin", "cached_share")] < replayed[("aggregated2", "cached_share")]
    assert placed[("aggregated2:round_robin", "cached_share")] == pytest.approx(
        placed[("aggregated2", "cached_share")]
    )
    assert (
        placed[("aggregated2:round_robin", "cached_share")]
        > replayed[("aggregated2:round_robin", "cached_share")]
    )
    # A live report that does not place every request is replayed by the policies only.
    rows[0]["decode_replica"] = ""
    live.write_text(json.dumps(report))
    assert main([*argv, "--max-turns", "4", "--json", str(out)]) == 0
    assert "no replay with the live placements" in capsys.readouterr().out
    assert json.loads(out.read_text())["as_placed"] is None
