"""pdserve's routing decisions on fixed replay slices are the ones recorded (data/pdserve_decisions.json.gz):
a refactor of the cost, the options or the selector must not change a single decision, nor the cost it was
made at.

Recorded last when a new prompt's copy of a prefix another prefill replica holds was charged `COPY_WEIGHT`
and a wait past the TTFT SLO (`router.ttft_slo_ms`) `OVER_SLO_WEIGHT` x the excess. The slices cover every
outcome label (disaggregated, local, long local, prefill overflow, affinity) and readback with exports. A
deliberate change of the policy re-records the file (`record_decisions` below) and says why in its commit.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from bench.replay.index_feed import KvIndexFeed
from bench.replay.sim import SimConfig, Simulator
from bench.replay.traces import load_trace
from router.config import RouterConfig
from router.messages import Decision, RouteRequest
from router.policy.selector import PdservePolicy
from router.service_time import ServiceTimeModel

RECORDED = Path(__file__).parent / "data" / "pdserve_decisions.json.gz"
SLICES: dict[str, dict[str, Any]] = {
    "claude-code": {
        "trace": "claude-code",
        "limit": 24,
        "seed": 3,
        "sim": {"concurrency": 12, "gap_scale": 0.4},
    },
    "claude-code-busy": {
        "trace": "claude-code",
        "limit": 24,
        "seed": 5,
        "sim": {"concurrency": 24, "gap_scale": 1.0, "prefill_replicas": 3, "decode_replicas": 3},
    },
    "claude-code-readback": {
        "trace": "claude-code",
        "limit": 24,
        "seed": 3,
        "sim": {"concurrency": 16, "gap_scale": 0.4, "readback_ttl_s": 60.0},
    },
    "mooncake": {
        "trace": "mooncake",
        "limit": 1500,
        "seed": 0,
        "sim": {"time_scale": 2.947, "prefill_replicas": 8, "decode_replicas": 8},
    },
}


def record_decisions(name: str) -> list[list[Any]]:
    """Every decision of the default pdserve policy on slice `name`, in order."""
    spec = SLICES[name]
    trace = load_trace(spec["trace"], block_tokens=512, limit=spec["limit"], seed=spec["seed"])
    timing = ServiceTimeModel()
    sim = {"prefill_replicas": 4, "decode_replicas": 4, **spec["sim"]}
    cfg = SimConfig(
        capacity_blocks=max(1, int(0.02 * trace.unique_blocks())), seed=spec["seed"], timing=timing, **sim
    )
    policy = PdservePolicy(RouterConfig(), timing)
    out: list[list[Any]] = []
    choose = policy.choose

    def recording(req: RouteRequest, *args: Any) -> Decision:
        d = choose(req, *args)
        out.append(
            [
                req.request_id,
                d.prefill,
                d.decode,
                d.local_prefill,
                d.predicted_cached_tokens,
                d.predicted_decode_cached_tokens,
                d.readback_tokens,
                d.readback_replica,
                d.readback_export,
                d.reason,
                d.cost,
            ]
        )
        return d

    policy.choose = recording  # type: ignore[method-assign]
    ids = [f"p{i}" for i in range(cfg.prefill_replicas)] + [f"d{i}" for i in range(cfg.decode_replicas)]

    def index_factory() -> tuple[KvIndexFeed, Any]:
        feed = KvIndexFeed(trace, ids)
        return feed, feed.index

    Simulator(trace, policy, cfg, index_factory=index_factory).run()
    return out


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[list[Any]]]:
    with gzip.open(RECORDED, "rt") as f:
        data: dict[str, list[list[Any]]] = json.load(f)
    return data


@pytest.mark.parametrize("name", sorted(SLICES))
def test_the_replay_decides_exactly_as_recorded(name: str, recorded: dict[str, list[list[Any]]]) -> None:
    now = record_decisions(name)
    before = recorded[name]
    assert len(now) == len(before)
    for i, (a, b) in enumerate(zip(now, before, strict=True)):
        assert a == b, f"decision {i} of {name} differs: now {a}, recorded {b}"
