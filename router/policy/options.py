"""The ways one request can be served, each scored by `router.policy.cost`:

- **disaggregated**: a prefill replica P computes the prompt (from its cached prefix, or one it pulls:
  `router.policy.pull`), the KV moves to decode replica D;
- **local prefill** on D (no transfer, no second hop; D's batch waits, the stall term), offered when
  * the uncached suffix is at most `local_prefill_max_tokens` (`local_prefill`; then it is D's only option),
  * every prefill replica is `prefill_overflow_queue_s` behind (`prefill_overflow`, stall weighted as short),
  * in mode `auto` otherwise too (`long_local_prefill`, stall weighted `long_stall`): a session's next turn
    on the replica holding a 100k-token context computes its tool result in well under a second, while a
    prefill replica lacking the context recomputes all of it;
  * no prefill replica is eligible (`no_prefill_replica`).
In mode `disaggregate` only the last of these.

`candidate_options` lists what the selector compares. Its P, D search is O(|P| + |D|), not O(|P||D|): the
cost splits into P's part, D's part and a transfer whose link depends only on whether P and D share a node,
so the best P for any D is the best P overall or the best P on D's node. `every_option` lists every pair (for
tests: the search must find its optimum).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import msgspec

from router.config import RouterConfig
from router.policy.cost import (
    CostWeights,
    Terms,
    decode_term,
    estimated_prefill_s,
    queue_term,
    queued_prefill_s,
    stall_term,
    transfer_term,
)
from router.policy.pull import Pull, pull_term, starts_from
from router.policy.recent_work import RecentWork, pick
from router.policy.types import ReplicaView

Kind = Literal[
    "disaggregated", "local_prefill", "long_local_prefill", "prefill_overflow", "no_prefill_replica"
]


class Option(msgspec.Struct, frozen=True, kw_only=True):
    kind: Kind
    decode: ReplicaView
    computing: ReplicaView  # the prefill replica, or `decode` itself for a local prefill
    cached: int  # prompt tokens `computing` starts from (its own prefix or a pulled one)
    pulled: int  # of `cached`, those pulled from a prefix source
    own_s: float  # unweighted seconds `computing` spends on the prompt
    terms: Terms
    total: float

    @property
    def local(self) -> bool:
        return self.computing is self.decode


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """The request as the options see it."""

    tokens: int
    max_tokens: int
    block_size: int
    matched: Mapping[str, int]  # leading blocks each replica holds

    @property
    def most(self) -> int:
        """Cacheable tokens: all but the block holding the last token (vLLM computes at least that)."""
        return (self.tokens - 1) // self.block_size * self.block_size if self.tokens > 0 else 0

    def cached(self, replica_id: str) -> int:
        return min(self.matched[replica_id] * self.block_size, self.most)


class Balance(msgspec.Struct, frozen=True):
    """The charges on recent work above the prefill pool's mean (`router.balance_weight`, `churn_weight`)."""

    seconds: RecentWork
    tokens: RecentWork
    seconds_weight: float
    tokens_weight: float


class Scorer:
    """Scores options for one request; prefill estimates are shared between replicas with equal prefixes."""

    def __init__(self, w: CostWeights, prompt: Prompt, pull: Pull | None) -> None:
        self.w = w
        self.prompt = prompt
        self.pull = pull
        self._prefill_s: dict[int, float] = {}

    def own_s(self, cached: int) -> float:
        s = self._prefill_s.get(cached)
        if s is None:
            s = self._prefill_s[cached] = estimated_prefill_s(self.w.timing, self.prompt.tokens, cached)
        return s

    def prefill_side(self, p: ReplicaView, balance: float = 0.0, churn: float = 0.0) -> Option:
        """P's part of a disaggregated option (decode and transfer terms still 0)."""
        own = self.prompt.cached(p.replica_id)
        start = starts_from(self.w, self.pull, p, own)
        own_s = self.own_s(start)
        terms = Terms(
            prefill=self.w.prefill * own_s,
            queue=queue_term(self.w, p),
            pull=pull_term(self.w, self.pull, p, start - own),
            balance=balance,
            churn=churn,
        )
        return Option(
            kind="disaggregated",
            decode=p,
            computing=p,
            cached=start,
            pulled=start - own,
            own_s=own_s,
            terms=terms,
            total=terms.total,
        )

    def disaggregated(self, side: Option, d: ReplicaView, decode_s: float) -> Option:
        p = side.computing
        within = p.node_id is not None and p.node_id == d.node_id
        move = transfer_term(self.w, self.prompt.tokens - self.prompt.cached(d.replica_id), within)
        terms = msgspec.structs.replace(side.terms, decode=decode_s, transfer=move)
        return msgspec.structs.replace(side, decode=d, terms=terms, total=terms.total)

    def local(self, d: ReplicaView, kind: Kind, decode_s: float) -> Option:
        cached = self.prompt.cached(d.replica_id)
        own_s = self.own_s(cached)
        terms = Terms(
            prefill=self.w.prefill * own_s,
            queue=queue_term(self.w, d),
            decode=decode_s,
            stall=stall_term(self.w, d, own_s, long=kind == "long_local_prefill"),
        )
        return Option(
            kind=kind,
            decode=d,
            computing=d,
            cached=cached,
            pulled=0,
            own_s=own_s,
            terms=terms,
            total=terms.total,
        )


def candidate_options(
    cfg: RouterConfig,
    scorer: Scorer,
    prefill: Sequence[ReplicaView],
    decode: Sequence[ReplicaView],
    balance: Balance,
) -> list[Option]:
    """The options the selector compares: for each decode replica in `decode`, its local prefill where
    offered and its best disaggregated option. `prefill`, `decode`: eligible replicas."""
    w, prompt = scorer.w, scorer.prompt
    n, short_max = prompt.tokens, cfg.local_prefill_max_tokens
    auto = cfg.mode == "auto"

    def short(d: ReplicaView) -> bool:
        return auto and n - prompt.cached(d.replica_id) <= short_max

    best: Option | None = None
    best_on_node: dict[str, Option] = {}
    overflow = False
    if prefill and not all(short(d) for d in decode):
        sides = _prefill_sides(scorer, prefill, balance)
        limit = cfg.prefill_overflow_queue_s
        overflow = auto and limit is not None and min(queued_prefill_s(w.timing, p) for p in prefill) >= limit
        best = sides[_pick_option(sides, balance.seconds)]
        nodes = {d.node_id for d in decode if d.node_id is not None}
        groups: dict[str, list[Option]] = {}
        for side in sides:
            node = side.computing.node_id
            if node in nodes:
                groups.setdefault(node, []).append(side)
        for node, group in groups.items():
            best_on_node[node] = group[_pick_option(group, balance.seconds)]

    out: list[Option] = []
    for d in decode:
        decode_s = decode_term(w, d, n, prompt.max_tokens)
        if best is None:
            out.append(scorer.local(d, "local_prefill" if prefill else "no_prefill_replica", decode_s))
            continue
        if short(d):
            out.append(scorer.local(d, "local_prefill", decode_s))
            continue
        if overflow or auto:
            out.append(scorer.local(d, "prefill_overflow" if overflow else "long_local_prefill", decode_s))
        option = scorer.disaggregated(best, d, decode_s)
        near = best_on_node.get(d.node_id) if d.node_id is not None else None
        if near is not None and near.computing is not best.computing:
            nearer = scorer.disaggregated(near, d, decode_s)
            if nearer.total < option.total:
                option = nearer
        out.append(option)
    return out


def every_option(
    cfg: RouterConfig,
    scorer: Scorer,
    prefill: Sequence[ReplicaView],
    decode: Sequence[ReplicaView],
    balance: Balance,
) -> list[Option]:
    """Every (P, D) pair and every offered local prefill: what `candidate_options` must find the best of."""
    prompt = scorer.prompt
    auto = cfg.mode == "auto"
    sides = _prefill_sides(scorer, prefill, balance) if prefill else []
    limit = cfg.prefill_overflow_queue_s
    w = scorer.w
    overflow = (
        auto
        and bool(prefill)
        and limit is not None
        and min(queued_prefill_s(w.timing, p) for p in prefill) >= limit
    )
    out = []
    for d in decode:
        decode_s = decode_term(w, d, prompt.tokens, prompt.max_tokens)
        if not prefill:
            out.append(scorer.local(d, "no_prefill_replica", decode_s))
            continue
        if auto and prompt.tokens - prompt.cached(d.replica_id) <= cfg.local_prefill_max_tokens:
            out.append(scorer.local(d, "local_prefill", decode_s))
            continue
        if auto:
            out.append(scorer.local(d, "prefill_overflow" if overflow else "long_local_prefill", decode_s))
        out.extend(scorer.disaggregated(side, d, decode_s) for side in sides)
    return out


def _prefill_sides(scorer: Scorer, prefill: Sequence[ReplicaView], balance: Balance) -> list[Option]:
    n = len(prefill)
    zero = [0.0] * n
    spread = n > 1
    charges = (
        balance.seconds.above_mean(prefill, balance.seconds_weight)
        if spread and balance.seconds_weight
        else zero
    )
    churns = (
        balance.tokens.above_mean(prefill, balance.tokens_weight)
        if spread and balance.tokens_weight
        else zero
    )
    return [scorer.prefill_side(p, b, c) for p, b, c in zip(prefill, charges, churns, strict=True)]


def _pick_option(
    options: Sequence[Option], recent: RecentWork, by: Callable[[Option], ReplicaView] | None = None
) -> int:
    replicas = [o.computing if by is None else by(o) for o in options]
    return pick(replicas, [o.total for o in options], recent)
