"""The policies a replay compares, by name: pdserve's and the baselines, all from `router.policy`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from router.policy.baselines import (
    LAUNCHER_DEFAULTS,
    RUST_DEFAULTS,
    DynamoKvPolicy,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    SGLangCacheAwarePolicy,
)
from router.policy.selector import PdservePolicy, PdservePolicyConfig
from router.policy.service_time import ServiceTimeModel
from router.policy.types import Policy

# Builds a fresh policy for one run (policies keep per-session state) given the replay's service-time model:
# pdserve's cost estimates with the very model the simulated engines are timed by.
PolicyFactory = Callable[[ServiceTimeModel], Policy]


# PdservePolicyConfig fields a replay sets from its command line (e.g. local_prefill_max_tokens).
PdserveOverrides = Mapping[str, Any]


def pdserve_config(
    overrides: PdserveOverrides | None = None, timing: ServiceTimeModel | None = None
) -> PdservePolicyConfig:
    """pdserve's policy as the replay runs it: the defaults with `overrides`, costed with the replay's
    service-time model. Overrides are validated as a topology's router section is (msgspec.ValidationError,
    a ValueError, naming the field)."""
    cfg = msgspec.convert(dict(overrides or {}), PdservePolicyConfig)
    if timing is not None:
        cfg = msgspec.structs.replace(cfg, weights=msgspec.structs.replace(cfg.weights, timing=timing))
    return cfg


def describe_pdserve(cfg: PdservePolicyConfig) -> str:
    """The settings a replay's pdserve numbers depend on, for the report."""
    overflow = cfg.prefill_overflow_queue_s
    return (
        f"pdserve: local_prefill_max_tokens {cfg.local_prefill_max_tokens}, prefill weight "
        f"{cfg.weights.prefill:g}, balance {cfg.balance_weight:g}, churn {cfg.churn_weight:g}, "
        f"long local prefill {f'stall x{cfg.weights.long_stall:g}' if cfg.long_local_prefill else 'off'}, "
        f"prefill overflow {'off' if overflow is None else f'at {overflow:g} s queued'}"
    )


def available_policies(pdserve_overrides: PdserveOverrides | None = None) -> dict[str, PolicyFactory]:
    """Name -> factory; `pdserve_overrides` change PdservePolicyConfig's defaults (checked here)."""
    pdserve_config(pdserve_overrides)

    def pdserve(timing: ServiceTimeModel) -> Policy:
        return PdservePolicy(pdserve_config(pdserve_overrides, timing))

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


def select(names: str, pdserve_overrides: PdserveOverrides | None = None) -> dict[str, PolicyFactory]:
    """`all` or a comma-separated list of names."""
    known = available_policies(pdserve_overrides)
    if names == "all":
        return known
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {sorted(known)}")
    return {n: known[n] for n in chosen}
