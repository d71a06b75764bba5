"""`pdserve bench` against a live endpoint (gRPC, or OpenAI HTTP): the workload it sends, the arrival
processes, every mode, and the report (percentiles, goodput, ratios, JSON, plots). Against the in-process
endpoint (tests/inprocess_server.py: the real service with a stand-in decode pool streaming fixed
tokens); tests/e2e runs it on real engines, and side by side with a plain `vllm serve`."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from inprocess_server import endpoint
from ports import free_port

from bench.live.arrivals import Arrivals
from bench.live.report import beside_text, ratio_rows, summarize
from bench.live.runner import Timed
from bench.live.targets import GrpcTarget
from bench.live.workload import Lengths, Request, Workload
from bench.slo import Slo, percentile
from engine.messages import EngineRequest
from pdserve_client.api import pdserve_pb2 as pb

PDSERVE = str(Path(sys.executable).with_name("pdserve"))


def test_lengths_parse_and_draw_around_their_mean() -> None:
    rng = random.Random(0)
    assert Lengths.parse("fixed:128").draw(rng) == 128
    draws = [Lengths.parse("lognormal:200,0.5").draw(rng) for _ in range(4000)]
    assert 180 < statistics.mean(draws) < 220 and min(draws) >= 1
    for bad in ("fixed", "normal:10", "uniform:3,4", "fixed:0", "lognormal:x,1"):
        with pytest.raises(ValueError, match="expected fixed:N"):
            Lengths.parse(bad)


def test_shared_prefix_groups_start_with_the_same_tokens_and_requests_fit_the_context() -> None:
    w = Workload(
        Lengths("fixed", 3000), Lengths("fixed", 64), prefix_groups=2, prefix_len=100, max_model_len=2048
    )
    reqs = w.requests(20, seed=1)
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for r in reqs:
        by_group.setdefault(r.group, set()).add(tuple(r.token_ids[:100]))
        assert len(r.token_ids) + r.max_tokens <= 2048
    assert sorted(by_group) == [0, 1] and all(len(p) == 1 for p in by_group.values())
    assert w.requests(20, seed=1) == reqs  # seeded: the same workload every run


def test_a_repeat_period_makes_each_prompt_repeat_one_random_run_after_its_prefix() -> None:
    plain = Workload(Lengths("fixed", 100), Lengths("fixed", 8), prefix_groups=1, prefix_len=20)
    repeating = Workload(
        Lengths("fixed", 100), Lengths("fixed", 8), prefix_groups=1, prefix_len=20, repeat_period=32
    )
    for r in repeating.requests(5, seed=3):
        own = r.token_ids[20:]
        assert len(own) == 100 and own == (own[:32] * 4)[:100] and len(set(own[:32])) > 1
    # Without it the same seed draws the same prompts as ever (runs stay comparable across revisions).
    assert [len(set(r.token_ids[20:])) > 50 for r in plain.requests(5, seed=3)] == [True] * 5
    assert "repeating every 32 tokens" in repeating.describe()


def test_the_warm_up_reaches_the_runs_longest_prompt_in_doublings_of_fresh_ids() -> None:
    from bench.live.workload import RAMP_OUTPUT

    w = Workload(Lengths("fixed", 100), Lengths("fixed", 8), max_model_len=2048)
    warm = w.warmup(2, longest=1800, seed=5)
    assert warm[:2] == w.requests(2, seed=5)  # the workload's own warm-up first, as before
    lengths = [len(r.token_ids) for r in warm[2:]]
    assert lengths == [225, 450, 900, 1800]  # up to the longest, each twice the one before
    assert all(r.max_tokens == RAMP_OUTPUT and r.group == -1 for r in warm[2:])
    assert len({tuple(r.token_ids[:32]) for r in warm}) == len(warm)  # no prompt shares another's first block
    # Lengths the workload's warm-up reached are not sent again; the context bounds the longest.
    assert [len(r.token_ids) for r in w.warmup(1, longest=300, seed=5)] == [100, 150, 300]
    assert len(w.warmup(1, longest=5000, seed=5)[-1].token_ids) == 2048 - RAMP_OUTPUT
    assert w.warmup(1, longest=100, seed=5) == w.requests(1, seed=5)
    assert w.warmup(0, longest=1800, seed=5) == []  # --warmup 0: none at all


def test_a_sessions_run_is_warmed_up_to_its_longest_turn_before_its_first_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    from bench.live import cli
    from bench.live.targets import Served
    from bench.token_path_cpu import _bench_args

    sent: list[int] = []

    class RecordingTarget:
        address = "recording"

        async def served(self) -> Served:
            return Served(model="m", max_model_len=2048)

        async def engine_counts(self) -> None:
            return None

        async def send(self, req: Request, timeout_s: float) -> Timed:
            sent.append(len(req.token_ids))
            return Timed(sent=0.0, first_token=0.01, end=0.02, completion_tokens=1)

        async def aclose(self) -> None:
            return None

    args = _bench_args(
        ["--mode", "sessions", "--sessions", "3", "--max-turns", "4", "--gap-scale", "0", "--rate", "100"]
    )
    monkeypatch.setattr(cli, "open_target", lambda *a, **k: RecordingTarget())
    _, _, (result,) = asyncio.run(cli.measure(args, "recording"))
    turns, warm = sent[-result.requests :], sent[: -result.requests]
    assert len(warm) > 2 and warm[2:] == sorted(warm[2:]) and max(warm) == max(turns) > 256


def test_arrival_processes_keep_their_rate_and_gamma_is_burstier() -> None:
    n, rate = 20_000, 4.0
    for text in ("poisson", "constant", "gamma:0.25"):
        offsets = Arrivals.parse(text).offsets(n, rate, seed=0)
        assert offsets[-1] / (n - 1) == pytest.approx(1 / rate, rel=0.05), text
    gaps = {
        text: statistics.pstdev(b - a for a, b in itertools.pairwise(o))
        for text in ("poisson", "gamma:0.25")
        for o in [Arrivals.parse(text).offsets(n, rate, seed=0)]
    }
    assert gaps["gamma:0.25"] > 1.5 * gaps["poisson"]
    with pytest.raises(ValueError):
        Arrivals.parse("gamma:0")


def test_the_report_times_every_token_and_counts_goodput_against_the_slo() -> None:
    fast = Timed(
        sent=0.0, first_token=0.1, end=0.4, messages=[(0.1, 1), (0.2, 2), (0.4, 1)], completion_tokens=4
    )
    slow = Timed(sent=0.0, first_token=3.0, end=3.3, messages=[(3.0, 1), (3.3, 3)], completion_tokens=4)
    failed = Timed(sent=0.0, status="UNAVAILABLE")
    r = summarize("x", None, [fast, slow, failed], 2.0, Slo(ttft_s=1.0, tpot_s=0.2))
    assert fast.itl() == pytest.approx([0.05, 0.05, 0.2]) and fast.tpot == pytest.approx(0.1)
    assert r.ttft_s["p50"] == pytest.approx(0.1) and r.ttft_s["p99"] == pytest.approx(3.0)
    assert r.goodput_share == pytest.approx(1 / 3) and r.goodput_rps == pytest.approx(0.5)
    assert r.failed == {"UNAVAILABLE": 1} and r.throughput_rps == pytest.approx(1.0)
    assert percentile([], 50) != percentile([], 50)  # NaN


@pytest.mark.parametrize("mode", ["sweep", "min-latency", "max-throughput", "concurrency"])
def test_each_mode_runs_against_a_live_endpoint_and_writes_its_json(mode: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    with endpoint(output=["a", "b", "c"]) as target:
        run = subprocess.run(
            [PDSERVE, "bench", "--target", target, "--mode", mode, "--rates", "5,10,20,40",
             "--num-requests", "8", "--input-len", "normal:64,8", "--prefix-groups", "2",
             "--prefix-len", "32", "--json", str(out)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    runs = report["results"]
    assert len(runs) == (4 if mode == "sweep" else 1)
    for r in runs:
        assert r["requests"] == 8 and not r["failed"]
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and r["e2e_s"]["p99"] >= r["ttft_s"]["p99"]
        assert r["throughput_rps"] > 0
    if mode == "sweep":
        assert [r["offered_rate"] for r in runs] == [5, 10, 20, 40]
    assert report["model"]["id"] == "tiny-llama" and report["machine"]["cpus"]
    assert "ttft p50/p95/p99 ms" in run.stdout  # the table


def test_a_temperature_reaches_every_request_and_by_default_the_server_decides() -> None:
    for flag, expected in ((["--temperature", "0"], 0.0), ([], 1.0)):  # 1.0: the server's default
        seen: list[EngineRequest] = []
        with endpoint(output=["a", "b"], seen=seen) as target:
            run = subprocess.run(
                [PDSERVE, "bench", "--target", target, "--mode", "min-latency", "--num-requests", "3", *flag],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert len(seen) == 5 and {r.sampling.temperature for r in seen} == {expected}  # 2 warm-ups + 3


def test_an_unreachable_endpoint_is_one_line_and_exit_2() -> None:
    run = subprocess.run(
        [PDSERVE, "bench", "--target", "127.0.0.1:1", "--mode", "min-latency"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "UNAVAILABLE" in run.stderr and "Traceback" not in run.stderr


def test_the_http_door_is_a_target_too_and_its_tokens_are_counted_per_chunk(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    http = free_port()
    with endpoint(output=["a", "b", "c"], http_port=http):
        run = subprocess.run(
            [PDSERVE, "bench", "--target", f"http://127.0.0.1:{http}", "--mode", "concurrency",
             "--concurrency", "3", "--num-requests", "6", "--json", str(out),
             "--topology", str(Path(__file__).resolve().parents[2] / "deploy" / "local.yaml")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    (r,) = report["results"]
    assert r["requests"] == 6 and not r["failed"] and r["paths"] == {"local_prefill": 1.0}
    assert report["topology"]["content"]["model"]["name"] == "tiny-llama" and report["machine"]["cpu"]
    assert len(r["samples_s"]["ttft_s"]) == 6 and r["itl_s"]["p50"] > 0


def test_a_sweep_draws_latency_and_goodput_against_the_rate_and_cdfs(tmp_path: Path) -> None:
    from PIL import Image

    with endpoint(output=["a", "b"]) as target:
        run = subprocess.run(
            [PDSERVE, "bench", "--target", target, "--mode", "sweep", "--rates", "10,20",
             "--num-requests", "4", "--plots", str(tmp_path / "plots")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["goodput_vs_rate.png", "latency_cdf.png", "latency_vs_rate.png"]
    for name in pngs:
        assert Image.open(tmp_path / "plots" / name).size[0] > 500


def test_ratios_compare_each_system_with_the_baselines_run_of_the_same_label() -> None:
    def one(ttft: float) -> Timed:
        return Timed(sent=0.0, first_token=ttft, end=ttft + 1.0, messages=[(ttft, 1)], completion_tokens=2)

    slo = Slo(ttft_s=10.0, tpot_s=10.0)
    runs = {  # pd: half the TTFT, the same request in half the time
        "pd": [summarize("rate 1/s", 1.0, [one(0.2)], 2.0, slo)],
        "vllm": [summarize("rate 1/s", 1.0, [one(0.4)], 4.0, slo)],
    }
    (row,) = ratio_rows(runs, "vllm")
    assert (
        row["system"] == "pd" and row["ttft p50"] == pytest.approx(0.5) and row["req/s"] == pytest.approx(2)
    )


def test_an_unknown_side_by_side_system_is_named() -> None:
    run = subprocess.run(
        [PDSERVE, "bench", "--side-by-side", "pd,sglang"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and "unknown system sglang" in run.stderr


def test_agent_sessions_from_the_trace_extend_their_prompts_turn_by_turn_and_fit_the_model() -> None:
    from bench.live.sessions import MAX_GAP_S, plan_sessions

    plan = plan_sessions(
        num_sessions=3, max_turns=6, max_model_len=2048, max_output=32, gap_scale=0.5, seed=0
    )
    assert len(plan.sessions) == 3 and plan.tokens_per_block >= 1
    for turns in plan.sessions:
        assert len({t.request.session_id for t in turns}) == 1 and turns[0].gap_s == 0
        for prev, turn in itertools.pairwise(turns):
            a, b = prev.request.token_ids, turn.request.token_ids
            shared = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
            )
            assert shared >= len(a) - plan.tokens_per_block - 1  # all but the previous turn's own tail
            assert 0 <= turn.gap_s <= MAX_GAP_S
        for t in turns:
            assert len(t.request.token_ids) + t.request.max_tokens <= 2048 and 1 <= t.request.max_tokens <= 32
    again = plan_sessions(
        num_sessions=3, max_turns=6, max_model_len=2048, max_output=32, gap_scale=0.5, seed=0
    )
    assert again == plan  # seeded


def test_sessions_mode_sends_every_turn(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    with endpoint(output=["a", "b"]) as target:
        run = subprocess.run(
            [PDSERVE, "bench", "--target", target, "--mode", "sessions", "--sessions", "2",
             "--max-turns", "3", "--gap-scale", "0.001", "--rate", "10", "--json", str(out)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    (r,) = report["results"]
    assert r["requests"] == 6 and not r["failed"] and "2 agent sessions (6 turns)" in report["workload"]


def test_the_plain_vllm_baseline_gets_the_aggregated_decode_engines_settings() -> None:
    from bench.live.systems import REPO, vllm_serve_config

    config, env = vllm_serve_config(REPO / "deploy" / "local.yaml", 8123)
    assert config["served-model-name"] == "tiny-llama" and Path(config["model"], "config.json").exists()
    assert (config["block-size"], config["dtype"], config["max-model-len"]) == (32, "float32", 2048)
    assert config["enforce-eager"] is True and config["enable-prefix-caching"] is True
    assert config["enable-prompt-tokens-details"] is True  # cached prompt tokens in usage, compared
    assert "kv-transfer-config" not in config and (config["host"], config["port"]) == ("127.0.0.1", 8123)
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}  # the decode pool's core
    assert "stream-interval" not in config  # vLLM's default: a message per token
    # `vllm-batched`: as many tokens a message as pdserve's router streams at most (stream_batch_tokens).
    batched, _ = vllm_serve_config(REPO / "deploy" / "local.yaml", 8123, batched=True)
    assert batched == config | {"stream-interval": 16}


def test_a_traces_dir_without_sessions_is_one_line(tmp_path: Path) -> None:
    with endpoint(output=["a"]) as target:
        run = subprocess.run(
            [PDSERVE, "bench", "--target", target, "--mode", "sessions", "--traces-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert run.returncode == 2 and "no sessions" in run.stderr and "Traceback" not in run.stderr


def test_a_pdserve_system_can_run_an_earlier_revision_and_only_a_pdserve_one() -> None:
    from bench.live.systems import known

    assert known("aggregated@0b48427") and known("pd@HEAD~1") and known("vllm")
    assert not known("vllm@HEAD") and not known("aggregated@") and not known("sglang@HEAD")
    # Routed by a cache-blind baseline: pdserve systems only, and only policies the router has.
    assert (
        known("aggregated2:round_robin") and known("pd-auto:round_robin") and known("pd:least_loaded@HEAD~1")
    )
    assert not known("vllm:round_robin") and not known("aggregated2:random") and not known("aggregated2:")
    run = subprocess.run(
        [PDSERVE, "bench", "--side-by-side", "aggregated@HEAD,aggregated@HEAD"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "each system once" in run.stderr


def test_a_pdserve_system_named_with_http_last_is_sent_the_workload_on_its_openai_door(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`+http` comes last, after any policy and revision, and only on pdserve systems (`vllm` speaks only
    HTTP). The cluster gets its HTTP door on a port of its own, and the bench is given that door's URL."""
    from bench.live import systems
    from bench.live.cli import LOCAL_TOPOLOGY
    from cluster.topology_file import parse_topology

    assert systems.known("aggregated+http") and systems.known("pd:least_loaded@HEAD~1+http")
    assert not systems.known("vllm+http") and not systems.known("aggregated+https")
    assert not systems.known("aggregated+http@HEAD") and not systems.known("+http")
    assert systems._parts("pd:least_loaded@HEAD~1+http") == ("pd", "least_loaded", "HEAD~1")
    topo = systems.topology(LOCAL_TOPOLOGY, systems.overrides("aggregated+http"), http=True)
    server = parse_topology(yaml.safe_dump(topo)).server
    assert server.http_port is not None and server.http_port not in (server.grpc_port, server.metrics_port)
    assert parse_topology(yaml.safe_dump(systems.topology(LOCAL_TOPOLOGY, {}))).server.http_port is None

    started: list[Path] = []

    class Cluster:  # stands in for `pdserve up`: records the topology it was given
        def __init__(self, path: Path, env: object = None, cwd: object = None) -> None:
            started.append(path)

        def down(self) -> None:
            pass

    monkeypatch.setattr(systems, "LocalCluster", Cluster)
    with systems.started("aggregated+http", LOCAL_TOPOLOGY) as address:
        port = yaml.safe_load(started[0].read_text())["server"]["http_port"]
        assert address == f"http://127.0.0.1:{port}"
    with systems.started("aggregated", LOCAL_TOPOLOGY) as address:
        assert not address.startswith("http")
        assert "http_port" not in yaml.safe_load(started[1].read_text())["server"]


def test_an_earlier_revision_runs_from_its_own_tree_first_on_the_path() -> None:
    from bench.live.systems import REPO, revision

    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    with revision(head.stdout.strip()) as (env, tree):
        assert Path(env["PYTHONPATH"].split(os.pathsep)[0]) == tree
        assert (tree / "cluster" / "cli.py").read_text() == subprocess.run(
            ["git", "-C", str(REPO), "show", "HEAD:cluster/cli.py"], capture_output=True, text=True
        ).stdout
    assert not tree.exists()  # removed once the system stopped
    with pytest.raises(RuntimeError, match="git archive no-such-revision"), revision("no-such-revision"):
        pass


@pytest.mark.parametrize("system", ["pd", "pd-auto", "aggregated", "aggregated2", "doubles"])
def test_every_pdserve_system_is_a_valid_topology_and_a_policy_suffix_reaches_the_router(system: str) -> None:
    from bench.live.cli import LOCAL_TOPOLOGY
    from bench.live.systems import overrides, topology
    from cluster.topology_file import parse_topology

    plain = parse_topology(yaml.safe_dump(topology(LOCAL_TOPOLOGY, overrides(system))))
    assert plain.router.policy == "pdserve"
    blind = parse_topology(yaml.safe_dump(topology(LOCAL_TOPOLOGY, overrides(f"{system}:least_loaded@HEAD"))))
    assert blind.router.policy == "least_loaded"


def test_speculation_and_kv_bytes_are_read_from_the_decode_engines_counters_once_they_count_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counters reach the cluster's status with each replica's heartbeat: the run's acceptance and KV bytes
    are taken from the first reading that counts all of the run's requests, not from a stale one."""
    import asyncio

    from bench.live import targets
    from bench.live.report import table
    from bench.live.targets import EngineCounts

    monkeypatch.setattr(targets, "HEARTBEAT_S", 0.04)
    before = EngineCounts(
        finished=10, spec_drafts=100, spec_draft_tokens=400, spec_accepted_tokens=200,
        kv_tokens_received=1000, kv_bytes_received=512_000,
    )  # fmt: skip
    fresh = EngineCounts(
        finished=14, spec_drafts=120, spec_draft_tokens=480, spec_accepted_tokens=230,
        kv_tokens_received=1256, kv_bytes_received=643_072,
    )  # fmt: skip

    class Target:
        def __init__(self) -> None:
            self.readings = [before, before, fresh]  # two stale readings, then the run counted

        async def engine_counts(self) -> EngineCounts:
            return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]

    after = asyncio.run(targets.counted(Target(), before, finished=4))  # type: ignore[arg-type]
    assert after == fresh
    assert asyncio.run(targets.counted(Target(), None, finished=4)) is None  # type: ignore[arg-type]
    r = summarize("x", None, [Timed(sent=0.0, end=1.0)], 1.0, Slo(ttft_s=1.0, tpot_s=0.1), (before, after))
    # 30 of 80 drafted tokens accepted over 20 drafts: 1 + 30/20 tokens a step; 131072 bytes for 256 tokens.
    assert (r.spec_acceptance, r.spec_tokens_per_step) == (pytest.approx(30 / 80), pytest.approx(2.5))
    assert r.kv_bytes_per_token == pytest.approx(512.0)
    assert table([r]).splitlines()[1].endswith("0.38/2.50      512")
    # Nothing drafted, no KV moved, or no counters (an OpenAI server): "-".
    assert fresh.speculation_since(fresh) is None and fresh.kv_bytes_per_token_since(fresh) is None
    plain = summarize("x", None, [Timed(sent=0.0, end=1.0)], 1.0, Slo(ttft_s=1.0, tpot_s=0.1))
    assert table([plain]).splitlines()[1].endswith(" -        -")


def test_a_runs_engine_counters_start_once_the_warm_up_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster reports its engines' counters a heartbeat late. Read at once after the warm-up, they
    would miss it; the run's window would then close early, while its last request had moved its KV bytes
    but not yet counted its tokens. A warm-up request here moves 1024 bytes a token and a run's 512."""
    import asyncio

    from bench.live import cli, targets
    from bench.live.targets import EngineCounts, Served
    from bench.token_path_cpu import _bench_args

    monkeypatch.setattr(targets, "HEARTBEAT_S", 0.04)

    class LaggingTarget:
        address = "lagging"

        def __init__(self) -> None:
            self.sent = 0
            self.reported = EngineCounts(
                finished=0, spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0
            )

        async def served(self) -> Served:
            return Served(model="m", max_model_len=4096)

        async def engine_counts(self) -> EngineCounts:
            # What the last heartbeat carried; this reading brings the next one, with everything sent since.
            shown, tokens = self.reported, 100 * self.sent
            warm = min(self.sent, 2)
            self.reported = EngineCounts(
                finished=self.sent, spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0,
                kv_tokens_received=tokens, kv_bytes_received=100 * (1024 * warm + 512 * (self.sent - warm)),
            )  # fmt: skip
            return shown

        async def send(self, req: object, timeout_s: float) -> Timed:
            self.sent += 1
            await asyncio.sleep(0)
            return Timed(sent=0.0, first_token=0.01, end=0.02, completion_tokens=1)

        async def aclose(self) -> None:
            return None

    monkeypatch.setattr(cli, "open_target", lambda *a, **k: LaggingTarget())
    args = _bench_args(["--mode", "min-latency", "--num-requests", "4", "--warmup", "2"])
    _, _, (result,) = asyncio.run(cli.measure(args, "lagging"))
    assert result.kv_bytes_per_token == 512


def test_the_report_counts_requests_sent_to_a_replica_still_running_another() -> None:
    def on(replica: str, sent: float, end: float, tpot: float) -> Timed:
        return Timed(
            sent=sent,
            first_token=sent,
            end=end,
            completion_tokens=int((end - sent) / tpot) + 1,
            decode_replica=replica,
        )

    first = on("a", 0.0, 1.0, 0.1)
    joins = on("a", 0.5, 2.0, 0.3)  # sent while `first` runs on a
    elsewhere = on("b", 0.6, 1.0, 0.1)  # b was idle
    after_both = on("a", 2.5, 3.0, 0.1)  # a's two had ended
    r = summarize("x", None, [first, joins, elsewhere, after_both], 3.0, Slo(ttft_s=1.0, tpot_s=1.0))
    assert r.beside is not None
    assert r.beside["share"] == pytest.approx(1 / 4)
    assert r.beside["tpot_p50_beside"] == pytest.approx(0.3)
    assert r.beside["tpot_p50_alone"] == pytest.approx(0.1)
    assert beside_text(r) == ", 25% sent to a replica running another (TPOT p50 300.0 ms, alone 100.0)"
    # Another server does not say where it decoded: nothing to tell.
    unplaced = Timed(sent=0.0, first_token=0.1, end=0.4, completion_tokens=4)
    elsewhere_only = summarize("x", None, [unplaced], 1.0, Slo(ttft_s=1.0, tpot_s=1.0))
    assert elsewhere_only.beside is None and beside_text(elsewhere_only) == ""


def test_the_report_lists_each_request_in_the_order_sent_with_its_session_turn_and_the_servers_stages() -> (
    None
):
    def turn(session: str, sent: float, ttft: float, **kw: object) -> Timed:
        return Timed(sent=sent, first_token=sent + ttft, end=sent + ttft + 0.1, completion_tokens=3,
                     session_id=session, **kw)  # type: ignore[arg-type]  # fmt: skip

    a1 = turn("a", 10.0, 0.02, server_ttft=0.015, stages={"prefill_leg": 0.012})
    b1 = turn("b", 10.5, 0.03)
    a2 = turn("a", 11.0, 0.05, decode_replica="r1", cached_tokens=64, prompt_tokens=100)
    lost = Timed(sent=11.2, status="UNAVAILABLE", session_id="b")
    # Completion order, as the session loop collects them.
    rows = summarize("x", None, [b1, a1, lost, a2], 2.0, Slo(ttft_s=1.0, tpot_s=1.0)).requests_sent
    assert [(r["session_id"], r["turn"], r["status"]) for r in rows] == [
        ("a", 0, "OK"), ("b", 0, "OK"), ("a", 1, "OK"), ("b", 1, "UNAVAILABLE")
    ]  # fmt: skip
    assert [r["sent_s"] for r in rows] == pytest.approx([0.0, 0.5, 1.0, 1.2])
    assert rows[0]["ttft_s"] == pytest.approx(0.02) and rows[0]["server_ttft_s"] == 0.015
    assert rows[0]["stages_s"] == {"prefill_leg": 0.012}
    assert (rows[2]["decode_replica"], rows[2]["cached_tokens"], rows[2]["prompt_tokens"]) == ("r1", 64, 100)
    assert rows[3]["ttft_s"] is None and rows[3]["e2e_s"] is None


def test_a_grpc_target_keeps_the_servers_timeline_of_each_request() -> None:
    final = pb.Final(
        usage=pb.Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=4),
        served_by=pb.ServedBy(decode_replica="r1"),
        timings=pb.Timings(
            ttft_ms=14.0,
            timeline=[
                pb.Stage(name="intake", duration_ms=0.5),
                pb.Stage(name="prefill_leg", duration_ms=9.0),
                pb.Stage(name="failed_attempt", duration_ms=3.0),
                pb.Stage(name="prefill_leg", duration_ms=2.0),
            ],
        ),
    )

    class Client:
        async def generate(self, **fields: object):  # type: ignore[no-untyped-def]
            yield pb.GenerateResponse(token_ids=[5])
            yield pb.GenerateResponse(token_ids=[6], final=final)

    async def send() -> Timed:
        target = GrpcTarget("127.0.0.1:1", token=None, tls=False)  # its channel needs a running loop
        await target.aclose()
        target._client = Client()  # type: ignore[assignment]
        return await target.send(Request(token_ids=[1, 2], max_tokens=2, group=-1, session_id="s"), 5.0)

    t = asyncio.run(send())
    assert t.ok and t.session_id == "s" and t.decode_replica == "r1"
    assert t.server_ttft == pytest.approx(0.014)
    # A stage run twice (a retried leg) counts both times.
    assert t.stages == pytest.approx({"intake": 0.0005, "prefill_leg": 0.011, "failed_attempt": 0.003})
