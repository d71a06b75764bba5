"""Baseline routing policies, implemented from their public descriptions for side-by-side evaluation (the
cache-blind ones, round robin and least loaded, are the router's own: router/policy/cache_blind.py).

All baselines are prefill-side policies: they pick the prefill replica by their own rule and the decode
replica by least load (fewest active sequences, then lowest KV usage), and always disaggregate, except that
with no eligible prefill replica the decode replica prefills locally; `dynamo_conditional` picks the decode
replica first and prefills short uncached suffixes on it, as Dynamo's conditional disaggregation does. The
`predicted_*` fields of their decisions come from the shared KV index (the truth the router knows), not from
the baseline's own belief, so hit metrics compare fairly.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated

import msgspec

from router.errors import NoReplicaError
from router.messages import Decision, ReplicaView, RouteRequest
from router.policy.cache_blind import decision_of, least_loaded_decode
from router.policy.cost import cached_tokens
from router.policy.types import PrefixLookup


class SGLangCacheAwareConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Rust router (`CacheAwareConfig::default`) values; see `LAUNCHER_DEFAULTS` for the Python launcher's."""

    cache_threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5
    balance_abs_threshold: Annotated[int, msgspec.Meta(ge=0)] = 32
    balance_rel_threshold: Annotated[float, msgspec.Meta(ge=0)] = 1.1
    # Approximate-tree capacity per worker, in blocks (SGLang bounds characters per tenant: max_tree_size).
    max_tree_blocks: Annotated[int, msgspec.Meta(gt=0)] = 1 << 20
    seed: int = 0


RUST_DEFAULTS = SGLangCacheAwareConfig()
LAUNCHER_DEFAULTS = SGLangCacheAwareConfig(
    cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5
)


class _ApproxTree:
    """Per-worker approximate prefix trees over block hashes, filled by routing decisions (not by engine
    events).

    Equivalent to SGLang's multi-tenant radix tree at block granularity: the block hash chain makes a set of
    hashes a prefix tree. Each tenant keeps its blocks in LRU order (a prompt's path is touched leaf first, so
    the root is the most recent and eviction removes leaves first, as SGLang's leaf-LRU eviction does)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def size(self, tenant: str) -> int:
        return len(self._lru.get(tenant, ()))

    def prefix_match(self, hashes: Sequence[int], tenants: Sequence[str]) -> tuple[int, list[str]]:
        """Longest prefix held by any of `tenants`, and the tenants holding that deepest node."""
        alive = set(tenants)
        depth = 0
        for h in hashes:
            here = self._holders.get(h)
            if here is None:
                break
            nxt = alive & here
            if not nxt:
                break
            alive = nxt
            depth += 1
        return depth, ([t for t in tenants if t in alive] if depth else [])

    def insert(self, hashes: Sequence[int], tenant: str) -> None:
        lru = self._lru.setdefault(tenant, OrderedDict())
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(tenant)
        while len(lru) > self.capacity:
            h, _ = lru.popitem(last=False)
            holders = self._holders[h]
            holders.discard(tenant)
            if not holders:
                del self._holders[h]


class SGLangCacheAwarePolicy:
    """SGLang router's `cache_aware` policy (sgl-router `policies/cache_aware.rs` and `policies/tree.rs`).

    Followed: load = in-flight requests per prefill worker; the system is imbalanced when
    `max - min > balance_abs_threshold` and `max > min * balance_rel_threshold`; then the least-loaded worker
    is chosen (and the prompt still inserted into its tree). Otherwise the worker at the deepest node of the
    approximate tree is taken if `matched / prompt length > cache_threshold`, else the worker with the
    smallest tree; the prompt is inserted into the chosen worker's tree. In PD mode decode is chosen by least
    load. Differences: matching is on token blocks (SGLang matches characters of the request text); ties among
    the tenants of the deepest node are broken uniformly at random (SGLang takes the first key of a hash map,
    an arbitrary fixed order); the tree is trimmed to capacity on insert (SGLang trims every
    eviction_interval).
    """

    name = "sglang_cache_aware"

    def __init__(self, config: SGLangCacheAwareConfig | None = None) -> None:
        self.config = config or RUST_DEFAULTS
        self._tree = _ApproxTree(self.config.max_tree_blocks)
        self._rng = random.Random(self.config.seed)

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        d = least_loaded_decode(decode)
        pres = [p for p in prefill if p.eligible]
        if not pres:
            return decision_of(req, None, d, cache, 0.0, "")
        cfg = self.config
        loads = [p.queued_prefill_requests for p in pres]
        hi, lo = max(loads), min(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            chosen = min(pres, key=lambda p: p.queued_prefill_requests)
            reason = "sglang_balance"
            rate = 0.0
        else:
            ids = [p.replica_id for p in pres]
            depth, tenants = self._tree.prefix_match(req.block_hashes, ids)
            n = req.num_prompt_tokens
            rate = depth * req.block_size / n if n else 0.0
            if rate > cfg.cache_threshold and tenants:
                cid = tenants[0] if len(tenants) == 1 else self._rng.choice(tenants)
                reason = "sglang_cache_hit"
            else:
                cid = min(ids, key=self._tree.size)
                reason = "sglang_smallest_tree"
            chosen = next(p for p in pres if p.replica_id == cid)
        self._tree.insert(req.block_hashes, chosen.replica_id)
        return decision_of(req, chosen, d, cache, rate, reason)

    def on_finish(self, req: RouteRequest, d: Decision) -> None:
        return None


class DynamoKvConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    overlap_score_weight: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # 0: deterministic argmin (Dynamo's default); > 0: softmax sampling over normalised costs.
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    seed: int = 0


class DynamoKvPolicy:
    """Dynamo's KV router cost (docs/router design, `kv-router` selector).

    Per prefill worker: `logit = overlap_score_weight * potential_prefill_blocks + potential_decode_blocks`
    with potential_prefill_blocks = (worker's queued prefill tokens + this prompt's tokens not in its cache) /
    block_size and potential_decode_blocks = blocks the worker would hold for active requests with this one
    added; the lowest logit wins (temperature 0, Dynamo's default; ties at random). Overlap comes from the KV
    index (Dynamo's KvIndexer is also fed by engine events). Approximation: a prefill worker's active blocks
    are taken as (queued prefill tokens + this prompt's tokens) / block_size, since the router tracks queued
    tokens rather than per-request block sets. Decode: least loaded (Dynamo runs its decode router with
    overlap weight 0).
    """

    name = "dynamo_kv"

    def __init__(self, config: DynamoKvConfig | None = None) -> None:
        self.config = config or DynamoKvConfig()
        self._rng = random.Random(self.config.seed)

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        d = least_loaded_decode(decode)
        pres = [p for p in prefill if p.eligible]
        if not pres:
            return decision_of(req, None, d, cache, 0.0, "")
        bs, n = req.block_size, req.num_prompt_tokens
        overlap = cache.matched_blocks(req.block_hashes, [p.replica_id for p in pres])
        logits = []
        for p in pres:
            new_tokens = max(n - overlap[p.replica_id] * bs, 0)
            prefill_blocks = (p.queued_prefill_tokens + new_tokens) / bs
            decode_blocks = (p.queued_prefill_tokens + n) // bs
            logits.append(self.config.overlap_score_weight * prefill_blocks + decode_blocks)
        i = self._select(logits)
        return decision_of(req, pres[i], d, cache, logits[i], "dynamo_kv")

    def _select(self, logits: list[float]) -> int:
        t = self.config.temperature
        if t == 0:
            best = min(logits)
            ties = [i for i, x in enumerate(logits) if x == best]
            return ties[0] if len(ties) == 1 else self._rng.choice(ties)
        # Softmax over costs normalised to [0, 1] (lower cost -> higher probability).
        lo, hi = min(logits), max(logits)
        span = (hi - lo) or 1.0
        weights = [math.exp(-((x - lo) / span) / t) for x in logits]
        return self._rng.choices(range(len(logits)), weights=weights)[0]

    def on_finish(self, req: RouteRequest, d: Decision) -> None:
        return None


class DynamoConditionalConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    # Dynamo's disaggregation rule: prefill remotely only when the uncached suffix is longer than this...
    max_local_prefill_length: Annotated[int, msgspec.Meta(ge=0)] = 1000
    # ... and the prefill queue (requests waiting, all prefill workers) is shorter than this.
    max_prefill_queue_size: Annotated[int, msgspec.Meta(ge=0)] = 2
    overlap_score_weight: Annotated[float, msgspec.Meta(ge=0)] = 1.0


class DynamoConditionalPolicy:
    """Dynamo with conditional disaggregation (its disaggregated router): the KV router picks the decode
    worker (its cost over decode workers: `overlap_score_weight * blocks to prefill + active blocks`), and
    that worker prefills locally unless the prompt's uncached suffix on it is longer than
    `max_local_prefill_length` and the prefill queue is shorter than `max_prefill_queue_size`; a remote
    prefill goes to the prefill worker Dynamo's KV cost picks (as `DynamoKvPolicy`). Defaults are Dynamo's.
    """

    name = "dynamo_conditional"

    def __init__(self, config: DynamoConditionalConfig | None = None) -> None:
        self.config = config or DynamoConditionalConfig()
        self._prefill = DynamoKvPolicy(DynamoKvConfig(overlap_score_weight=self.config.overlap_score_weight))

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        decs = [d for d in decode if d.eligible]
        if not decs:
            raise NoReplicaError("no ready decode replica")
        bs, n = req.block_size, req.num_prompt_tokens
        overlap = cache.matched_blocks(req.block_hashes, [d.replica_id for d in decs])
        w = self.config.overlap_score_weight

        def logit(d: ReplicaView) -> float:
            new_tokens = max(n - overlap[d.replica_id] * bs, 0)
            return w * new_tokens / bs + (d.active_context_tokens + n) // bs

        d = min(decs, key=lambda x: (logit(x), x.active_seqs))
        uncached = n - cached_tokens(overlap[d.replica_id], bs, n)
        pres = [p for p in prefill if p.eligible]
        queued = sum(p.queued_prefill_requests for p in pres)
        remote = bool(pres) and uncached > self.config.max_local_prefill_length
        if not remote or queued >= self.config.max_prefill_queue_size * max(1, len(pres)):
            return decision_of(req, None, d, cache, logit(d), "dynamo_local")
        remote_choice = self._prefill.choose(req, pres, [d], cache)
        return msgspec.structs.replace(remote_choice, reason="dynamo_conditional")

    def on_finish(self, req: RouteRequest, d: Decision) -> None:
        return None
