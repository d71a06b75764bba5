"""The policies a replay compares, by name: pdserve's and the baselines, all from `router.policy`."""

from __future__ import annotations

from collections.abc import Callable

from bench.replay.baselines import (
    LAUNCHER_DEFAULTS,
    RUST_DEFAULTS,
    DynamoConditionalPolicy,
    DynamoKvPolicy,
    SGLangCacheAwarePolicy,
)
from router.config import RouterConfig
from router.policy.cache_blind import LeastLoadedPolicy, RoundRobinPolicy, SessionHashPolicy
from router.policy.selector import PdservePolicy
from router.policy.types import Policy
from router.service_time import Timing

# Builds a fresh policy for one run (policies keep per-session state) given the replay's service-time model:
# pdserve's cost estimates with the very model the simulated engines are timed by.
PolicyFactory = Callable[[Timing], Policy]


def describe_pdserve(cfg: RouterConfig) -> str:
    """The settings a replay's pdserve numbers depend on, for the report."""
    overflow = cfg.prefill_overflow_queue_s
    return (
        f"pdserve: mode {cfg.mode}, local_prefill_max_tokens {cfg.local_prefill_max_tokens}, prefill weight "
        f"{cfg.prefill_weight:g}, balance {cfg.balance_weight:g}, churn {cfg.churn_weight:g}, "
        f"decode inter-token SLO {cfg.tpot_slo_ms:g} ms, "
        f"prefill overflow {'off' if overflow is None else f'at {overflow:g} s queued'}"
    )


def available_policies(router: RouterConfig | None = None) -> dict[str, PolicyFactory]:
    """Name -> factory; pdserve runs with `router` (a topology's router section; default: the defaults)."""
    cfg = router or RouterConfig()

    def pdserve(timing: Timing) -> Policy:
        return PdservePolicy(cfg, timing)

    return {
        "pdserve": pdserve,
        "round_robin": lambda _: RoundRobinPolicy(),
        "least_loaded": lambda _: LeastLoadedPolicy(),
        "session_hash": lambda _: SessionHashPolicy(),
        # SGLang cache-aware: cache threshold / balance abs / balance rel = Rust router defaults
        # 0.5/32/1.1 and Python launcher defaults 0.3/64/1.5.
        "sglang_rust": lambda _: SGLangCacheAwarePolicy(RUST_DEFAULTS),
        "sglang_launcher": lambda _: SGLangCacheAwarePolicy(LAUNCHER_DEFAULTS),
        "dynamo_kv": lambda _: DynamoKvPolicy(),
        "dynamo_conditional": lambda _: DynamoConditionalPolicy(),
    }


def select(names: str, router: RouterConfig | None = None) -> dict[str, PolicyFactory]:
    """`all` or a comma-separated list of names."""
    known = available_policies(router)
    if names == "all":
        return known
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {sorted(known)}")
    return {n: known[n] for n in chosen}
