"""pdserve's policy: each cost term moves the choice; local-prefill threshold; affinity; eligibility."""

import random

import msgspec
import pytest
from policy_helpers import BS, FixedLookup, request, view

from router.block_hash import hash_blocks
from router.config import RouterConfig
from router.errors import NoReplicaError
from router.messages import Readback, ReplicaView, RouteRequest
from router.policy.options import Balance, Prompt, Scorer, every_option
from router.policy.pull import offer
from router.policy.recent_work import TIE_TOLERANCE_S
from router.policy.selector import PdservePolicy
from router.view.kv_index import KvIndex

N = 4096  # prompt tokens (256 blocks)


def queued(v: ReplicaView, seconds: float) -> ReplicaView:
    return msgspec.structs.replace(v, queued_prefill_s=seconds)


def choose(prefill, decode, blocks=None, n=N, session=None, policy=None):  # type: ignore[no-untyped-def]
    pol = policy or PdservePolicy()
    return pol.choose(request(n, session), prefill, decode, FixedLookup(blocks))


# A TTFT SLO no option here breaks: a wait is charged as itself (tests of the other terms).
LAX_TTFT = RouterConfig(ttft_slo_ms=600_000.0)


def test_uncached_prefill_term_prefers_the_prefill_replica_holding_the_prefix() -> None:
    d = choose([view("p0"), view("p1")], [view("d0", "decode")], {"p1": 200})
    assert d.prefill == "p1" and d.predicted_cached_tokens == 200 * BS and not d.local_prefill
    assert d.reason == "disaggregated"


def next_turn(prefill, decode, blocks=None, config=None, n=N):  # type: ignore[no-untyped-def]
    """A session's next turn: the policy has placed the session's first turn."""
    pol = PdservePolicy(config or RouterConfig(balance_weight=0.0, churn_weight=0.0))
    choose([view("p0"), view("p1")], decode, session="s", policy=pol)
    return choose(prefill, decode, blocks, n, session="s", policy=pol)


def test_queued_prefill_term_moves_work_off_a_busy_prefill_replica() -> None:
    # p0 holds 3200 of 4096 tokens of the session's context; the hit saves well under a second of prefill.
    d = next_turn([queued(view("p0"), 5.0), view("p1")], [view("d0", "decode")], {"p0": 200})
    assert d.prefill == "p1"
    d = next_turn([queued(view("p0"), 0.06), view("p1")], [view("d0", "decode")], {"p0": 200})
    assert d.prefill == "p0"
    # Without an estimate in the view, the queued token and request counts stand in for it.
    d = next_turn([view("p0", queued=200_000, reqs=10), view("p1")], [view("d0", "decode")], {"p0": 200})
    assert d.prefill == "p1"


def test_a_new_prompt_waits_for_the_holder_of_its_prefix_within_the_ttft_slo() -> None:
    # p0 holds 3200 of 4096 tokens another request shared. Recomputing them on p1 copies them into a second
    # prefill cache: a new prompt waits 2 s for p0 where a session's next turn (its own context) moves.
    disagg = RouterConfig(mode="disaggregate")
    busy = [queued(view("p0"), 2.0), view("p1")]
    assert choose(busy, [view("d0", "decode")], {"p0": 200}, policy=PdservePolicy(disagg)).prefill == "p0"
    assert next_turn(busy, [view("d0", "decode")], {"p0": 200}, disagg).prefill == "p1"
    # A wait that takes its first token past the TTFT SLO is charged over-SLO weight on the excess.
    late = [queued(view("p0"), 6.0), view("p1")]
    assert choose(late, [view("d0", "decode")], {"p0": 200}, policy=PdservePolicy(disagg)).prefill == "p1"
    tight = PdservePolicy(msgspec.structs.replace(disagg, ttft_slo_ms=1000.0))
    assert choose(busy, [view("d0", "decode")], {"p0": 200}, policy=tight).prefill == "p1"


@pytest.mark.parametrize("field, value", [("active", 10), ("kv", 0.8)])
def test_decode_load_term_moves_the_decode_choice(field: str, value: float) -> None:
    busy = view("d0", "decode", **{field: value})  # type: ignore[arg-type]
    assert choose([view("p0")], [busy, view("d1", "decode")]).decode == "d1"


def test_transfer_term_prefers_decode_holding_more_of_the_prompt() -> None:
    d = choose([view("p0")], [view("d0", "decode"), view("d1", "decode")], {"d1": 100})
    assert d.decode == "d1" and d.predicted_decode_cached_tokens == 100 * BS


def test_transfer_term_prefers_a_prefill_replica_on_the_decode_node() -> None:
    n = 100_000  # a long prompt: the cross-node transfer takes ~18 ms, the NVLink one ~2 ms
    lax = PdservePolicy(LAX_TTFT)
    pres = [view("p0", node="n0"), view("p1", node="n1")]
    assert choose(pres, [view("d1", "decode", node="n1")], n=n, policy=lax).prefill == "p1"
    # Joint choice: a slightly busier same-node P still wins when the transfer saving exceeds its queue...
    pres = [view("p0", node="n0"), queued(view("p1", node="n1"), 0.005)]
    lax = PdservePolicy(LAX_TTFT)
    assert choose(pres, [view("d1", "decode", node="n1")], n=n, policy=lax).prefill == "p1"
    # ...and loses when its queue costs more than the saving.
    pres = [view("p0", node="n0"), queued(view("p1", node="n1"), 1.0)]
    lax = PdservePolicy(LAX_TTFT)
    assert choose(pres, [view("d1", "decode", node="n1")], n=n, policy=lax).prefill == "p0"
    # The prompt's own ~11 s prefill is past the default TTFT SLO: every second of wait before it counts
    # over-SLO weight, more than the transfer saves.
    pres = [view("p0", node="n0"), queued(view("p1", node="n1"), 0.005)]
    assert choose(pres, [view("d1", "decode", node="n1")], n=n).prefill == "p0"


@pytest.mark.parametrize("held_blocks, local", [(256 - 32, True), (256 - 33, False)])
def test_local_prefill_threshold_edges(held_blocks: int, local: bool) -> None:
    # Threshold 512 tokens = 32 blocks; with all 256 blocks of a 4096-token prompt held, 16 tokens remain.
    # (p0 holds the prefix too: past the threshold, its hop costs what d0's local prefill would without
    # stalling d0's batch.)
    pol = PdservePolicy(RouterConfig(local_prefill_max_tokens=512))
    held = {"d0": held_blocks, "p0": held_blocks}
    d = choose([view("p0")], [view("d0", "decode")], held, policy=pol)
    assert d.local_prefill is local
    if local:
        assert (
            d.prefill is None
            and d.reason == "local_prefill"
            and d.predicted_cached_tokens == held_blocks * BS
        )
    else:
        assert d.prefill == "p0"


def test_mode_disaggregate_always_prefills_on_a_prefill_replica_while_one_is_eligible() -> None:
    pol = PdservePolicy(RouterConfig(mode="disaggregate"))
    for held in (200, 255):  # 200: past the threshold; 255: all but the last block (short)
        assert choose([view("p0")], [view("d0", "decode")], {"d0": held}, policy=pol).prefill == "p0"
    backed_up = [queued(view("p0"), 60.0)]  # no prefill overflow either
    assert choose(backed_up, [view("d0", "decode")], {"d0": 255}, policy=pol).prefill == "p0"
    d = choose([view("p0", ready=False)], [view("d0", "decode")], {"d0": 200}, policy=pol)
    assert d.local_prefill and d.reason == "no_prefill_replica"


def test_a_decode_replica_holding_a_long_context_prefills_a_long_suffix_when_the_hop_costs_more() -> None:
    # d0 holds 126k of a 128k-token session context; the prefill replica holds none of it. Recomputing it all
    # there costs ~20 s; d0 computes the 2k new tokens over its cached context in well under a second, which
    # its wait (x `over_slo`: the next sequence admitted meets steps past the SLO) does not outweigh.
    n, held = 128 * 1024, {"d0": (128 * 1024 - 2048) // BS}
    d = choose([view("p0")], [view("d0", "decode")], held, n=n)
    assert d.local_prefill and d.prefill is None and d.decode == "d0" and d.reason == "long_local_prefill"
    # The prefill replica holding the context too: the hop costs the same prefill and no batch waits.
    assert choose([view("p0")], [view("d0", "decode")], {**held, "p0": held["d0"]}, n=n).prefill == "p0"
    # A busy batch: 45 sequences would each wait the prefill past the inter-token SLO; the hop, though its
    # first token comes ~14 s past the TTFT SLO, is cheaper.
    busy = [view("d0", "decode", active=45)]
    assert choose([view("p0")], busy, held, n=n).prefill == "p0"
    # Mode disaggregate: only the hop.
    off = PdservePolicy(RouterConfig(mode="disaggregate"))
    assert choose([view("p0")], [view("d0", "decode")], held, n=n, policy=off).prefill == "p0"


def test_prefill_overflow_charges_a_long_local_prefill_as_a_short_one() -> None:
    # d0 holds 48k of a 64k prompt: 16k tokens is far above the local threshold, and d0's ~2 s prefill
    # weighted `over_slo` costs more than a prefill replica computing all 64k (~5 s) after a 12 s queue (were
    # that queue within the TTFT SLO). With every prefill replica at least `prefill_overflow_queue_s` behind,
    # the stall is weighted `stall`: d0 computes the suffix itself.
    n, decs, held = 64_000, [view("d0", "decode")], {"d0": 3000}
    pol = PdservePolicy(LAX_TTFT)
    backed_up = [queued(view("p0"), 12.0), queued(view("p1"), 15.0)]
    d = choose(backed_up, decs, held, n=n, policy=pol)
    assert d.local_prefill and d.prefill is None and d.reason == "prefill_overflow"
    assert d.predicted_cached_tokens == 3000 * BS
    # One prefill replica below the threshold: the prompt goes there.
    one_free = [queued(view("p0"), 12.0), queued(view("p1"), 9.0)]
    assert choose(one_free, decs, held, n=n, policy=pol).prefill == "p1"
    off = PdservePolicy(msgspec.structs.replace(LAX_TTFT, prefill_overflow_queue_s=None))
    assert choose(backed_up, decs, held, n=n, policy=off).prefill == "p0"
    # With the default TTFT SLO, a 9 s wait and a 5 s prefill are 9 s past it: d0's prefill is cheaper.
    assert choose(one_free, decs, held, n=n).local_prefill


def test_prefill_overflow_stays_off_a_busy_decode_batch() -> None:
    # The stall term: 20 running sequences would each wait the ~2 s local prefill; the prefill replica's
    # queue is cheaper (were it within the TTFT SLO).
    n, backed_up, held = 64_000, [queued(view("p0"), 12.0)], {"d0": 3000}
    pol = PdservePolicy(LAX_TTFT)
    assert choose(backed_up, [view("d0", "decode", active=20)], held, n=n, policy=pol).prefill == "p0"
    # Between two decode replicas holding the prefix, the idle one prefills it.
    decs = [view("d0", "decode", active=20), view("d1", "decode")]
    d = choose(backed_up, decs, {"d0": 3000, "d1": 3000}, n=n, policy=pol)
    assert d.local_prefill and d.decode == "d1"


def test_no_prefill_replica_means_local_prefill() -> None:
    d = choose([view("p0", ready=False)], [view("d0", "decode")])
    assert d.local_prefill and d.reason == "no_prefill_replica"


def test_draining_and_not_ready_replicas_are_never_chosen() -> None:
    pres = [view("p0", draining=True), view("p1", ready=False), view("p2", queued=50_000)]
    decs = [
        view("d0", "decode", draining=True),
        view("d1", "decode", ready=False),
        view("d2", "decode", active=99),
    ]
    d = choose(pres, decs, {"p0": 256, "p1": 256, "d0": 256, "d1": 256})
    assert (d.prefill, d.decode) == ("p2", "d2")
    with pytest.raises(NoReplicaError):
        choose([view("p0")], [view("d0", "decode", draining=True)])


def test_session_sticks_to_its_decode_replica_while_not_overloaded() -> None:
    pol = PdservePolicy()
    decs = [view("d0", "decode"), view("d1", "decode")]
    first = choose([view("p0")], decs, {"d1": 1}, session="s", policy=pol)
    assert first.decode == "d1"
    # Next turn: d0 now looks cheaper (d1 has a few more sequences) but the session stays on d1.
    decs = [view("d0", "decode"), view("d1", "decode", active=3)]
    nxt = choose([view("p0")], decs, session="s", policy=pol)
    assert nxt.decode == "d1" and nxt.reason.startswith("affinity_")


@pytest.mark.parametrize("busy", [view("d1", "decode", kv=0.95), view("d1", "decode", active=30)])
def test_session_escapes_an_overloaded_decode_replica(busy) -> None:  # type: ignore[no-untyped-def]
    pol = PdservePolicy()
    choose([view("p0")], [view("d0", "decode"), view("d1", "decode")], {"d1": 1}, session="s", policy=pol)
    nxt = choose([view("p0")], [view("d0", "decode", active=2), busy], session="s", policy=pol)
    assert nxt.decode == "d0" and not nxt.reason.startswith("affinity_")
    # and the session now sticks to its new replica
    again = choose(
        [view("p0")], [view("d0", "decode", active=3), view("d1", "decode")], session="s", policy=pol
    )
    assert again.decode == "d0"


def test_with_other_routers_a_session_follows_a_later_turn_another_router_placed() -> None:
    # This router placed the session's turn of 2048 tokens (128 blocks) on d1; another router then sent a
    # later turn to d0. d0 holds more of this prompt than that turn and d1: it holds the later turn, and the
    # session goes there by affinity, though d0 is the busier.
    def next_turn(blocks: dict[str, int], decs: list[object], others: bool) -> object:
        pol = PdservePolicy()
        first = choose([view("p0")], [view("d0", "decode"), view("d1", "decode")], {"d1": 1}, 2048, "s", pol)
        assert first.decode == "d1"
        req = msgspec.structs.replace(request(4096, "s"), other_routers=others)
        return pol.choose(req, [view("p0")], decs, FixedLookup(blocks))  # type: ignore[arg-type]

    busy_d0 = [view("d0", "decode", active=3), view("d1", "decode")]
    moved = next_turn({"d0": 200, "d1": 130}, busy_d0, others=True)
    assert moved.decode == "d0" and moved.reason.startswith("affinity_")  # type: ignore[attr-defined]
    # One router placed every turn of the session: its own placement stands.
    stays = next_turn({"d0": 200, "d1": 130}, busy_d0, others=False)
    assert stays.decode == "d1" and stays.reason.startswith("affinity_")  # type: ignore[attr-defined]
    # No more than the turn this router placed, or than its replica holds (a tie): the session stays.
    busy_d1 = [view("d0", "decode"), view("d1", "decode", active=3)]
    for blocks in ({"d0": 128, "d1": 100}, {"d0": 140, "d1": 140}):
        stays = next_turn(blocks, busy_d1, others=True)
        assert stays.decode == "d1" and stays.reason.startswith("affinity_")  # type: ignore[attr-defined]


def test_affinity_can_be_disabled() -> None:
    pol = PdservePolicy(RouterConfig(session_affinity=False))
    choose([view("p0")], [view("d0", "decode"), view("d1", "decode")], {"d1": 1}, session="s", policy=pol)
    assert (
        choose(
            [view("p0")], [view("d0", "decode"), view("d1", "decode", active=3)], session="s", policy=pol
        ).decode
        == "d0"
    )


def test_cost_weights_change_the_tradeoff() -> None:
    # With transfer made very expensive, the decode replica holding the prefix wins despite its load.
    heavy = PdservePolicy()
    heavy.weights = msgspec.structs.replace(heavy.weights, transfer=10_000.0)
    decs = [view("d0", "decode", active=15), view("d1", "decode")]
    assert choose([view("p0")], decs, {"d0": 200}, policy=heavy).decode == "d0"
    assert choose([view("p0")], decs, {"d0": 200}).decode == "d1"


def test_prefill_weight_trades_a_queue_against_a_miss() -> None:
    # p0 holds all of a session's 64k context but has 6 s queued; p1 is idle and cold, and computing the
    # prompt there takes ~5.4 s: the request's own latency says p1, a weight that charges the miss for the
    # capacity it takes from later requests says p0.
    n = 64 * 1024
    pres = [queued(view("p0"), 6.0), view("p1")]
    hit = {"p0": n // BS - 1}
    cfg = msgspec.structs.replace(LAX_TTFT, balance_weight=0.0, churn_weight=0.0)
    neutral = msgspec.structs.replace(cfg, prefill_weight=1.0)
    assert next_turn(pres, [view("d0", "decode")], hit, neutral, n).prefill == "p1"
    heavy = msgspec.structs.replace(cfg, prefill_weight=3.0)
    assert next_turn(pres, [view("d0", "decode")], hit, heavy, n).prefill == "p0"


def test_ties_go_to_the_replica_with_the_least_recent_work() -> None:
    # Idle cluster, cold prompts: every prefill replica costs the same. Taking the first in order would put
    # them all on p0; the tie-break spreads them.
    pol = PdservePolicy()
    pres = [view(f"p{i}") for i in range(4)]
    got = [choose(pres, [view("d0", "decode")], policy=pol).prefill for _ in range(8)]
    assert sorted(got) == ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"]
    # A bigger job weighs more: after one 32k-token prompt on p0, three 4k prompts all go elsewhere.
    pol = PdservePolicy()
    assert choose(pres, [view("d0", "decode")], n=32_768, policy=pol).prefill == "p0"
    rest = {choose(pres, [view("d0", "decode")], policy=pol).prefill for _ in range(3)}
    assert rest == {"p1", "p2", "p3"}


def test_a_cost_difference_beyond_the_tolerance_beats_recent_work() -> None:
    assert TIE_TOLERANCE_S == 0.05
    cfg = RouterConfig(balance_weight=0.0, churn_weight=0.0)
    pol = PdservePolicy(cfg)
    pres = [view("p0"), view("p1")]
    assert choose(pres, [view("d0", "decode")], policy=pol).prefill == "p0"  # p0 now has recent work
    # p1 has 0.04 s queued: within tolerance, so p1 (less recent work) wins; at 0.06 s, p0 wins.
    assert choose([view("p0"), queued(view("p1"), 0.04)], [view("d0", "decode")], policy=pol).prefill == "p1"
    pol = PdservePolicy(cfg)
    choose(pres, [view("d0", "decode")], policy=pol)
    assert choose([view("p0"), queued(view("p1"), 0.06)], [view("d0", "decode")], policy=pol).prefill == "p0"


def test_balance_term_charges_recent_work_above_the_pool_mean() -> None:
    # p0 got a session's 128k-token cold prompt (~19 s); now p0 holds 1k tokens of the session's next 4k
    # prompt, a hit worth ~0.12 weighted s. Without the balance term the hit wins; with it, p0's ~9 s above
    # the mean costs ~0.9 s.
    pres = [view("p0"), view("p1")]
    for weight, expected in [(0.0, "p0"), (0.1, "p1")]:
        pol = PdservePolicy(RouterConfig(balance_weight=weight, churn_weight=0.0))
        assert choose(pres, [view("d0", "decode")], n=128 * 1024, session="s", policy=pol).prefill == "p0"
        d = choose(pres, [view("d0", "decode")], {"p0": 64}, session="s", policy=pol)
        assert d.prefill == expected, weight
    # A session's big cached context (64k tokens, ~26 weighted s) outweighs the imbalance: the balance moves
    # cheap work, not sessions whose move would recompute a long context.
    pol = PdservePolicy(RouterConfig(balance_weight=0.1, churn_weight=0.0))
    choose(pres, [view("d0", "decode")], n=128 * 1024, policy=pol)
    assert choose(pres, [view("d0", "decode")], {"p0": 4000}, n=64_000, policy=pol).prefill == "p0"


def test_churn_term_charges_recent_tokens_computed_not_seconds() -> None:
    pres, dec = [view("p0"), view("p1")], [view("d0", "decode")]
    cfg = RouterConfig(balance_weight=0.0, churn_weight=0.5)
    # p0 computed a session's cold 128k-token prompt: 128k tokens written into its cache. The session's
    # next 4k prompt, whose 1k-token hit sits on p0, goes to p1; without the term it stays.
    for churn, expected in [(0.5, "p1"), (0.0, "p0")]:
        pol = PdservePolicy(msgspec.structs.replace(cfg, churn_weight=churn))
        assert choose(pres, dec, n=128 * 1024, session="s", policy=pol).prefill == "p0"
        assert choose(pres, dec, {"p0": 64}, session="s", policy=pol).prefill == expected, churn
    # p0 instead computed 2k new tokens over a cached 126k-token context: many seconds, few tokens written.
    pol = PdservePolicy(cfg)
    n = 128 * 1024
    assert choose(pres, dec, {"p0": (n - 2048) // BS}, n=n, policy=pol).prefill == "p0"
    # (Seconds that the seconds term would charge eight times as much: attention over the cached context.)
    assert pol.recent.seconds("p0") > 5 * pol.recent_tokens.seconds("p0")
    assert choose(pres, dec, {"p0": 64}, policy=pol).prefill == "p0"


def test_the_pair_search_finds_the_optimum_of_every_option() -> None:
    # The selector's O(|P| + |D|) search == the best of every (P, D) pair and offered local prefill, with
    # every feature on: pulls (readback and exports), balance and churn charges, overflow, both modes, new
    # prompts and sessions' next turns, waits past the TTFT SLO.
    rng = random.Random(7)
    n = 8192
    for _ in range(300):
        cfg = RouterConfig(
            mode=rng.choice(["auto", "disaggregate"]),
            session_affinity=False,
            local_prefill_max_tokens=rng.choice([0, 512, 1024]),
            prefill_overflow_queue_s=rng.choice([None, 1.0]),  # queues are drawn from 0-2 s
            ttft_slo_ms=rng.choice([5000.0, 800.0]),
        )
        pol = PdservePolicy(cfg)
        session = rng.choice([None, "s"])
        pres = [
            queued(view(f"p{i}", node=f"n{rng.randrange(3)}"), rng.uniform(0, 2))
            for i in range(rng.randint(1, 5))
        ]
        decs = [
            view(f"d{i}", "decode", active=rng.randrange(30), kv=rng.random(), node=f"n{rng.randrange(3)}")
            for i in range(rng.randint(1, 5))
        ]
        if session is not None:  # the session's previous turn: this one continues it
            pol.choose(request(n, session), pres, decs, FixedLookup())
        for p in pres:  # earlier work, so that the balance and churn charges differ
            pol.recent.add(p.replica_id, rng.uniform(0, 3))
            pol.recent_tokens.add(p.replica_id, rng.uniform(0, 3))
        blocks = {r.replica_id: rng.choice([0, 100, 300, 511, 512]) for r in (*pres, *decs)}
        req = msgspec.structs.replace(
            request(n, session),
            readback=Readback(rng.choice(decs).replica_id, rng.choice([0, 4000, 8000]), rng.uniform(0, 3))
            if rng.random() < 0.5
            else None,
            export_ttl_s=rng.uniform(0, 3) if rng.random() < 0.5 else None,
        )
        matched = FixedLookup(blocks).matched_blocks(req.block_hashes, blocks)
        prompt = Prompt(tokens=n, max_tokens=req.max_tokens, block_size=BS, matched=matched)
        balance = Balance(pol.recent, pol.recent_tokens, cfg.balance_weight, cfg.churn_weight)
        pull = offer(req, decs, decs, matched, prompt.most)
        scorer = Scorer(pol.weights, prompt, pull, continuing=session is not None)
        every = every_option(cfg, scorer, pres, decs, balance)
        assert all(o.total == o.terms.total for o in every)  # the search's totals are the formula's
        got = pol.choose(req, pres, decs, FixedLookup(blocks))
        best = min(o.total for o in every)
        assert best <= got.cost <= best + TIE_TOLERANCE_S
        chosen = [
            o
            for o in every
            if o.total == got.cost
            and o.decode.replica_id == got.decode
            and (None if o.local else o.computing.replica_id) == got.prefill
        ]
        assert chosen and got.terms == chosen[0].terms
        assert got.readback_tokens == chosen[0].pulled


def test_resumed_prefix_lookup_gives_the_same_decisions_as_full_lookups() -> None:
    """Over sessions' growing turns, with replicas storing and evicting blocks in between, the policy resuming
    each session's lookup from its previous turn (KvIndex.matched_blocks_memo) decides exactly as one that
    walks every prompt from its first block."""

    class FullWalk:
        def __init__(self, index: KvIndex) -> None:
            self.index = index

        def matched_blocks(self, block_hashes, replica_ids):  # type: ignore[no-untyped-def]
            return self.index.matched_blocks(block_hashes, replica_ids)

    rng = random.Random(3)
    index = KvIndex(BS)
    pres = [view(f"p{i}") for i in range(3)]
    decs = [view(f"d{i}", "decode") for i in range(3)]
    resumed, full = PdservePolicy(), PdservePolicy()
    prompts: dict[str, list[int]] = {f"s{i}": [] for i in range(4)}
    engine_hash = 0
    for turn in range(120):
        sid = rng.choice(list(prompts))
        prompts[sid] = prompts[sid] + [rng.randrange(1000) for _ in range(rng.randrange(1, 6) * BS)]
        tokens = prompts[sid]
        hashes = hash_blocks(tokens, BS)
        req = RouteRequest(
            request_id=f"q{turn}",
            session_id=sid,
            num_prompt_tokens=len(tokens),
            block_hashes=hashes,
            block_size=BS,
            max_tokens=64,
        )
        a = resumed.choose(req, pres, decs, index)
        assert a == full.choose(req, pres, decs, FullWalk(index))
        # The chosen replicas now hold the prompt; now and then another replica evicts some of its blocks.
        for rid in {a.prefill or a.decode, a.decode}:
            index.apply_stored(rid, list(range(engine_hash, engine_hash + len(hashes))), None, tokens)
            engine_hash += len(hashes)
        if rng.random() < 0.3:
            victim = rng.choice([*pres, *decs]).replica_id
            index.apply_removed(victim, rng.sample(range(engine_hash), 20))


def readback_request(tokens: int, expires_in_s: float = 300.0, n: int = N) -> RouteRequest:
    return msgspec.structs.replace(request(n), readback=Readback("d0", tokens, expires_in_s=expires_in_s))


def test_readback_lets_any_prefill_replica_start_from_the_pinned_prefix() -> None:
    # p0 holds the session's prefix but is busy; d0 keeps it pinned, so idle p1 pulls it instead of
    # computing it (without readback the 5x-weighted miss keeps the turn on p0).
    pres = [queued(view("p0"), 2.0), view("p1")]
    decs = [view("d0", "decode")]
    n = 64_000
    lookup = FixedLookup({"p0": 3900, "d0": 3900})
    plain = PdservePolicy().choose(request(n), pres, decs, lookup)
    assert plain.prefill == "p0" and plain.readback_tokens == 0
    d = PdservePolicy().choose(readback_request(3900 * BS, n=n), pres, decs, lookup)
    assert d.prefill == "p1" and d.readback_tokens == 3900 * BS
    assert d.predicted_cached_tokens == 3900 * BS  # the engine counts pulled tokens as cached


def test_readback_pull_is_charged_as_a_transfer() -> None:
    # d0 lacks more than the local-prefill threshold, so a prefill replica computes the rest. Both prefill
    # replicas idle: the one holding the prefix needs no pull and wins.
    lookup = FixedLookup({"p1": 150, "d0": 150})
    d = PdservePolicy().choose(
        readback_request(150 * BS), [view("p0"), view("p1")], [view("d0", "decode")], lookup
    )
    assert d.prefill == "p1" and d.readback_tokens == 0
    # p1 holds part of it: it pulls the rest.
    lookup = FixedLookup({"p1": 75, "d0": 150})
    d = PdservePolicy().choose(readback_request(150 * BS), [view("p1")], [view("d0", "decode")], lookup)
    assert d.prefill == "p1" and d.readback_tokens == 75 * BS and d.predicted_cached_tokens == 150 * BS


def test_readback_is_not_counted_on_past_its_expiry() -> None:
    # p1's queue outlasts the pin: it would compute the prompt in full, so busy-but-holding p0 wins.
    pres = [queued(view("p0"), 3.0), queued(view("p1"), 1.0)]
    decs = [view("d0", "decode")]
    lookup = FixedLookup({"p0": 3900, "d0": 3900})
    fresh = PdservePolicy().choose(readback_request(3900 * BS, 60, n=64_000), pres, decs, lookup)
    assert fresh.prefill == "p1" and fresh.readback_tokens == 3900 * BS
    late = PdservePolicy().choose(readback_request(3900 * BS, 0.5, n=64_000), pres, decs, lookup)
    assert late.prefill == "p0" and late.readback_tokens == 0


def test_readback_from_a_replica_that_is_gone_is_ignored() -> None:
    lookup = FixedLookup({"p0": 250})
    d = PdservePolicy().choose(
        readback_request(250 * BS), [queued(view("p0"), 3.0), view("p1")], [view("d1", "decode")], lookup
    )
    assert d.readback_tokens == 0


def export_request(ttl_s: float | None = 60.0, n: int = N) -> RouteRequest:
    return msgspec.structs.replace(request(n), export_ttl_s=ttl_s)


def test_an_export_lets_a_prefill_replica_start_from_any_decode_replicas_cached_prefix() -> None:
    # No session pin: d1 holds the prefix in its cache, no prefill replica does. With exports on, p0 pulls it
    # from d1 (which pins it on request) instead of computing it.
    pres = [view("p0")]
    decs = [view("d0", "decode"), view("d1", "decode")]
    n = 64_000
    lookup = FixedLookup({"d1": 3000})
    plain = PdservePolicy().choose(export_request(None, n=n), pres, decs, lookup)
    assert plain.readback_tokens == 0 and not plain.readback_export and plain.readback_replica is None
    d = PdservePolicy().choose(export_request(n=n), pres, decs, lookup)
    assert d.prefill == "p0" and d.readback_tokens == 3000 * BS and d.predicted_cached_tokens == 3000 * BS
    assert d.readback_export and d.readback_replica == "d1"


def test_an_export_is_only_counted_on_when_the_prefill_starts_before_it_expires() -> None:
    pres = [queued(view("p0"), 30.0)]
    decs = [view("d0", "decode")]
    lookup = FixedLookup({"d0": 3000})
    pol = PdservePolicy(msgspec.structs.replace(LAX_TTFT, prefill_overflow_queue_s=None))  # would overflow
    assert pol.choose(export_request(60.0, n=64_000), pres, decs, lookup).readback_tokens > 0
    late = pol.choose(export_request(20.0, n=64_000), pres, decs, lookup)
    assert late.readback_tokens == 0 and not late.readback_export


def test_the_sessions_pin_is_pulled_rather_than_an_export_of_the_same_prefix() -> None:
    # d0 holds the session's turn pinned and cached: no export request is needed for it. A longer prefix
    # cached on d1 is exported instead.
    pres = [view("p0")]
    decs = [view("d0", "decode"), view("d1", "decode")]
    req = msgspec.structs.replace(readback_request(3000 * BS, n=64_000), export_ttl_s=60.0)
    d = PdservePolicy().choose(req, pres, decs, FixedLookup({"d0": 3000, "d1": 3000}))
    assert d.readback_replica == "d0" and d.readback_tokens == 3000 * BS and not d.readback_export
    d = PdservePolicy().choose(req, pres, decs, FixedLookup({"d0": 3000, "d1": 3500}))
    assert d.readback_replica == "d1" and d.readback_tokens == 3500 * BS and d.readback_export
