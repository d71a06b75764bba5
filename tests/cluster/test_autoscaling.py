"""The pools' autoscaling policy: what each pool's load needs, the warm buffer, and the policy as Serve's
controller runs it (its own bounds and delays around ours)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve._private.constants import SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray.serve.schema import ServeDeploySchema

from cluster.autoscaling import (
    BUSY_TARGET,
    PoolPolicy,
    ScaleTargets,
    needed_replicas,
    replica_loads,
    scale_targets,
    serve_autoscaling_config,
    wanted_replicas,
)
from cluster.serve_config import compile_serve_config
from cluster.topology_file import parse_topology
from engine.messages import ReplicaLoad

PREFILL = ScaleTargets(role="prefill", queue_s=0.5, ttft_s=2.0)
DECODE = ScaleTargets(role="decode", kv_usage=0.8, running_seqs=6, tpot_s=0.05)


def topology(**decode: Any) -> Any:
    return parse_topology(
        {
            "model": {"engine": "double"},
            "router": {"ttft_slo_ms": 2000, "tpot_slo_ms": 40},
            "pools": {
                "prefill": {"autoscaling": {"max_replicas": 4, "queue_share_of_ttft": 0.1}},
                "decode": {
                    "replicas": 2,
                    "engine": {"max_num_seqs": 8},
                    "autoscaling": {"max_replicas": 6, "warm_replicas": 1, "window_s": 2, **decode},
                },
            },
        }
    )


def test_targets_come_from_the_slos_and_the_engine_limits() -> None:
    topo = topology()
    prefill = scale_targets(topo, "prefill")
    assert (prefill.queue_s, prefill.ttft_s) == (pytest.approx(0.2), 2.0)  # 0.1 x 2 s
    decode = scale_targets(topo, "decode")
    # Sequences: as many as a replica runs at once (engine.max_num_seqs); beyond, they wait.
    assert (decode.running_seqs, decode.tpot_s, decode.kv_usage, decode.warm_replicas) == (8, 0.04, 0.8, 1)
    assert scale_targets(topology(running_seqs=3), "decode").running_seqs == 3


def test_prefill_needs_its_busy_replicas_with_headroom_and_what_drains_its_queue() -> None:
    # Both busy all the time, the queue within each one's share: short of headroom only.
    busy = [ReplicaLoad(queued_prefill_s=0.4, busy=1.0, start_s=8.0)] * 2
    assert needed_replicas(PREFILL, busy) == pytest.approx(2 / BUSY_TARGET)
    assert wanted_replicas(PREFILL, busy) == 3
    # 21 s queued where each may hold 0.5 s: the 20 s beyond drain within the TTFT SLO after a new
    # replica's start (2 + 8 s), which takes two more.
    queued = [ReplicaLoad(queued_prefill_s=10.5, busy=1.0, start_s=8.0)] * 2
    assert needed_replicas(PREFILL, queued) == pytest.approx(2 / BUSY_TARGET + 20 / 10)
    # Half busy, no queue: one replica is enough.
    assert wanted_replicas(PREFILL, [ReplicaLoad(busy=0.45)] * 2) == 1
    assert wanted_replicas(PREFILL, [ReplicaLoad(), ReplicaLoad()]) == 0  # idle: the bounds keep the minimum


def test_decode_needs_the_most_of_kv_sequences_and_step_time() -> None:
    by_seqs = [ReplicaLoad(running=8, waiting=4, kv_usage=0.2, step_s=0.02)] * 2  # 24 sequences / 6
    assert needed_replicas(DECODE, by_seqs) == pytest.approx(4.0)
    by_kv = [ReplicaLoad(running=2, kv_usage=0.96, step_s=0.02)] * 2
    assert needed_replicas(DECODE, by_kv) == pytest.approx(2.4)
    slow_steps = [ReplicaLoad(running=2, kv_usage=0.1, step_s=0.075), ReplicaLoad()]  # idle one: no step
    assert needed_replicas(DECODE, slow_steps) == pytest.approx(2 * 0.075 / 0.05)


def test_the_warm_buffer_runs_on_top_of_what_the_load_needs() -> None:
    warm = msgspec.structs.replace(DECODE, warm_replicas=2)
    loads = [ReplicaLoad(running=6, step_s=0.02)] * 2  # 12 sequences: exactly 2 replicas
    assert wanted_replicas(DECODE, loads) == 2
    assert wanted_replicas(warm, loads) == 4


def _context(metrics: dict[str, dict[ReplicaID, float]], running: list[ReplicaID], **kw: Any) -> Any:
    deployment = DeploymentID(name="decode", app_name="pdserve")
    config = AutoscalingConfig(**kw.pop("config"))
    return AutoscalingContext(
        deployment_id=deployment,
        deployment_name="decode",
        app_name="pdserve",
        current_num_replicas=len(running),
        target_num_replicas=kw.pop("target", len(running)),
        running_replicas=running,
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=kw.pop("state", {}),
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=config,
    )


def test_serve_runs_the_policy_at_once_up_and_after_the_delay_down() -> None:
    topo = topology(downscale_delay_s=30)
    config = serve_autoscaling_config(topo, "decode")
    policy = _apply_autoscaling_config(_resolve_policy_callable(AutoscalingConfig(**config).policy))
    decode = DeploymentID(name="decode", app_name="pdserve")
    a, b = (ReplicaID(unique_id=u, deployment_id=decode) for u in "ab")

    def seqs(n: float) -> dict[str, dict[ReplicaID, float]]:
        return {"running": {a: n, b: n}, "step_s": {a: 0.02, b: 0.02}}

    # 2 x 20 sequences / 8 a replica = 5 (+1 warm), at once.
    wanted, state = policy(_context(seqs(20), [a, b], config=config))
    assert wanted == 6 and state["pdserve_need"] == pytest.approx(5.0)
    # Quiet: 1 sequence each needs 1 replica (+1 warm), but only after downscale_delay_s of it.
    wanted, state = policy(_context(seqs(1), [a, b], config=config, target=6))
    assert wanted == 6
    state[SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY] -= 31  # Serve times the delay with its own clock
    wanted, _ = policy(_context(seqs(1), [a, b], config=config, target=6, state=state))
    assert wanted == 2


def test_replicas_that_have_not_reported_hold_the_target() -> None:
    topo = topology()
    config = serve_autoscaling_config(topo, "decode")
    a = ReplicaID(unique_id="a", deployment_id=DeploymentID(name="decode", app_name="pdserve"))
    policy = PoolPolicy(**config["policy"]["policy_kwargs"])
    assert policy(_context({}, [a], config=config, target=3))[0] == 3
    assert replica_loads({"running": {a: 4.0}}, [a]) == [ReplicaLoad(running=4.0)]


def test_an_autoscaled_pool_compiles_to_serve_autoscaling_that_serve_accepts() -> None:
    serve_config = compile_serve_config(topology())
    ServeDeploySchema(**serve_config)  # raises on anything Serve would refuse
    deployments = {d["name"]: d for d in serve_config["applications"][0]["deployments"]}
    decode = deployments["decode"]
    assert "num_replicas" not in decode
    auto = decode["autoscaling_config"]
    assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == (1, 2, 6)
    assert auto["look_back_period_s"] == 2 and auto["metrics_interval_s"] == pytest.approx(0.4)
    assert auto["policy"]["policy_function"] == "cluster.autoscaling:PoolPolicy"
    assert "autoscaling_config" not in deployments["registry"]
