"""The side-by-side benchmark's baseline on real components: a plain `vllm serve` of the built-in model,
started by `pdserve bench --side-by-side vllm` with the aggregated decode engine's settings, measured through
its OpenAI HTTP API with the same client as pdserve's door. (The pdserve systems of the side-by-side run are
`pdserve up` on two topologies, which the other e2e tests start.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PDSERVE = str(Path(sys.executable).with_name("pdserve"))


def test_plain_vllm_serve_is_started_measured_and_stopped(tmp_path: Path) -> None:
    out = tmp_path / "side.json"
    run = subprocess.run(
        [PDSERVE, "bench", "--side-by-side", "vllm", "--mode", "min-latency", "--num-requests", "3",
         "--input-len", "fixed:128", "--output-len", "fixed:8", "--prefix-groups", "1", "--prefix-len", "64",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (r,) = json.loads(out.read_text())["systems"]["vllm"]["results"]
    assert r["requests"] == 3 and not r["failed"] and r["tpot_s"]["p50"] > 0
    assert r["output_tokens_per_s"] > 0 and len(r["samples_s"]["e2e_s"]) == 3
    assert r["cached_share"] > 0  # the shared prefix, reported by vLLM's usage
    stray = subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai.api_server"], capture_output=True)
    assert stray.returncode == 1, "the vLLM server outlived the benchmark"
