"""pdserve's routing policy: which replicas serve a request, by the lowest cost (`router.policy.cost`) among
the options (`router.policy.options`).

choose():
  1. eligible replicas (ready, not draining); none for decode: NoReplicaError;
  2. each replica's cached prefix of the prompt (the KV index; a session's next turn resumes its lookup);
  3. what a prefill replica could pull instead (`router.policy.pull`; only with readback/exports on);
  4. session affinity: a session's next turn stays on the decode replica holding its KV unless that one is
     overloaded (KV usage, or active sequences well above the mean);
  5. the options, scored; the lowest cost wins, ties (within `TIE_TOLERANCE_S`) to the decode replica given
     the least recent work (`router.policy.recent_work`), which spreads new sessions at low load;
  6. the winner's work is accounted (ties and balance charges), the session remembers its decode replica.
The decision carries the winning option's terms (`Decision.terms`), which the router logs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from router.config import RouterConfig
from router.errors import NoReplicaError
from router.messages import Decision, ReplicaView, RouteRequest
from router.policy.cost import CostWeights
from router.policy.options import Balance, Option, Prompt, Scorer, candidate_options
from router.policy.pull import offer
from router.policy.recent_work import RecentWork, pick
from router.policy.types import MemoPrefixLookup, PrefixLookup
from router.service_time import Timing
from router.sessions import Part, Sessions

# A session's decode replica is overloaded (the session is re-placed by cost) at this KV usage, or with more
# active sequences than this ratio x the mean over eligible decode replicas + the slack.
AFFINITY_MAX_KV_USAGE = 0.9
AFFINITY_MAX_LOAD_RATIO = 1.5
AFFINITY_LOAD_SLACK = 4
# Prompt tokens computed are charged (churn) in seconds at the from-scratch prefill rate of a prompt this
# long.
_RATE_TOKENS = 8192


class _Placement:
    __slots__ = ("blocks", "decode", "memo")

    def __init__(self, decode: str, memo: object | None, blocks: int) -> None:
        self.decode = decode  # the decode replica of its latest turn (that this router decided)
        self.memo = memo  # the prefix lookup's memo of its latest turn (MemoPrefixLookup)
        self.blocks = blocks  # that turn's prompt blocks


PLACEMENT = Part[_Placement]("placement")


class PdservePolicy:
    name = "pdserve"

    def __init__(
        self,
        config: RouterConfig | None = None,
        timing: Timing | None = None,
        sessions: Sessions | None = None,
    ) -> None:
        """`timing`: the service-time model to cost with (default: the config's `service_time`).
        `sessions`: the router's, where each session's placement is kept (default: one of its own)."""
        config = config or RouterConfig()
        self.sessions = sessions if sessions is not None else Sessions.of(config)
        self.recent = RecentWork()
        # Prompt tokens computed per replica, in seconds at the from-scratch prefill rate.
        self.recent_tokens = RecentWork()
        # isinstance() against a runtime-checkable Protocol inspects its attributes on every call (~8 us,
        # several % of a next turn's decision): decided once per lookup type.
        self._memo_types: dict[type, bool] = {}
        self._timing = timing
        self.reconfigure(config)

    def reconfigure(self, config: RouterConfig) -> None:
        """Use `config` from the next decision on; sessions and recent work are kept."""
        self.config = config
        self.weights = CostWeights.of(config, self._timing)
        timing = self.weights.timing
        self._token_s = timing.prefill_s(_RATE_TOKENS, 0) / _RATE_TOKENS
        self._balance = Balance(self.recent, self.recent_tokens, config.balance_weight, config.churn_weight)

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
        pres = [p for p in prefill if p.eligible]
        session = None if req.session_id is None else self.sessions.get(req.session_id, PLACEMENT)
        ids = [r.replica_id for r in pres]
        ids += [r.replica_id for r in decs]
        memo_cache = self._memo_lookup(cache)
        if memo_cache is not None:
            memo_in = None if session is None else session.memo
            matched, memo = memo_cache.matched_blocks_memo(req.block_hashes, ids, memo_in)
        else:
            matched, memo = cache.matched_blocks(req.block_hashes, ids), None
        prompt = Prompt(
            tokens=req.num_prompt_tokens,
            max_tokens=req.max_tokens,
            block_size=req.block_size,
            matched=matched,
        )
        pull = offer(req, decode, decs, matched, prompt.most) if pres else None
        candidates, affinity = self._candidates(decs, session, matched if req.other_routers else None)
        scorer = Scorer(self.weights, prompt, pull, continuing=session is not None)
        options = candidate_options(self.config, scorer, pres, candidates, self._balance)
        win = options[pick([o.decode for o in options], [o.total for o in options], self.recent)]
        self._account(req, win)
        if req.session_id is not None:
            if memo_cache is not None:
                memo_cache.expect_stored(
                    memo, {win.computing.replica_id, win.decode.replica_id}, req.block_hashes
                )
            self._remember(req.session_id, session, win.decode.replica_id, memo, len(req.block_hashes))
        return Decision(
            prefill=None if win.local else win.computing.replica_id,
            decode=win.decode.replica_id,
            local_prefill=win.local,
            predicted_cached_tokens=win.cached,
            predicted_decode_cached_tokens=prompt.cached(win.decode.replica_id),
            readback_tokens=win.pulled,
            readback_replica=pull.source.replica_id if win.pulled and pull is not None else None,
            readback_export=pull is not None and pull.export and win.pulled > 0,
            cost=win.total,
            terms=win.terms,
            reason=f"affinity_{win.kind}" if affinity else win.kind,
        )

    def on_finish(self, req: RouteRequest, d: Decision) -> None:
        return None  # session placement outlives requests; nothing per request to release

    def _candidates(
        self, decs: list[ReplicaView], session: _Placement | None, matched: dict[str, int] | None
    ) -> tuple[list[ReplicaView], bool]:
        """The decode replicas to consider: the session's own unless overloaded, else every eligible one.

        The session's own is where its latest turn this router decided went. With other routers (`matched`
        given: each decode replica's blocks of the prompt), a decode replica holding strictly more of the
        prompt than both that turn and that replica is the session's own instead: another router decided a
        later turn and sent it there. One router decided every turn: its own placement stands."""
        if self.config.session_affinity and session is not None:
            sticky = next((d for d in decs if d.replica_id == session.decode), None)
            if matched is not None:
                held = max(session.blocks, matched[sticky.replica_id] if sticky is not None else 0)
                later = max(decs, key=lambda d: matched[d.replica_id])
                if matched[later.replica_id] > held:
                    sticky = later
            if sticky is not None and not _overloaded(sticky, decs):
                return [sticky], True
        return decs, False

    def _memo_lookup(self, cache: PrefixLookup) -> MemoPrefixLookup | None:
        t = type(cache)
        ok = self._memo_types.get(t)
        if ok is None:
            ok = self._memo_types[t] = isinstance(cache, MemoPrefixLookup)
        return cast(MemoPrefixLookup, cache) if ok else None

    def _account(self, req: RouteRequest, win: Option) -> None:
        """Charge the chosen replicas' recent work with this request's estimated seconds and tokens."""
        w = self.weights
        rw = self.recent
        rw.tick()
        rw.add(win.computing.replica_id, win.own_s)
        self.recent_tokens.tick()
        self.recent_tokens.add(win.computing.replica_id, (req.num_prompt_tokens - win.cached) * self._token_s)
        out = min(req.max_tokens, w.max_output_tokens)
        dec = win.decode
        rw.add(dec.replica_id, out * w.timing.tpot_s(dec.active_seqs + 1, dec.active_context_tokens))

    def _remember(
        self, session_id: str, entry: _Placement | None, decode_id: str, memo: object | None, blocks: int
    ) -> None:
        if entry is not None:
            entry.decode, entry.memo, entry.blocks = decode_id, memo, blocks
            self.sessions.touch(session_id)
            return
        entry = _Placement(decode_id, memo, blocks)
        self.sessions.put(session_id, PLACEMENT, entry)


def _overloaded(d: ReplicaView, decs: Sequence[ReplicaView]) -> bool:
    if d.kv_usage >= AFFINITY_MAX_KV_USAGE:
        return True
    mean_active = sum(x.active_seqs for x in decs) / len(decs)
    return d.active_seqs > AFFINITY_MAX_LOAD_RATIO * mean_active + AFFINITY_LOAD_SLACK
