"""Baselines behave as their public descriptions say."""

from policy_helpers import BS, FixedLookup, request, view

from bench.replay.baselines import (
    LAUNCHER_DEFAULTS,
    RUST_DEFAULTS,
    DynamoConditionalPolicy,
    DynamoKvPolicy,
    SGLangCacheAwareConfig,
    SGLangCacheAwarePolicy,
)
from router.view.kv_index import KvIndex


def test_defaults_match_sglang_rust_router_and_launcher() -> None:
    assert (
        RUST_DEFAULTS.cache_threshold,
        RUST_DEFAULTS.balance_abs_threshold,
        RUST_DEFAULTS.balance_rel_threshold,
    ) == (0.5, 32, 1.1)
    assert (
        LAUNCHER_DEFAULTS.cache_threshold,
        LAUNCHER_DEFAULTS.balance_abs_threshold,
        LAUNCHER_DEFAULTS.balance_rel_threshold,
    ) == (0.3, 64, 1.5)


def test_sglang_routes_to_matching_tree_above_threshold_else_smallest_tree() -> None:
    pol = SGLangCacheAwarePolicy(SGLangCacheAwareConfig(cache_threshold=0.5))
    pres = [view("p0"), view("p1")]
    decs = [view("d0", "decode")]
    a = request(1600, hashes=list(range(100)))
    first = pol.choose(a, pres, decs, FixedLookup())
    assert first.reason == "sglang_smallest_tree" and first.prefill == "p0"  # empty trees: first smallest
    # 60% of the next prompt matches p0's tree: > 0.5, so it follows the cache
    b = request(1600, hashes=[*range(60), *range(1000, 1040)])
    assert pol.choose(b, pres, decs, FixedLookup()).prefill == "p0"
    # 40% match: below threshold -> smallest tree (p1 is empty)
    c = request(1600, hashes=[*range(40), *range(2000, 2060)])
    d = pol.choose(c, pres, decs, FixedLookup())
    assert (d.prefill, d.reason) == ("p1", "sglang_smallest_tree")


def test_sglang_imbalance_needs_both_thresholds() -> None:
    pol = SGLangCacheAwarePolicy(RUST_DEFAULTS)  # abs 32, rel 1.1
    decs = [view("d0", "decode")]
    a = request(1600, hashes=list(range(100)))
    pol.choose(a, [view("p0"), view("p1")], decs, FixedLookup())  # p0 now holds the prompt
    # abs diff 33 > 32 and 100 > 67*1.1: imbalanced -> shortest queue despite the cache match
    d = pol.choose(a, [view("p0", reqs=100), view("p1", reqs=67)], decs, FixedLookup())
    assert (d.prefill, d.reason) == ("p1", "sglang_balance")
    # abs diff 33 but 400 < 367*1.1: balanced -> cache
    pol2 = SGLangCacheAwarePolicy(RUST_DEFAULTS)
    pol2.choose(a, [view("p0"), view("p1")], decs, FixedLookup())
    d = pol2.choose(a, [view("p0", reqs=400), view("p1", reqs=367)], decs, FixedLookup())
    assert (d.prefill, d.reason) == ("p0", "sglang_cache_hit")


def test_sglang_tree_is_bounded() -> None:
    pol = SGLangCacheAwarePolicy(SGLangCacheAwareConfig(max_tree_blocks=50, cache_threshold=0.1))
    decs = [view("d0", "decode")]
    pol.choose(request(1600, hashes=list(range(100))), [view("p0")], decs, FixedLookup())
    assert pol._tree.size("p0") == 50
    # The root end of the path is the most recent: the prefix survives, the tail was evicted.
    d = pol.choose(
        request(1600, hashes=list(range(100))), [view("p0"), view("p1", reqs=0)], decs, FixedLookup()
    )
    assert d.prefill == "p0" and d.cost == 50 * BS / 1600


def test_dynamo_cost_is_overlap_weighted_prefill_blocks_plus_decode_blocks() -> None:
    index = KvIndex(BS)
    toks = list(range(64 * BS))
    index.apply_stored("p0", list(range(64)), None, toks)
    from router.block_hash import hash_blocks

    req = request(64 * BS, hashes=hash_blocks(toks, BS))
    pol = DynamoKvPolicy()
    # p0: prefill blocks (0 queued + 0 new)/16 = 0, decode blocks (0 + 1024)//16 = 64 -> 64
    # p1: prefill blocks 64, decode 64 -> 128
    d = pol.choose(req, [view("p0"), view("p1")], [view("d0", "decode")], index)
    assert d.prefill == "p0" and d.cost == 64.0
    # Queue on p0 of 40 blocks: logit 40 + (640+1024)//16 = 144 > p1's 128
    d = pol.choose(req, [view("p0", queued=640), view("p1")], [view("d0", "decode")], index)
    assert d.prefill == "p1" and d.cost == 128.0


def test_dynamo_conditional_prefills_a_short_uncached_suffix_on_the_decode_worker_its_kv_router_picks() -> (
    None
):
    pol = DynamoConditionalPolicy()
    pres = [view("p0"), view("p1")]
    decs = [view("d0", "decode"), view("d1", "decode")]
    # d1 holds all but 512 tokens (<= max_local_prefill_length 1000): the KV router picks it, it prefills.
    d = pol.choose(request(4096), pres, decs, FixedLookup({"d1": (4096 - 512) // BS}))
    assert (d.decode, d.prefill, d.local_prefill, d.reason) == ("d1", None, True, "dynamo_local")
    # 3000 uncached tokens: remote prefill, on the prefill worker Dynamo's KV cost picks (p1 holds more).
    d = pol.choose(request(4096), pres, decs, FixedLookup({"d1": 1096 // BS, "p1": 2048 // BS}))
    assert (d.decode, d.prefill, d.local_prefill, d.reason) == ("d1", "p1", False, "dynamo_conditional")
    # With the prefill queue full (max_prefill_queue_size per worker), the decode worker prefills it anyway.
    busy = [view("p0", reqs=2), view("p1", reqs=2)]
    d = pol.choose(request(4096), busy, decs, FixedLookup({"d1": 1096 // BS}))
    assert d.local_prefill and d.decode == "d1"
    # No eligible prefill worker at all: local.
    assert pol.choose(request(4096), [view("p0", ready=False)], decs, FixedLookup()).local_prefill
