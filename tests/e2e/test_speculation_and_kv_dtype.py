"""End to end: speculative decoding (ngram, on the decode pool) and a one-byte KV cache (fp8) through
prefill -> NIXL -> decode on real vLLM CPU engines, against one plain engine with the same KV dtype and no
speculation.

One cluster carries both: speculation must not change greedy output, and the fp8 blocks prefill writes must
be the ones decode reads (the output equals an engine that computed them itself). That each is really on is
asserted apart: the decode engine reports accepted drafts, and NIXL moves a byte a KV element."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import RunningCluster, cluster_up, kv_bytes_per_token, make_topology, reference_outputs

from engine.tiny_model import ensure_tiny_model
from pdserve_client.api import pdserve_pb2 as pb
from pdserve_client.sdk import PdserveClient
from router.intake.tokenizer import PromptTokenizer

pytestmark = pytest.mark.e2e

BLOCK = 32
KV_DTYPE = "fp8"
# Repetitive prompts: ngram speculation drafts from the text seen so far, so these get drafts to verify.
TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 12,
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 8,
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = PromptTokenizer(ensure_tiny_model())
    return [tokenizer.encode_text(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[list[int]]:
    """One plain engine's greedy outputs with the same KV dtype, no speculation (run before the cluster)."""
    requests = [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in prompts]
    return reference_outputs(requests, kv_cache_dtype=KV_DTYPE)


@pytest.fixture(scope="module")
def cluster(reference: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    topology = make_topology(
        tmp_path_factory.mktemp("topology"),
        router__mode="disaggregate",
        model__kv_cache_dtype=KV_DTYPE,
        pools__decode__speculative={"method": "ngram", "num_speculative_tokens": 4},
    )
    with cluster_up(topology) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> Iterator[PdserveClient]:
    c = PdserveClient(cluster.target, timeout=120)
    yield c
    c.close()


def replica(client: PdserveClient, role: str) -> pb.Replica:
    (r,) = [r for r in client.cluster_status() if r.role == role]
    return r


def settled(client: PdserveClient, role: str) -> pb.Replica:
    """The replica's counters once a heartbeat (every 2 s) has carried everything finished so far."""
    time.sleep(2.5)
    return replica(client, role)


def test_greedy_output_with_speculation_and_fp8_kv_through_prefill_decode_equals_one_engine(
    client: PdserveClient, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    before = settled(client, "decode")
    for prompt, expected in zip(prompts, reference, strict=True):
        done = client.generate_text(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert done.served_by.path == pb.SERVING_PATH_DISAGGREGATED
        assert done.token_ids == expected
    after = settled(client, "decode")
    # Speculation was on: the decode engine drafted, and accepted some drafts (repetitive text), never more
    # than it drafted.
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert after.spec_drafts > before.spec_drafts and drafted > 0
    assert 0 < accepted <= drafted
    # Prefill computes one token: it runs no speculator.
    assert replica(client, "prefill").spec_drafts == 0


def test_fp8_kv_moves_a_byte_a_kv_element(client: PdserveClient) -> None:
    before = settled(client, "decode")
    prompt = list(range(1000, 1000 + 7 * BLOCK))  # shares no block with the other tests' prompts
    done = client.generate_text(token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert done.served_by.path == pb.SERVING_PATH_DISAGGREGATED
    after = settled(client, "decode")
    tokens = after.prompt_tokens_external_kv - before.prompt_tokens_external_kv
    moved = after.nixl_bytes_transferred - before.nixl_bytes_transferred
    assert tokens == len(prompt)
    # A quarter of the float32 default's bytes (tests/e2e/test_serving.py measures that one).
    assert moved / tokens == kv_bytes_per_token(element_bytes=1)


def test_metrics_and_bench_report_the_acceptance(cluster: RunningCluster, tmp_path: Path) -> None:
    body = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
    accepted = [
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("pdserve_engine_spec_accepted_tokens_total{") and 'role="decode"' in line
    ]
    assert accepted and accepted[0] > 0
    out = tmp_path / "bench.json"
    run = cluster.cli(
        "bench", "--target", cluster.target, "--mode", "min-latency", "--num-requests", "4",
        "--input-len", "fixed:128", "--output-len", "fixed:32", "--prefix-groups", "1", "--prefix-len", "96",
        "--json", str(out), timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (result,) = json.loads(out.read_text())["results"]
    report: dict[str, Any] = result
    assert not report["failed"]
    assert report["spec_tokens_per_step"] is not None and report["spec_tokens_per_step"] >= 1.0
    assert 0.0 <= report["spec_acceptance"] <= 1.0
    assert report["kv_bytes_per_token"] == kv_bytes_per_token(element_bytes=1)
    assert "tokens/step" in run.stdout
