"""The policies a replay compares, by name: pdserve's and the baselines, all from `router.policy`."""

from __future__ import annotations

from collections.abc import Callable

from router.policy.baselines import (
    LAUNCHER_DEFAULTS,
    RUST_DEFAULTS,
    DynamoKvPolicy,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    SGLangCacheAwarePolicy,
)
from router.policy.cost import CostWeights
from router.policy.selector import PdservePolicy, PdservePolicyConfig
from router.policy.service_time import ServiceTimeModel
from router.policy.types import Policy

# Builds a fresh policy for one run (policies keep per-session state) given the replay's service-time model:
# pdserve's cost estimates with the very model the simulated engines are timed by.
PolicyFactory = Callable[[ServiceTimeModel], Policy]


def available_policies(local_prefill_max_tokens: int | None = None) -> dict[str, PolicyFactory]:
    """Name -> factory; `local_prefill_max_tokens` is pdserve's (None: PdservePolicyConfig's default)."""
    base = PdservePolicyConfig()
    local = base.local_prefill_max_tokens if local_prefill_max_tokens is None else local_prefill_max_tokens

    def pdserve(timing: ServiceTimeModel) -> Policy:
        return PdservePolicy(
            PdservePolicyConfig(weights=CostWeights(timing=timing), local_prefill_max_tokens=local)
        )

    return {
        "pdserve": pdserve,
        "round_robin": lambda _: RoundRobinPolicy(),
        "least_loaded": lambda _: LeastLoadedPolicy(),
        # SGLang cache-aware: cache threshold / balance abs / balance rel = Rust router defaults
        # 0.5/32/1.1 and Python launcher defaults 0.3/64/1.5.
        "sglang_rust": lambda _: SGLangCacheAwarePolicy(RUST_DEFAULTS),
        "sglang_launcher": lambda _: SGLangCacheAwarePolicy(LAUNCHER_DEFAULTS),
        "dynamo_kv": lambda _: DynamoKvPolicy(),
    }


def select(names: str, local_prefill_max_tokens: int | None = None) -> dict[str, PolicyFactory]:
    """`all` or a comma-separated list of names."""
    known = available_policies(local_prefill_max_tokens)
    if names == "all":
        return known
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {sorted(known)}")
    return {n: known[n] for n in chosen}
