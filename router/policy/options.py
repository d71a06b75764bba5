"""The ways one request can be served, each scored by `router.policy.cost`:

- **disaggregated**: a prefill replica P computes the prompt (from its cached prefix, or one it pulls:
  `router.policy.pull`), the KV moves to decode replica D;
- **local prefill** on D (no transfer, no second hop; D's batch slows while it runs: the stall term), offered
  when
  * the uncached suffix is at most `local_prefill_max_tokens` (`local_prefill`; then it is D's only option
    unless it would slow D's running sequences past the inter-token SLO, `router.tpot_slo_ms`),
  * every prefill replica is `prefill_overflow_queue_s` behind (`prefill_overflow`),
  * in mode `auto` otherwise too (`long_local_prefill`): a session's next turn on the replica holding a
    100k-token context computes its tool result in well under a second, while a prefill replica lacking the
    context recomputes all of it;
  * no prefill replica is eligible (`no_prefill_replica`).
In mode `disaggregate` only the last of these.

`candidate_options` lists what the selector compares. Its P, D search is O(|P| + |D|), not O(|P||D|): the
cost splits into P's part, D's part and a transfer whose link depends only on whether P and D share a node,
so the best P for any D is the best P overall or the best P on D's node. `every_option` lists every pair (for
tests: the search must find its optimum).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple, overload

import msgspec

from router.config import RouterConfig
from router.messages import ReplicaView, Terms
from router.policy.cost import (
    CostWeights,
    breaks_slo,
    decode_term,
    estimated_prefill_s,
    queued_prefill_s,
    same_node,
    stall_term,
    transfer_term,
    wait_term,
)
from router.policy.pull import Pull, pull_term, starts_from
from router.policy.recent_work import TIE_TOLERANCE_S, RecentWork, pick

Kind = Literal[
    "disaggregated", "local_prefill", "long_local_prefill", "prefill_overflow", "no_prefill_replica"
]


class Option(msgspec.Struct, frozen=True, gc=False):
    """One way to serve the request and its cost, term by term (`router.policy.cost`; weighted seconds)."""

    kind: Kind
    decode: ReplicaView
    computing: ReplicaView  # the prefill replica, or `decode` itself for a local prefill
    cached: int  # prompt tokens `computing` starts from (its own prefix or a pulled one)
    pulled: int  # of `cached`, those pulled from a prefix source
    own_s: float  # unweighted seconds `computing` spends on the prompt
    prefill: float
    queue: float
    pull: float
    balance: float
    churn: float
    decode_s: float
    transfer: float
    stall: float
    total: float  # Terms.total: the terms added in its order

    @property
    def local(self) -> bool:
        return self.computing is self.decode

    @property
    def terms(self) -> Terms:
        return Terms(
            prefill=self.prefill,
            queue=self.queue,
            pull=self.pull,
            balance=self.balance,
            churn=self.churn,
            decode=self.decode_s,
            transfer=self.transfer,
            stall=self.stall,
        )


class Prompt:
    """The request as the options see it."""

    __slots__ = ("block_size", "matched", "max_tokens", "most", "tokens")

    def __init__(self, *, tokens: int, max_tokens: int, block_size: int, matched: Mapping[str, int]) -> None:
        """`matched`: leading blocks each replica holds."""
        self.tokens = tokens
        self.max_tokens = max_tokens
        self.block_size = block_size
        # Cacheable tokens: all but the block holding the last token (vLLM computes at least that).
        self.most = (tokens - 1) // block_size * block_size if tokens > 0 else 0
        self.matched = matched

    def cached(self, replica_id: str) -> int:
        """Prompt tokens `replica_id`'s prefix cache can supply."""
        return min(self.matched[replica_id] * self.block_size, self.most)

    def cached_on(self, replicas: Sequence[ReplicaView]) -> list[int]:
        """`cached` of each replica (in one pass: a decision asks it of every replica it scores)."""
        m, bs, most = self.matched, self.block_size, self.most
        return [min(m[r.replica_id] * bs, most) for r in replicas]


class Balance(msgspec.Struct, frozen=True):
    """The charges on recent work above the prefill pool's mean (`router.balance_weight`, `churn_weight`)."""

    seconds: RecentWork
    tokens: RecentWork
    seconds_weight: float
    tokens_weight: float


class PrefillSides(NamedTuple):
    """The prefill replicas' parts of their disaggregated options, one list entry per replica (its other
    terms, derived from these, are filled in for the options built: `Scorer.disaggregated`)."""

    replicas: Sequence[ReplicaView]
    held: list[int]  # tokens its own prefix cache holds
    start: list[int]  # tokens it starts from (its own or a pulled prefix)
    own_s: list[float]
    queued: list[float]  # estimated seconds queued on it (unweighted)
    prefill: list[float]  # the prefill term (with the copy charge)
    queue: list[float]  # the queue term (its wait)
    balance: list[float]
    churn: list[float]
    total: list[float]  # the part's terms added up

    def pick(self, recent: RecentWork, among: Sequence[int] | None = None) -> int:
        """The best replica's index (ties to the least recent work), among `among` (default: all)."""
        if among is None:
            return pick(self.replicas, self.total, recent)
        k = pick([self.replicas[i] for i in among], [self.total[i] for i in among], recent)
        return among[k]


class Scorer:
    """Scores options for one request; prefill estimates are shared between replicas with equal prefixes."""

    def __init__(
        self, w: CostWeights, prompt: Prompt, pull: Pull | None, *, continuing: bool = False
    ) -> None:
        """`continuing`: the request is the next turn of a session the router has placed (its cached prefix
        is the session's own: no copy charge, `router.policy.cost`)."""
        self.w = w
        self.prompt = prompt
        self.pull = pull
        self.continuing = continuing
        self._prefill_s: dict[int, float] = {}

    def own_s(self, cached: int) -> float:
        s = self._prefill_s.get(cached)
        if s is None:
            s = self._prefill_s[cached] = estimated_prefill_s(self.w.timing, self.prompt.tokens, cached)
        return s

    # Options are built positionally, each total added up in Terms.total's order as the terms are known (a
    # term that is 0 adds nothing; the prefill replicas' parts as lists): a decision builds a few per decode
    # replica, on the request's path.

    def prefill_sides(self, prefill: Sequence[ReplicaView], balance: Balance) -> PrefillSides:
        """Each prefill replica's part of a disaggregated option (decode and transfer terms to come)."""
        w, pull = self.w, self.pull
        n = len(prefill)
        spread = n > 1
        zero = [0.0] * n
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
        held = self.prompt.cached_on(prefill)
        start = (
            held if pull is None else [starts_from(w, pull, p, c) for p, c in zip(prefill, held, strict=True)]
        )
        own_s = [self.own_s(c) for c in start]
        f = w.prefill
        copy = w.prefill if self.continuing else w.copy
        if copy == f:
            prefills = [f * s for s in own_s]
        else:
            cheapest = min(own_s)
            prefills = [f * cheapest + copy * (s - cheapest) for s in own_s]
        queued = [queued_prefill_s(w.timing, p) for p in prefill]
        queues = [wait_term(w, t, s) for t, s in zip(queued, own_s, strict=True)]
        if pull is None:
            totals = [a + q + b + c for a, q, b, c in zip(prefills, queues, charges, churns, strict=True)]
        else:
            pulls = [pull_term(w, pull, p, s - c) for p, s, c in zip(prefill, start, held, strict=True)]
            totals = [
                a + q + x + b + c
                for a, q, x, b, c in zip(prefills, queues, pulls, charges, churns, strict=True)
            ]
        return PrefillSides(prefill, held, start, own_s, queued, prefills, queues, charges, churns, totals)

    def disaggregated(
        self, sides: PrefillSides, i: int, d: ReplicaView, d_cached: int, decode_s: float
    ) -> Option:
        """Prefill replica `sides.replicas[i]` computes the prompt, `d` (holding `d_cached` tokens) decodes
        it."""
        w, p = self.w, sides.replicas[i]
        move = transfer_term(w, self.prompt.tokens - d_cached, same_node(p, d))
        start, s = sides.start[i], sides
        pulled = start - s.held[i]
        pulling = pull_term(w, self.pull, p, pulled)
        return Option(
            "disaggregated", d, p, start, pulled, s.own_s[i], s.prefill[i], s.queue[i],
            pulling, s.balance[i], s.churn[i], decode_s, move, 0.0, s.total[i] + decode_s + move,
        )  # fmt: skip

    @overload
    def local(self, d: ReplicaView, cached: int, kind: Kind, decode_s: float) -> Option: ...

    @overload
    def local(
        self, d: ReplicaView, cached: int, kind: Kind, decode_s: float, above: float
    ) -> Option | None: ...

    def local(
        self, d: ReplicaView, cached: int, kind: Kind, decode_s: float, above: float = math.inf
    ) -> Option | None:
        """`d`, holding `cached` tokens, computes the prompt itself and decodes it. None when it costs more
        than `above` without its queue term (which only adds)."""
        w = self.w
        own_s = self.own_s(cached)
        prefill = w.prefill * own_s
        stall = stall_term(
            w, d, self.prompt.tokens - cached, cached, own_s, overflow=kind == "prefill_overflow"
        )
        if prefill + decode_s + stall > above:
            return None
        queue = w.queue * queued_prefill_s(w.timing, d)  # its own wall is in the stall term
        return Option(
            kind, d, d, cached, 0, own_s, prefill, queue, 0.0, 0.0, 0.0, decode_s, 0.0, stall,
            prefill + queue + decode_s + stall,
        )  # fmt: skip


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
    held = prompt.cached_on(decode)
    # Whether each decode replica holds all but a short suffix whose prefill there keeps its running
    # sequences within the inter-token SLO (then that local prefill is its only option).
    shorts = [
        auto and n - c <= short_max and not breaks_slo(w, d, n - c, c, scorer.own_s(c))
        for d, c in zip(decode, held, strict=True)
    ]

    sides: PrefillSides | None = None
    best = -1
    best_on_node: dict[str, int] = {}
    overflow = False
    if prefill and not all(shorts):
        sides = scorer.prefill_sides(prefill, balance)
        limit = cfg.prefill_overflow_queue_s
        overflow = auto and limit is not None and min(sides.queued) >= limit
        best = sides.pick(balance.seconds)
        nodes = {d.node_id for d in decode if d.node_id is not None}
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prefill):
            if p.node_id in nodes:
                groups.setdefault(p.node_id, []).append(i)
        for node, group in groups.items():
            best_on_node[node] = sides.pick(balance.seconds, group)

    out: list[Option] = []
    lowest = math.inf  # the lowest total among the options listed so far
    for d, c, short in zip(decode, held, shorts, strict=True):
        decode_s = decode_term(w, d, n, prompt.max_tokens)
        if sides is None:
            out.append(scorer.local(d, c, "local_prefill" if prefill else "no_prefill_replica", decode_s))
            continue
        if short:
            only = scorer.local(d, c, "local_prefill", decode_s)
            out.append(only)
            lowest = min(lowest, only.total)
            continue
        option = scorer.disaggregated(sides, best, d, c, decode_s)
        near = best_on_node.get(d.node_id, best) if d.node_id is not None else best
        if near != best:
            nearer = scorer.disaggregated(sides, near, d, c, decode_s)
            if nearer.total < option.total:
                option = nearer
        lowest = min(lowest, option.total)
        if overflow or auto:
            # Not offered when it cannot be chosen: more than the tie tolerance above an option already
            # found (the selector picks within it of the lowest). A cold prompt's prefill on a decode
            # replica, stalling its batch, rarely is; skipping it keeps a first turn's search cheap.
            kind: Kind = (
                "local_prefill"
                if auto and n - c <= short_max
                else "prefill_overflow"
                if overflow
                else "long_local_prefill"
            )
            local = scorer.local(d, c, kind, decode_s, above=lowest + TIE_TOLERANCE_S)
            if local is not None:
                out.append(local)
                lowest = min(lowest, local.total)
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
    sides = scorer.prefill_sides(prefill, balance) if prefill else None
    limit = cfg.prefill_overflow_queue_s
    w = scorer.w
    overflow = auto and sides is not None and limit is not None and min(sides.queued) >= limit
    out: list[Option] = []
    for d in decode:
        c = prompt.cached(d.replica_id)
        decode_s = decode_term(w, d, prompt.tokens, prompt.max_tokens)
        if not prefill:
            out.append(scorer.local(d, c, "no_prefill_replica", decode_s))
            continue
        short = auto and prompt.tokens - c <= cfg.local_prefill_max_tokens
        if short and not breaks_slo(w, d, prompt.tokens - c, c, scorer.own_s(c)):
            out.append(scorer.local(d, c, "local_prefill", decode_s))
            continue
        if short:
            out.append(scorer.local(d, c, "local_prefill", decode_s))
        elif auto:
            out.append(scorer.local(d, c, "prefill_overflow" if overflow else "long_local_prefill", decode_s))
        assert sides is not None
        out.extend(scorer.disaggregated(sides, i, d, c, decode_s) for i in range(len(prefill)))
    return out
