"""pdserve's routing policy: joint choice of prefill and decode replicas by `router.policy.cost`.

For each eligible decode replica D the options are:
- local prefill on D, when D's cache holds all but at most `local_prefill_max_tokens` of the prompt (the
  transfer and the second hop are skipped; this is the only option for such a D);
- otherwise disaggregated: the prefill replica P minimising cost(P, D). The cost separates into a P part, a D
  part and the transfer term whose link depends only on whether P and D share a node, so the best P for D is
  either the cheapest P overall or the cheapest P on D's node: the joint (P, D) optimum costs O(|P| + |D|),
  not O(|P||D|).
- with no eligible prefill replica, D prefills locally whatever its cache holds;
- with `long_local_prefill` (default), D may also prefill the longer suffix itself, next to its disaggregated
  option, its batch's wait weighted `CostWeights.long_stall`; with every eligible prefill replica
  `prefill_overflow_queue_s` behind (prefill overflow), weighted `CostWeights.stall`, as any local prefill
  (both below).
The option with the lowest cost wins.

Ties. Costs within `tie_tolerance_s`, or within `tie_tolerance_rel` x the cheapest option's own prefill
seconds, of the lowest cost are equivalent (the estimate is not more precise than that, and a queue that is
short against the job itself says little about where load will build up), and among them the replica that was
given the least work recently wins: the estimated seconds this policy assigned it, decayed with a half-life of
`spread_half_life` decisions. Taking the first in order instead sends every cold prompt to the same replica
whenever queues are empty (low load, the usual state), so one replica's cache churns through every new session
while the others idle; spreading by recent work places new sessions (and with them, their future turns)
evenly. The half-life is counted in decisions rather than seconds so that the policy needs no clock and
replays deterministically.

Balance. Each prefill replica's P part is also charged for two kinds of recent work above the prefill pool's
mean (both decayed as above): `balance_weight` x its estimated seconds, the compute it has been given, and
`churn_weight` x the tokens it computed, counted in seconds at the model's from-scratch prefill rate (so the
two weights are comparable). Tokens computed are blocks written into that replica's prefix cache: a replica
computing more than the others evicts its sessions' prefixes faster. The two differ because a token computed
over a long cached context costs several times one computed from scratch: balancing seconds alone let replicas
serving short contexts compute up to 1.32x the mean tokens while every replica's busy time stayed within 11%
(Claude Code replay, seeds 5 and 8). Ties only spread prompts whose costs are equal; sessions then stick to
where their prefix is, and the charges move work whose hit is worth less than the imbalance (new sessions,
short contexts) off the loaded replicas, leaving sessions with long cached contexts where they are (their
5x-weighted miss dwarfs it). Weights chosen on the Claude Code replay at ~55% prefill utilisation, ten seeds
(0-9; max/mean prefill tokens, max/mean busy seconds): seconds only at 0.1: 1.10-1.32, 1.03-1.11; with
`churn_weight` 0.5: 1.06-1.11, 1.06-1.36; `balance_weight` 0.2 and `churn_weight` 0.5 (the defaults):
1.06-1.13, 1.08-1.23; hit/bound 0.97-0.99 throughout. On Mooncake the defaults change hit/bound 0.753 ->
0.748 and TTFT P99 not at all. The outcome is noisy per seed: these are tuning knobs, not measurements.
Near the top of the 50-70% band (Claude Code at concurrency 68, seeds 0-4) every setting tried lets load pile
onto one or two replicas on some seeds (max/mean tokens 1.15-2.6, TTFT P99 up to ~540 s) and the churn term
makes it somewhat worse (TTFT P99 353-541 s vs 156-537 s with seconds only); `churn_weight: 0` restores that.

KV readback (`RouteRequest.readback`, topology `router.kv_readback_ttl_s`): the session's previous decode
replica keeps its context pinned, and any prefill replica can pull it over NIXL (~20 ms per 100k tokens across
nodes on the default model) instead of recomputing it (seconds). A prefill replica's cached prefix is then the
longer of its own and the pinned one, plus the pull's transfer term, unless its queue outlasts the pin (the
engine would decline the late read and compute the prompt in full). A session is then no longer tied to the
prefill replica holding its context, so the queue term moves it off a busy one for the price of a transfer.
What it costs is decode KV: pins stay allocated until read or expired. On the Claude Code replay at
concurrency 68 (seed 0, pins counted against the decode caches): TTL 480 s gives max/mean prefill tokens
1.08 and TTFT P99 64 s (2.03 and 431 s without readback), but needs three times each decode replica's cache
for the pins; TTL 120 s fits better (1.5x) and gives 1.31 and 147 s; 60 s and 30 s are worse than no
readback (a pin that expires before the next prefill starts turns a planned pull into a full recompute on a
replica without the prefix). Off by default for that reason.

KV export (`RouteRequest.export_ttl_s`, topology `router.kv_readback_exports`, on with readback): the longest
prefix any eligible decode replica holds in its prefix cache is also a pull source; the orchestrator has that
replica pin it (a one-token request) before sending the prefill leg. The session's own pin wins a tie (it
needs no extra request). Readback alone offers only the session's latest turn, pinned when it finished: a pin
left to expire because the next turn was prefilled on decode, or one already read, is gone for the turn after,
and a request without a session has none. With exports every context a decode replica still caches (the
session's previous turns, a prefix shared across sessions, the Mooncake trace's conversations, which carry no
session id) is one transfer away from any prefill replica. Claude Code replay (TTL 60 s, seeds 0-9, pdserve
before prefill overflow vs dynamo_kv with the same readback): at concurrency 60 / 64 / 68 (prefill utilisation
0.49-0.55 / 0.54-0.62 / 0.60-0.69) hit/bound 0.998-0.999 / 0.995-0.998 / 0.993-0.996, max/mean prefill tokens
above 1.15 on 0 / 1 / 2 seeds, TTFT P99 27-64 / 40-105 / 41-104 s against dynamo_kv's 235-380 / 282-491 /
350-485 s; readback without exports at concurrency 64 does worse than no readback (hit/bound 0.943-0.952, TTFT
P99 268-621 s). Mooncake: hit/bound 0.811 -> 0.870, TTFT P99 7.59 -> 7.40 s. Decode KV pays for it: the most
blocks allocated on one decode replica (running sequences and pins) reaches 1.0-1.45x its modelled cache at
concurrency 60-68 (0.82-0.86x at concurrency 64 with readback off), which the replay lets running sequences
exceed rather than making them wait. That cache is the issue's 2% of the slice's unique blocks, 1.9M tokens:
about a third of what an 8-GPU H200 node keeps for KV next to DeepSeek-V3's FP8 weights (~400 GB at the
replay's 70 KB per token).

Local prefill threshold. A decode replica holding all but `local_prefill_max_tokens` of the prompt prefills
the rest itself: no second hop, no transfer, and the prompt is stored once (on D) instead of on P and D, so
the pool's caches hold more distinct context. The price is the decode batch's stall while it runs. Default
1024 (Dynamo's vLLM worker defaulted `--max-local-prefill-length` to 1000). Measured on the replay (Claude
Code at concurrency 56, seeds 0-9; Mooncake): 512 -> 1024 -> 2048 moves 12% -> 45% -> 70% of Claude Code turns
to local prefill; max/mean prefill tokens 1.07-1.17 -> 1.10-1.13 -> 1.06-1.13, hit/bound 0.975-0.984 ->
0.980-0.984 -> 0.982-0.986, decode TPOT P99 15.2 -> 16.1 -> 18.3 ms; Mooncake hit/bound 0.746 -> 0.811 ->
0.843 with TTFT P99 7.71 -> 7.59 -> 7.24 s and TPOT P99 20 -> 21 -> 21 ms. 1024 keeps the decode cost small;
the balance and churn weights and the readback figures above were measured at 512 (weights not re-tuned).

Long local prefill (`long_local_prefill`, default on). An agent session's next turn appends a tool result of a
few thousand tokens to a context of 100k or more: past the threshold, yet the decode replica holding the
context computes it in well under a second, while a prefill replica lacking the context (prefill caches churn
faster than the decode replica that keeps the running session) recomputes all of it: many seconds, and a miss
that evicts other sessions' prefixes. So D's local prefill is an option whatever the suffix, its batch's wait
weighted `CostWeights.long_stall` (20; see router.policy.cost): each running sequence waits the prefill's
seconds (vLLM chunks it between decode steps, which slows them rather than stops them: a little less), and the
weight keeps decode TPOT where disaggregation puts it. Claude Code replay, readback off, seeds 0-9,
concurrency 60 / 64 / 68 / 72 (prefill utilisation 0.50-0.55 / 0.53-0.59 / 0.58-0.66 / 0.63-0.74): hit/bound
0.989-0.991 / 0.988-0.991 / 0.986-0.989 / 0.979-0.987, max/mean prefill tokens 1.04-1.11 / 1.05-1.11 /
1.07-1.12 / 1.04-1.13, TTFT P99 23-30 / 24-35 / 27-38 / 35-57 s, decode TPOT P99 18-20 / 19-22 / 22-25 / 23-31
ms; without it (concurrency 60 / 64) hit/bound 0.971-0.982 / 0.961-0.975, TTFT P99 50-92 / 55-123 s, TPOT P99
17-20 / 18-28 ms. With readback 60 s and exports (concurrency 64) unchanged within noise: 0.995-0.998, TTFT
P99 18-22 s. Mooncake (short contexts, short queues): hit/bound 0.799 -> 0.808, TTFT P99 7.45 s either way.

Prefill overflow (`prefill_overflow_queue_s`, default 10 s of estimated queued prefill on every prefill
replica). A backed-up prefill pool feeds itself: a session's next turn waits behind the queue while its
context, pinned or cached, expires or is evicted, and is then computed in full, which keeps the queues long.
A decode replica holding that context computes the turn's new tokens in about a second. So when no prefill
replica can start soon, a local prefill past the threshold is weighted like any local prefill (`stall`, 1),
not as a long one: the queue, not the batch, is what the request would otherwise wait for. (Before long local
prefill existed, overflow was the only way past the threshold: the measurements below are from then.) The
replay shows it where it happens: a Claude Code run starts 64 sessions within a minute, first turns of
100k-850k tokens queue ~100 s on every prefill replica for the first ~800 s, and at concurrency 64 seed 4
(readback 60 s with exports) that start gave TTFT P99 105 s and max/mean prefill tokens 1.19 without
overflow; 19 s and 1.06 with it. Seeds 0-9, with overflow (without it, as measured before): readback off,
concurrency 56 / 60 / 64 (prefill utilisation 0.50-0.59 / 0.57-0.70 / 0.63-0.83): TTFT P99 37-59 / 50-92 /
55-123 s (59-74 / 67-177 / 95-195), max/mean 1.07-1.13 / 1.06-1.15 / 1.08-1.15 (1.10-1.13 / 1.08-1.21 /
1.11-1.30), hit/bound unchanged; readback 60 s with exports, concurrency 64 / 68 (0.55-0.63 / 0.62-0.72): TTFT
P99 18-22 / 19-27 s (40-105 / 41-104), max/mean 1.04-1.08 / 1.04-1.08 (1.04-1.19 / 1.05-1.22). Decode TPOT
P99 rises 1-3 ms (to 17-20 ms; 28 ms on the one seed at 0.83 utilisation). Weighting overflow at
`long_stall` too would lose most of that (readback 60 s, concurrency 64 / 68, seeds 0-4: TTFT P99 29-57 /
40-68 s). Mooncake's queues stay below 10 s: overflow never triggers; the stall term (which also ranks decode
replicas for short local prefills) moves hit/bound 0.811 -> 0.799 and TTFT P99 7.59 -> 7.45 s.

Session affinity: a session's next turn goes to the decode replica that served its previous turn (its KV is
there) while that replica is not overloaded: KV usage below `affinity_max_kv_usage` and active sequences at
most `affinity_max_load_ratio` x the mean over eligible decode replicas + `affinity_load_slack`. When
overloaded, the session is re-placed by cost and sticks to its new replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, cast

import msgspec

from router.policy.cost import (
    CostWeights,
    decode_term,
    estimated_prefill_s,
    queued_prefill_s,
    queued_s,
    stall_term,
    transfer_term,
)
from router.policy.types import (
    Decision,
    MemoPrefixLookup,
    NoReplicaError,
    PrefixLookup,
    ReplicaView,
    RouteRequest,
)


class PdservePolicyConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    weights: CostWeights = CostWeights()
    # The H200 example's value (deploy/h200-kimi-k2.yaml; the replay evaluates it). The topology's default,
    # 256, is sized for the tiny local model's 2048-token context; the router passes the topology's value.
    local_prefill_max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 1024
    session_affinity: bool = True
    affinity_max_kv_usage: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.9
    affinity_max_load_ratio: Annotated[float, msgspec.Meta(ge=1)] = 1.5
    affinity_load_slack: Annotated[int, msgspec.Meta(ge=0)] = 4
    max_sessions: Annotated[int, msgspec.Meta(gt=0)] = 100_000
    tie_tolerance_s: Annotated[float, msgspec.Meta(ge=0)] = 0.05
    tie_tolerance_rel: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    spread_half_life: Annotated[float, msgspec.Meta(gt=0)] = 2000.0
    balance_weight: Annotated[float, msgspec.Meta(ge=0)] = 0.2
    churn_weight: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    # A decode replica may prefill a suffix longer than `local_prefill_max_tokens` itself when that costs less
    # than any disaggregated option, its batch's wait weighted `CostWeights.long_stall` (long local prefill).
    long_local_prefill: bool = True
    # With every eligible prefill replica this many estimated seconds behind, that wait is weighted like any
    # local prefill's, `CostWeights.stall` (decode absorbs prefill overflow); None: never.
    prefill_overflow_queue_s: Annotated[float, msgspec.Meta(ge=0)] | None = 10.0


_RATE_TOKENS = 8192


class _RecentWork:
    """Estimated seconds assigned per replica, decayed per decision. Values are stored multiplied by a
    growing scale (so a decay step touches one float, not every replica) and rescaled before it overflows."""

    def __init__(self, half_life: float) -> None:
        self._growth = 2.0 ** (1.0 / half_life)
        self._scale = 1.0
        self._work: dict[str, float] = {}

    def tick(self) -> None:
        self._scale *= self._growth
        if self._scale > 1e200:
            self._work = {k: v / self._scale for k, v in self._work.items()}
            self._scale = 1.0

    def add(self, replica_id: str, seconds: float) -> None:
        self._work[replica_id] = self._work.get(replica_id, 0.0) + seconds * self._scale

    def key(self, replica_id: str) -> float:
        """Comparable between replicas (not in seconds)."""
        return self._work.get(replica_id, 0.0)

    def seconds(self, replica_id: str) -> float:
        return self._work.get(replica_id, 0.0) / self._scale


class _Session:
    __slots__ = ("decode", "memo")

    def __init__(self, decode: str, memo: object | None) -> None:
        self.decode = decode  # the decode replica of its latest turn
        self.memo = memo  # the prefix lookup's memo of its latest turn (MemoPrefixLookup)


class PdservePolicy:
    name = "pdserve"

    def __init__(self, config: PdservePolicyConfig | None = None) -> None:
        self.config = config or PdservePolicyConfig()
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self.recent = _RecentWork(self.config.spread_half_life)
        # Prompt tokens computed per replica, in seconds at the from-scratch prefill rate of an 8k prompt.
        self.recent_tokens = _RecentWork(self.config.spread_half_life)
        timing = self.config.weights.timing
        self._token_s = timing.prefill_s(_RATE_TOKENS, 0) / _RATE_TOKENS
        # isinstance() against a runtime-checkable Protocol inspects its attributes on every call (~8 us,
        # several % of a next turn's decision): decided once per lookup type.
        self._memo_types: dict[type, bool] = {}

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        cfg = self.config
        w = cfg.weights
        decs = [d for d in decode if d.eligible]
        if not decs:
            raise NoReplicaError("no ready decode replica")
        pres = [p for p in prefill if p.eligible]
        n = req.num_prompt_tokens
        bs = req.block_size
        session = None if req.session_id is None else self._sessions.get(req.session_id)
        ids = [r.replica_id for r in pres]
        ids += [r.replica_id for r in decs]
        memo_cache = self._memo_lookup(cache)
        if memo_cache is not None:
            matched, memo = memo_cache.matched_blocks_memo(
                req.block_hashes, ids, None if session is None else session.memo
            )
        else:
            matched, memo = cache.matched_blocks(req.block_hashes, ids), None
        # cached_tokens(): at most the blocks before the one holding the last token. Computed only for the
        # replicas scored (a session's next turn on its own replica scores one or two, not the pool).
        most = (n - 1) // bs * bs if n > 0 else 0

        def cached(rid: str) -> int:
            return min(matched[rid] * bs, most)

        # A prefill replica can pull what the session's previous decode replica keeps pinned (readback), or
        # with exports on, the longest prefix any decode replica holds (it pins it on request), instead of
        # computing it: it then starts from the longer of its own prefix and that one, paying the transfer
        # of the difference. The session's pin wins a tie (it needs no export request).
        rb = req.readback
        rb_tokens = 0
        rb_src: ReplicaView | None = None
        rb_left = 0.0  # seconds the source keeps the blocks pinned
        rb_export = False
        if rb is not None and pres:
            rb_src = next((d for d in decode if d.replica_id == rb.replica_id and d.ready), None)
            if rb_src is not None:
                rb_tokens, rb_left = min(rb.tokens, most), rb.expires_in_s
        if req.export_ttl_s is not None and pres:
            holder = max(decs, key=lambda d: matched[d.replica_id])
            if cached(holder.replica_id) > rb_tokens:
                rb_src, rb_tokens, rb_left = holder, cached(holder.replica_id), req.export_ttl_s
                rb_export = True
        rb_node = None if rb_src is None else rb_src.node_id

        def pulls_in_time(p: ReplicaView) -> bool:
            # The pull happens when P schedules the prompt, after its queue. A pin that may expire first is
            # not counted on (the prompt would then be computed in full: a miss the cost did not plan for).
            return queued_prefill_s(w.timing, p) < rb_left

        def p_cached(p: ReplicaView) -> int:
            """Tokens prefill replica `p` starts from: its own prefix, or what it can pull."""
            c = cached(p.replica_id)
            return rb_tokens if rb_tokens > c and pulls_in_time(p) else c

        def pull_s(p: ReplicaView) -> float:
            pulled = p_cached(p) - cached(p.replica_id)
            if pulled <= 0:
                return 0.0
            return transfer_term(w, pulled, rb_node is not None and rb_node == p.node_id)

        # Replicas holding the same prefix length share one prefill estimate.
        prefill_s: dict[int, float] = {}

        def own_prefill_s(c: int) -> float:
            s = prefill_s.get(c)
            if s is None:
                s = prefill_s[c] = estimated_prefill_s(w.timing, n, c)
            return s

        candidates = decs
        affinity = False
        if cfg.session_affinity and session is not None:
            prev = session.decode
            sticky = next((d for d in decs if d.replica_id == prev), None)
            if sticky is not None and not self._overloaded(sticky, decs):
                candidates = [sticky]
                affinity = True

        # P part of the cost (own prefill + queue), and the best P overall and on each candidate D's node;
        # not needed when every candidate prefills locally (a session's next turn on the replica holding it).
        best_p: ReplicaView | None = None
        best_f = 0.0
        best_on_node: dict[str, tuple[float, ReplicaView]] = {}
        local_max = cfg.local_prefill_max_tokens
        overflow = False
        if pres and any(n - cached(d.replica_id) > local_max for d in candidates):
            owns = [own_prefill_s(p_cached(p)) for p in pres]
            queues = [queued_prefill_s(w.timing, p) for p in pres]
            fs = [w.prefill * o + w.queue * q for o, q in zip(owns, queues, strict=True)]
            # Prefill overflow: when every prefill replica is backed up, a decode replica holding most of a
            # session's context computes the rest sooner than any of them: its batch's wait is weighed as any
            # local prefill's, not as a long one's.
            limit = cfg.prefill_overflow_queue_s
            overflow = limit is not None and min(queues) >= limit
            if rb_tokens:
                fs = [f + pull_s(p) for f, p in zip(fs, pres, strict=True)]
            if (cfg.balance_weight or cfg.churn_weight) and len(pres) > 1:
                fs = self._add_balance(pres, fs)
            i = self._pick(pres, fs, owns)
            best_p, best_f = pres[i], fs[i]
            nodes = {d.node_id for d in candidates if d.node_id is not None}
            if nodes:
                groups: dict[str, list[int]] = {}
                for j, p in enumerate(pres):
                    if p.node_id in nodes:
                        groups.setdefault(p.node_id, []).append(j)
                for node, idx in groups.items():
                    k = idx[self._pick([pres[j] for j in idx], [fs[j] for j in idx], [owns[j] for j in idx])]
                    best_on_node[node] = (fs[k], pres[k])

        # One entry per option: its cost, decode replica, computing replica and own prefill seconds.
        options: list[float] = []
        decoding: list[ReplicaView] = []
        computing: list[ReplicaView] = []
        own: list[float] = []
        for d in candidates:
            c_d = cached(d.replica_id)
            load = decode_term(w, d, n, req.max_tokens)
            local_allowed = best_p is None or n - c_d <= local_max
            if local_allowed or overflow or cfg.long_local_prefill:
                o = own_prefill_s(c_d)
                long = not (local_allowed or overflow)
                options.append(w.prefill * o + queued_s(w, d) + load + stall_term(w, d, o, long=long))
                decoding.append(d)
                computing.append(d)
                own.append(o)
            if local_allowed or best_p is None:  # (local_allowed covers best_p None; restated for mypy)
                continue
            transfer = n - c_d
            total, p = best_f + load + transfer_term(w, transfer, False), best_p
            if best_p.node_id is not None and best_p.node_id == d.node_id:
                total = best_f + load + transfer_term(w, transfer, True)
            local_best = best_on_node.get(d.node_id) if d.node_id is not None else None
            if local_best is not None and local_best[1] is not best_p:
                near = local_best[0] + load + transfer_term(w, transfer, True)
                if near < total:
                    total, p = near, local_best[1]
            options.append(total)
            decoding.append(d)
            computing.append(p)
            own.append(own_prefill_s(p_cached(p)))
        i = self._pick(decoding, options, own)
        dec, comp = decoding[i], computing[i]
        local = comp is dec
        comp_cached = cached(comp.replica_id) if local else p_cached(comp)
        self._account(req, comp, comp_cached, dec, own_prefill_s(comp_cached))
        if req.session_id is not None:
            if memo_cache is not None:
                memo_cache.expect_stored(memo, {comp.replica_id, dec.replica_id}, req.block_hashes)
            self._remember(req.session_id, session, dec.replica_id, memo)
        if not local:
            reason = "disaggregated"
        elif not pres:
            reason = "no_prefill_replica"
        elif n - comp_cached <= local_max:
            reason = "local_prefill"
        else:
            reason = "prefill_overflow" if overflow else "long_local_prefill"
        pulled = comp_cached - cached(comp.replica_id)
        return Decision(
            prefill=None if local else comp.replica_id,
            decode=dec.replica_id,
            local_prefill=local,
            predicted_cached_tokens=comp_cached,
            predicted_decode_cached_tokens=cached(dec.replica_id),
            readback_tokens=pulled,
            readback_replica=rb_src.replica_id if pulled and rb_src is not None else None,
            readback_export=rb_export and pulled > 0,
            cost=options[i],
            reason=f"affinity_{reason}" if affinity else reason,
        )

    def on_finish(self, req: RouteRequest, d: Decision) -> None:
        return None  # session placement outlives requests; nothing per request to release

    def _memo_lookup(self, cache: PrefixLookup) -> MemoPrefixLookup | None:
        t = type(cache)
        ok = self._memo_types.get(t)
        if ok is None:
            ok = self._memo_types[t] = isinstance(cache, MemoPrefixLookup)
        return cast(MemoPrefixLookup, cache) if ok else None

    def _pick(
        self,
        replicas: Sequence[ReplicaView],
        costs: list[float],
        own_s: list[float],
    ) -> int:
        """Index of the lowest cost, ties (within tolerance) to the replica with the least recent work.
        `own_s`: each option's own (unweighted) prefill seconds."""
        if len(costs) == 1:
            return 0
        lo = min(costs)
        own = own_s[costs.index(lo)]
        limit = lo + max(self.config.tie_tolerance_s, self.config.tie_tolerance_rel * own)
        key = self.recent.key
        best = -1
        best_key = (0.0, 0.0)
        for i, c in enumerate(costs):
            if c <= limit:
                k = (key(replicas[i].replica_id), c)
                if best < 0 or k < best_key:
                    best, best_key = i, k
        return best

    def _add_balance(self, pres: Sequence[ReplicaView], fs: list[float]) -> list[float]:
        """Charge each prefill replica for its recent seconds and its recent tokens above the pool's mean."""
        cfg = self.config
        out = list(fs)
        for weight, work in ((cfg.balance_weight, self.recent), (cfg.churn_weight, self.recent_tokens)):
            if not weight:
                continue
            xs = [work.seconds(p.replica_id) for p in pres]
            mean = sum(xs) / len(xs)
            out = [f + weight * (x - mean) if x > mean else f for f, x in zip(out, xs, strict=True)]
        return out

    def _account(
        self, req: RouteRequest, comp: ReplicaView, cached: int, dec: ReplicaView, prefill_s: float
    ) -> None:
        """Charge the chosen replicas' recent work with this request's estimated seconds."""
        w = self.config.weights
        rw = self.recent
        rw.tick()
        rw.add(comp.replica_id, prefill_s)
        self.recent_tokens.tick()
        self.recent_tokens.add(comp.replica_id, (req.num_prompt_tokens - cached) * self._token_s)
        out = min(req.max_tokens, w.max_output_tokens)
        rw.add(dec.replica_id, out * w.timing.tpot_s(dec.active_seqs + 1, dec.active_context_tokens))

    def _overloaded(self, d: ReplicaView, decs: Sequence[ReplicaView]) -> bool:
        cfg = self.config
        if d.kv_usage >= cfg.affinity_max_kv_usage:
            return True
        mean_active = sum(x.active_seqs for x in decs) / len(decs)
        return d.active_seqs > cfg.affinity_max_load_ratio * mean_active + cfg.affinity_load_slack

    def _remember(self, session_id: str, entry: _Session | None, decode_id: str, memo: object | None) -> None:
        s = self._sessions
        if entry is None:
            s[session_id] = _Session(decode_id, memo)
            if len(s) > self.config.max_sessions:
                s.popitem(last=False)
            return
        entry.decode = decode_id
        entry.memo = memo
        s.move_to_end(session_id)
