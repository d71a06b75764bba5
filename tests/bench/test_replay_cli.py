"""`pdserve replay`'s command line: pdserve's settings reach the policy and the report names them."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from bench.replay.cli import main
from bench.replay.sim import RequestRecord
from bench.slo import percentile

SMALL = ["--trace", "mooncake", "--requests", "300", "--time-scale", "2.947", "--policies", "pdserve"]


def test_the_topologys_router_section_and_readback_reach_pdserve_and_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    assert "pdserve: mode auto, local_prefill_max_tokens 1024, prefill weight 5," in out
    assert "prefill overflow at 10 s queued; readback off" in out
    topo = tmp_path / "t.yaml"
    topo.write_text(
        "router: {mode: disaggregate, prefill_weight: 20, prefill_overflow_queue_s: null}\n"
        "pools: {kv_readback_ttl_s: 60}\n"
    )
    assert main([*SMALL, "--topology", str(topo)]) == 0
    out = capsys.readouterr().out
    assert "pdserve: mode disaggregate, local_prefill_max_tokens 1024, prefill weight 20," in out
    assert "prefill overflow off; readback 60 s, exports on" in out


def test_records_say_what_happened_to_every_request_of_every_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "records.json"
    report = tmp_path / "report.json"
    argv = [*SMALL[:-1], "pdserve,least_loaded", "--records", str(out), "--json", str(report)]
    assert main(argv) == 0
    records = msgspec.json.decode(out.read_bytes(), type=dict[str, list[RequestRecord]])
    results = {r["policy"]: r for r in msgspec.json.decode(report.read_bytes())["results"]}
    assert set(records) == set(results) == {"pdserve", "least_loaded"}
    for policy, rs in records.items():
        assert len(rs) == results[policy]["requests"] == 300
        assert len({r.request_id for r in rs}) == 300
        # The report's latencies are these records' (its TTFT P99 over the measurement window).
        ttft = [r.first_token - r.arrival for r in rs if r.in_window]
        assert percentile(ttft, 99) == pytest.approx(results[policy]["ttft_p99_s"])
        assert all(r.arrival <= r.prefill_start <= r.prefill_end <= r.first_token <= r.finish for r in rs)
    capsys.readouterr()


def test_several_routers_reach_the_replay_and_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "records.json"
    report = tmp_path / "report.json"
    argv = [*SMALL, "--routers", "3", "--router-sync-s", "0.5", "--records", str(out), "--json", str(report)]
    assert main(argv) == 0
    assert "routers: 3, each request to one at random, load reports every 0.5 s" in capsys.readouterr().out
    config = msgspec.json.decode(report.read_bytes())["config"]
    assert (config["routers"], config["router_sync_s"]) == (3, 0.5)
    records = msgspec.json.decode(out.read_bytes(), type=dict[str, list[RequestRecord]])
    assert {r.router for r in records["pdserve"]} == {0, 1, 2}


def test_a_bad_topology_is_refused_with_its_field_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topo = tmp_path / "t.yaml"
    topo.write_text("router: {prefill_weight: -1}\n")
    with pytest.raises(SystemExit) as exit_:
        main([*SMALL, "--topology", str(topo)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --topology:" in err and "router.prefill_weight" in err and "Traceback" not in err


def test_a_trace_folder_without_sessions_is_refused_with_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "claude-code" / "sessions").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_:
        main(["--trace", "claude-code", "--traces-dir", str(tmp_path), "--concurrency", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    wanted = f"no sessions (*.json, *.json.gz, *.json.xz) in {tmp_path}/claude-code/sessions"
    assert f"argument --traces-dir: {wanted}" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cache-frac", "-1"], "argument --cache-frac: must be > 0 and <= 1, got -1"),
        (["--cache-frac", "1.5"], "argument --cache-frac: must be > 0 and <= 1, got 1.5"),
        (["--time-scale", "0"], "argument --time-scale: must be > 0, got 0"),
        (["--requests", "0"], "argument --requests: must be >= 1, got 0"),
        (["--routers", "0"], "argument --routers: must be >= 1, got 0"),
        (["--router-sync-s", "0"], "argument --router-sync-s: must be > 0, got 0"),
        (["--gap-scale", "ten"], "argument --gap-scale: expected float, got 'ten'"),
        (["--policies", "pdserve,sglang"], "argument --policies: unknown policies ['sglang']; known: ["),
        (["--traces-dir", "/nonexistent"], "argument --traces-dir: No such file or directory: /nonexistent/"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*SMALL, *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
