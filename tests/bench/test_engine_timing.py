"""bench.engine_timing: the engines of a topology measured on this machine, fitted into the
`router.service_time.measured` section that the router and `pdserve replay --topology` use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

from bench.engine_timing import fit, fit_nonnegative
from bench.replay.cli import main as replay
from cluster.topology_file import parse_topology
from router.service_time import MeasuredEngine, MeasuredTiming

REPO = Path(__file__).resolve().parents[2]


def test_the_fit_recovers_the_times_it_was_given() -> None:
    truth = MeasuredTiming(
        prefill_fixed_s=0.004,
        prefill_token_s=2e-5,
        prefill_pair_s=3e-9,
        decode_step_s=0.006,
        decode_seq_s=1e-4,
        decode_context_token_s=2e-7,
        transfer_fixed_s=0.001,
        transfer_token_s=4e-6,
    )
    model = MeasuredEngine(fit=truth)
    samples = {
        "prefill": [
            {"new": n, "cached": c, "s": model.prefill_s(n, c)} for n in (32, 512, 1500) for c in (0, 256)
        ],
        "decode": [
            {"batch": b, "context": b * x, "s": model.tpot_s(b, b * x)} for b in (1, 8, 32) for x in (64, 900)
        ],
        "transfer": [{"tokens": t, "s": model.transfer_s(t)} for t in (64, 1024)],
    }
    got = msgspec.to_builtins(fit(samples))
    for name, value in msgspec.to_builtins(truth).items():
        assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-12), name


def test_a_coefficient_the_data_would_make_negative_is_zero_and_the_rest_refitted() -> None:
    # Seconds that fall with size (noise on a flat cost): no negative time per token.
    fixed, per_token = fit_nonnegative([[1.0, 1.0, 1.0], [10.0, 20.0, 30.0]], [0.012, 0.011, 0.010])
    assert per_token == 0.0 and fixed == pytest.approx(0.011)


@pytest.mark.e2e
def test_it_measures_the_local_engines_and_the_replay_takes_the_section_it_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "timing.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.engine_timing", "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    samples = report["samples"]
    assert {len(samples[part]) for part in ("prefill", "decode", "transfer")} >= {2}
    assert all(s["s"] > 0 for part in ("prefill", "transfer") for s in samples[part])
    # A longer prompt takes longer; a KV pull moved something.
    by_new = {s["new"]: s["s"] for s in samples["prefill"] if s["cached"] == 0}
    assert by_new[512] > by_new[32]
    # The printed section is a topology of its own, and the fit is the JSON's.
    section = run.stdout[run.stdout.index("router:") :]
    topo = parse_topology(section)
    assert topo.router.service_time.measured == msgspec.convert(report["fit"], MeasuredTiming)
    path = tmp_path / "measured.yaml"
    path.write_text(yaml.safe_dump(yaml.safe_load(section)))
    argv = ["--trace", "mooncake", "--requests", "200", "--time-scale", "1", "--policies", "pdserve"]
    assert replay([*argv, "--topology", str(path)]) == 0
    assert "service time: a measured engine: prefill " in capsys.readouterr().out
