"""The pools' autoscaling policy: what each pool's load needs, the warm buffer, and the policy as Serve's
controller runs it (its own bounds and delays around ours)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray.serve.schema import ServeDeploySchema

from cluster.autoscaling import (
    BUSY_TARGET,
    HeldNeed,
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
    assert wanted(PREFILL, busy) == 3
    # 21 s queued where each may hold 0.5 s: the 20 s beyond drain within the TTFT SLO after a new
    # replica's start (2 + 8 s), which takes two more.
    queued = [ReplicaLoad(queued_prefill_s=10.5, busy=1.0, start_s=8.0)] * 2
    assert needed_replicas(PREFILL, queued) == pytest.approx(2 / BUSY_TARGET + 20 / 10)
    # Half busy, no queue: one replica is enough.
    assert wanted(PREFILL, [ReplicaLoad(busy=0.45 * BUSY_TARGET)] * 2) == 1
    assert wanted(PREFILL, [ReplicaLoad(), ReplicaLoad()]) == 0  # idle: the bounds keep the minimum


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
    assert wanted(DECODE, loads) == 2
    assert wanted(warm, loads) == 4


def wanted(targets: ScaleTargets, loads: list[ReplicaLoad]) -> int:
    return wanted_replicas(targets, needed_replicas(targets, loads))


def test_a_need_is_held_for_the_scale_down_delay_so_a_lull_drains_nothing() -> None:
    held = HeldNeed(60.0, [(0.0, 4.0)])  # the pool starts at 4: held as if needed
    assert held.add(10.0, 1.0) == 4.0
    assert held.add(59.0, 3.0) == 4.0
    assert held.add(61.0, 2.0) == 3.0  # the start's 4 is older than the hold; 3 (at 59 s) is the most since
    assert held.add(70.0, 6.0) == 6.0  # up at once
    assert held.add(100.0, 1.0) == 6.0  # a lull between two busy minutes
    assert held.add(131.0, 1.5) == 1.5  # a quiet that lasted the hold
    assert len(held.peaks) == 1  # only samples that may still be the most are kept


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
        current_time=kw.pop("now", None),
        config=config,
    )


def test_serve_runs_the_policy_at_once_up_and_down_after_the_peak_is_older_than_the_delay() -> None:
    topo = topology(downscale_delay_s=30)
    config = serve_autoscaling_config(topo, "decode")
    assert config["downscale_delay_s"] == 0  # the policy holds the need: Serve adds no delay of its own
    policy = _apply_autoscaling_config(_resolve_policy_callable(AutoscalingConfig(**config).policy))
    decode = DeploymentID(name="decode", app_name="pdserve")
    a, b = (ReplicaID(unique_id=u, deployment_id=decode) for u in "ab")

    def seqs(n: float) -> dict[str, dict[ReplicaID, float]]:
        return {"running": {a: n, b: n}, "step_s": {a: 0.02, b: 0.02}}

    # 2 x 20 sequences / 8 a replica = 5 (+1 warm), at once.
    wanted, state = policy(_context(seqs(20), [a, b], config=config, now=1000.0))
    assert wanted == 6 and state["pdserve_need"] == pytest.approx(5.0)
    # Quiet: 1 sequence each needs 1 replica (+1 warm), but only once the peak is older than the delay.
    wanted, state = policy(_context(seqs(1), [a, b], config=config, target=6, state=state, now=1029.0))
    assert wanted == 6
    wanted, _ = policy(_context(seqs(1), [a, b], config=config, target=6, state=state, now=1031.0))
    assert wanted == 2


def test_the_count_a_pool_starts_with_is_held_for_the_delay() -> None:
    config = serve_autoscaling_config(topology(downscale_delay_s=30), "decode")
    policy = PoolPolicy(**config["policy"]["policy_kwargs"])
    a = ReplicaID(unique_id="a", deployment_id=DeploymentID(name="decode", app_name="pdserve"))
    idle = {"running": {a: 0.0}}
    # Started at 4 (3 + 1 warm): an idle first answer keeps 3 needed until the delay has passed.
    wanted, state = policy(_context(idle, [a], config=config, target=4, now=0.0))
    assert wanted == 4
    assert policy(_context(idle, [a], config=config, target=4, state=state, now=31.0))[0] == 1


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
