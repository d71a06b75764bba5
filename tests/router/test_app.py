"""The router process takes its routing policy from the topology's router section."""

from __future__ import annotations

import msgspec

from cluster.topology import Topology, parse_topology
from router.app import policy_config
from router.policy.cost import CostWeights
from router.policy.selector import PdservePolicyConfig


def test_every_policy_field_of_the_router_section_reaches_the_policy() -> None:
    router = parse_topology(
        "router: {local_prefill_max_tokens: 64, session_affinity: false, balance_weight: 0.1, "
        "churn_weight: 0, prefill_weight: 20, long_stall_weight: 5, long_local_prefill: false, "
        "prefill_overflow_queue_s: null}"
    ).router
    cfg = policy_config(router)
    assert (cfg.local_prefill_max_tokens, cfg.session_affinity) == (64, False)
    assert (cfg.balance_weight, cfg.churn_weight) == (0.1, 0.0)
    assert (cfg.weights.prefill, cfg.weights.long_stall) == (20.0, 5.0)
    assert (cfg.long_local_prefill, cfg.prefill_overflow_queue_s) == (False, None)
    # The cost's other weights and its timing model stay the policy's own.
    assert msgspec.structs.replace(cfg.weights, prefill=5.0, long_stall=20.0) == CostWeights()


def test_a_default_topology_routes_with_the_policys_defaults_but_the_tiny_models_threshold() -> None:
    # local_prefill_max_tokens: 256 for the tiny model's 2048-token context, 1024 in the policy (H200).
    assert policy_config(Topology().router) == PdservePolicyConfig(local_prefill_max_tokens=256)
