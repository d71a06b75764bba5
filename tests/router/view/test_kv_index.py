"""KvIndex against a simple reference model under random event streams.

The reference keeps, per replica, the set of *token prefixes* (tuples) it knows are cached, and answers a
lookup by checking prefixes one block at a time: obviously correct, slow, and independent of any hashing.
Engines are simulated with their own (seeded, different per replica) engine hashes, as vLLM engines with
different hash seeds.
"""

import random

import pytest

from router.block_hash import hash_blocks
from router.view.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored
from router.view.kv_index import KvIndex

BS = 4


class FakeEngine:
    """A prefix cache that emits vLLM-shaped events."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.cached: dict[tuple[int, ...], int] = {}  # prefix -> engine hash

    def ehash(self, prefix: tuple[int, ...]) -> int:
        return hash(("engine", self.seed, prefix)) & ((1 << 64) - 1)

    def store(self, tokens: list[int], rng: random.Random) -> list[BlockStored]:
        n = len(tokens) // BS
        i = 0
        while i < n and tuple(tokens[: (i + 1) * BS]) in self.cached:
            i += 1
        events = []
        while i < n:
            j = min(n, i + rng.randint(1, 4))  # one event may carry several blocks
            hashes = []
            for k in range(i, j):
                p = tuple(tokens[: (k + 1) * BS])
                self.cached[p] = self.ehash(p)
                hashes.append(self.cached[p])
            parent = self.cached[tuple(tokens[: i * BS])] if i else None
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens[i * BS : j * BS],
                    block_size=BS,
                    medium="GPU",
                )
            )
            i = j
        return events

    def evict(self, rng: random.Random, k: int) -> BlockRemoved | None:
        if not self.cached:
            return None
        victims = rng.sample(sorted(self.cached), min(k, len(self.cached)))
        return BlockRemoved(block_hashes=[self.cached.pop(v) for v in victims], medium="GPU")


class Reference:
    def __init__(self) -> None:
        self.known: dict[str, dict[int, tuple[int, ...]]] = {}  # replica -> engine hash -> prefix

    def apply(self, rid: str, ev: object) -> None:
        known = self.known.setdefault(rid, {})
        if isinstance(ev, BlockStored):
            if ev.parent_block_hash is None:
                base: tuple[int, ...] | None = ()
            else:
                base = known.get(ev.parent_block_hash)
                if base is None:
                    base = next(
                        (k[ev.parent_block_hash] for k in self.known.values() if ev.parent_block_hash in k),
                        None,
                    )
            if base is None:
                return
            for i, e in enumerate(ev.block_hashes):
                known[e] = base + tuple(ev.token_ids[: (i + 1) * BS])
        elif isinstance(ev, BlockRemoved):
            for e in ev.block_hashes:
                known.pop(e, None)
        elif isinstance(ev, AllBlocksCleared):
            known.clear()

    def matched(self, rid: str, tokens: list[int]) -> int:
        prefixes = set(self.known.get(rid, {}).values())
        i = 0
        while (i + 1) * BS <= len(tokens) and tuple(tokens[: (i + 1) * BS]) in prefixes:
            i += 1
        return i


def _engine_truth(engine: FakeEngine, tokens: list[int]) -> int:
    i = 0
    while (i + 1) * BS <= len(tokens) and tuple(tokens[: (i + 1) * BS]) in engine.cached:
        i += 1
    return i


@pytest.mark.parametrize("span_blocks", [2, 3, 64])  # windows of 2 and 3 blocks: vouched ones are common
@pytest.mark.parametrize("seed", range(8))
def test_random_streams_match_reference(seed: int, span_blocks: int) -> None:
    rng = random.Random(seed)
    replicas = [f"r{i}" for i in range(5)]
    engines = {r: FakeEngine(seed * 100 + i) for i, r in enumerate(replicas)}
    index, ref = KvIndex(BS, span_blocks=span_blocks), Reference()
    docs = [[rng.randrange(50) for _ in range(40)] for _ in range(6)]  # shared prefixes across prompts
    prompts = [
        d[: rng.randrange(4, 40)] + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        for d in docs
        for _ in range(5)
    ]
    memos: dict[int, object] = {}
    for _step in range(600):
        rid = rng.choice(replicas)
        eng = engines[rid]
        op = rng.random()
        if op < 0.55:
            events: list[object] = list(eng.store(rng.choice(prompts), rng))
        elif op < 0.8:
            ev = eng.evict(rng, rng.randint(1, 6))
            events = [ev] if ev else []
        elif op < 0.84:
            eng.cached.clear()
            events = [AllBlocksCleared()]
        elif op < 0.88:  # engine restart: the subscriber sees the sequence reset and clears the replica
            eng.cached.clear()
            index.clear_replica(rid)
            ref.known.pop(rid, None)
            events = []
        elif op < 0.92:  # gap recovered by replay: events arrive late but in order
            events = list(eng.store(rng.choice(prompts), rng))
            held = events
            events = []
            for late in held:
                index.apply(rid, late)  # type: ignore[arg-type]
                ref.apply(rid, late)
        elif op < 0.95:  # unrecoverable gap: events lost, subscriber clears the replica
            eng.store(rng.choice(prompts), rng)
            ev2 = eng.evict(rng, 2)
            del ev2
            index.clear_replica(rid)
            ref.known.pop(rid, None)
            events = []
        elif op < 0.97:  # replica removed from the cluster and a fresh one joins under the same id
            index.remove_replica(rid)
            ref.known.pop(rid, None)
            engines[rid] = FakeEngine(rng.randrange(10**9))
            events = []
        else:
            events = []
        for event in events:
            index.apply(rid, event)  # type: ignore[arg-type]
            ref.apply(rid, event)
        k = rng.randrange(len(prompts))
        probe = prompts[k]
        got = index.matched_blocks(hash_blocks(probe, BS), replicas)
        # Resumed from the memo of an earlier lookup of a prompt from the same document (same prefix or not):
        # the same answer.
        resumed, memos[k // 5] = index.matched_blocks_memo(
            hash_blocks(probe, BS), replicas, memos.get(k // 5)
        )
        assert resumed == got
        for r in replicas:
            assert got[r] == ref.matched(r, probe), (r, _step)
            assert got[r] <= _engine_truth(engines[r], probe)


@pytest.mark.parametrize("span_blocks", [3, 64])
def test_never_over_predicts_and_is_exact_without_losses(span_blocks: int) -> None:
    rng = random.Random(7)
    eng = FakeEngine(1)
    index = KvIndex(BS, span_blocks=span_blocks)
    prompts = [[rng.randrange(30) for _ in range(rng.randrange(4, 60))] for _ in range(40)]
    for _ in range(400):
        evs: list[object] = list(eng.store(rng.choice(prompts), rng)) if rng.random() < 0.6 else []
        ev = eng.evict(rng, 3) if rng.random() < 0.4 else None
        for e in [*evs, *([ev] if ev else [])]:
            index.apply("r", e)  # type: ignore[arg-type]
        p = rng.choice(prompts)
        # Evicting a non-leaf block leaves its descendants cached but unreachable as a prefix: exact anyway.
        assert index.matched_blocks(hash_blocks(p, BS), ["r"])["r"] == _engine_truth(eng, p)


def test_unanchored_blocks_are_not_indexed_and_counted() -> None:
    index = KvIndex(BS)
    index.apply(
        "r",
        BlockStored(block_hashes=[11, 12], parent_block_hash=999, token_ids=list(range(8)), block_size=BS),
    )
    assert index.num_blocks("r") == 0 and index.stats.unanchored_blocks == 2
    index.apply("r", BlockRemoved(block_hashes=[11]))
    assert index.stats.unknown_removals == 1


def test_parent_resolved_through_another_replica() -> None:
    index = KvIndex(BS)
    toks = list(range(8))
    index.apply("a", BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=toks[:4], block_size=BS))
    index.apply("b", BlockStored(block_hashes=[2], parent_block_hash=1, token_ids=toks[4:], block_size=BS))
    h = hash_blocks(toks, BS)
    assert index.holds("b", h[1]) and not index.holds("b", h[0])
    assert index.stats.parents_from_other_replicas == 1
    assert index.matched_blocks(h, ["a", "b"]) == {"a": 1, "b": 0}


def test_reannounced_and_aliased_blocks_count_once_per_engine_hash() -> None:
    index = KvIndex(BS)
    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=BS)
    index.apply("r", ev)
    index.apply("r", ev)  # prefix-reuse report re-announces it
    # A second engine hash for the same tokens (e.g. a different engine hash config after a missed restart).
    index.apply(
        "r", BlockStored(block_hashes=[2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=BS)
    )
    h = hash_blocks([1, 2, 3, 4], BS)[0]
    index.apply("r", BlockRemoved(block_hashes=[1]))
    assert index.holds("r", h)
    index.apply("r", BlockRemoved(block_hashes=[2]))
    assert not index.holds("r", h) and len(index) == 0


@pytest.mark.parametrize(
    "event",
    [
        BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=BS, medium="CPU"
        ),
        BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=BS, group_idx=1
        ),
        BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=BS, lora_id=3
        ),
        BlockStored(
            block_hashes=[1],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=BS,
            has_extra_keys=True,
        ),
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=list(range(8)), block_size=8),
    ],
)
def test_unusable_blocks_are_skipped(event: BlockStored) -> None:
    index = KvIndex(BS)
    index.apply("r", event)
    assert len(index) == 0 and index.stats.skipped_blocks == 1


def test_remove_replica_frees_its_slot_and_entries() -> None:
    index = KvIndex(BS)
    toks = list(range(8))
    for r in ("a", "b"):
        index.apply(
            r, BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=toks, block_size=BS)
        )
    index.remove_replica("a")
    h = hash_blocks(toks, BS)
    assert index.matched_blocks(h, ["a", "b"]) == {"a": 0, "b": 2}
    index.remove_replica("b")
    assert len(index) == 0 and index.replicas() == []
    index.apply("c", BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=toks[:4], block_size=BS))
    assert index.matched_blocks(h, ["c", "a"]) == {"c": 1, "a": 0}


def test_matched_blocks_reports_each_replicas_own_prefix() -> None:
    index = KvIndex(BS)
    toks = list(range(20))
    index.apply_stored("a", [1, 2, 3, 4, 5], None, toks)
    index.apply_stored("b", [1, 2], None, toks[:8])
    index.apply_stored("c", [9], None, [7, 7, 7, 7])
    assert index.matched_blocks(hash_blocks(toks, BS), ["a", "b", "c", "zz"]) == {
        "a": 5,
        "b": 2,
        "c": 0,
        "zz": 0,
    }


@pytest.mark.parametrize("span_blocks", [3, 64])
@pytest.mark.parametrize("seed", range(6))
def test_resumed_lookup_of_growing_sessions_matches_full_walk(seed: int, span_blocks: int) -> None:
    """Sessions whose every turn extends the previous prompt (sometimes rewritten), looked up with the
    previous turn's memo while replicas store, evict, clear, and leave and rejoin: always the full walk's
    answer."""
    rng = random.Random(seed)
    replicas = [f"r{i}" for i in range(4)]
    engines = {r: FakeEngine(seed * 100 + i) for i, r in enumerate(replicas)}
    index, ref = KvIndex(BS, span_blocks=span_blocks), Reference()
    sessions: list[list[int]] = [[rng.randrange(20) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    memos: list[object | None] = [None] * len(sessions)
    for _step in range(500):
        s = rng.randrange(len(sessions))
        if rng.random() < 0.15:  # history rewritten (e.g. compaction): the memo's prefix no longer applies
            sessions[s] = sessions[s][: rng.randrange(0, len(sessions[s]) + 1)]
        sessions[s] = sessions[s] + [rng.randrange(20) for _ in range(rng.randrange(1, 9))]
        prompt = sessions[s]
        rid = rng.choice(replicas)
        op = rng.random()
        events: list[object] = []
        if op < 0.6:
            events = list(engines[rid].store(rng.choice(sessions), rng))
        elif op < 0.85:
            ev = engines[rid].evict(rng, rng.randint(1, 3))
            events = [ev] if ev else []
        elif op < 0.92:
            engines[rid].cached.clear()
            events = [AllBlocksCleared()]
        elif op < 0.96:
            index.remove_replica(rid)
            ref.known.pop(rid, None)
            engines[rid] = FakeEngine(rng.randrange(10**9))
        for event in events:
            index.apply(rid, event)  # type: ignore[arg-type]
            ref.apply(rid, event)
        hashes = hash_blocks(prompt, BS)
        got, memos[s] = index.matched_blocks_memo(hashes, replicas, memos[s])
        assert got == index.matched_blocks(hashes, replicas)
        assert got == {r: ref.matched(r, prompt) for r in replicas}, _step
        if rng.random() < 0.5:
            # The policy sent this turn to some replica, which may or may not store it (or a later turn of
            # the session) before the next lookup: the memo's expectation never changes an answer.
            index.expect_stored(memos[s], [rng.choice(replicas)], hashes)


def test_resumed_lookup_walks_only_the_new_blocks() -> None:
    """With no removal since the memo, a replica holding the previous turn is not re-checked block by
    block."""

    class CountingDict(dict[int, int]):
        gets = 0

        def get(self, key: int, default: int = 0) -> int:  # type: ignore[override]
            CountingDict.gets += 1
            return super().get(key, default)

    index = KvIndex(BS)
    turn1 = list(range(100 * BS))
    index.apply_stored("r0", list(range(100)), None, turn1)
    index._holders = CountingDict(index._holders)
    memo = index.matched_blocks_memo(hash_blocks(turn1, BS), ["r0", "r1"], None)[1]
    turn2 = turn1 + list(range(5 * BS))
    index.apply_stored("r0", list(range(100, 105)), 99, turn2[100 * BS :])
    CountingDict.gets = 0
    got, _ = index.matched_blocks_memo(hash_blocks(turn2, BS), ["r0", "r1"], memo)
    assert got == {"r0": 105, "r1": 0}
    assert CountingDict.gets <= 6  # r1 from block 0 (one check, shared), r0 from block 100 to the end
    index.apply_removed("r0", [3])  # a removal on r0 since: its memo is no longer trusted
    got, _ = index.matched_blocks_memo(hash_blocks(turn2, BS), ["r0", "r1"], memo)
    assert got == {"r0": 3, "r1": 0}


def test_a_replica_the_turn_was_sent_to_is_not_walked_again_next_turn() -> None:
    """The policy notes where it sent a turn; once that replica has stored it, the next turn's lookup checks
    it with one probe plus the new blocks, not the whole prefix it acquired."""
    index = KvIndex(BS)
    index.add_replica("d0")
    turn1 = list(range(100 * BS))
    h1 = hash_blocks(turn1, BS)
    got, memo = index.matched_blocks_memo(h1, ["d0"], None)
    assert got == {"d0": 0}
    index.expect_stored(memo, ["d0"], h1)
    index.apply_stored("d0", list(range(100)), None, turn1)  # the KV arrived (BlockStored events)
    turn2 = turn1 + list(range(5 * BS))
    holders = index._holders
    gets = 0

    class CountingDict(dict[int, int]):
        def get(self, key: int, default: int = 0) -> int:  # type: ignore[override]
            nonlocal gets
            gets += 1
            return super().get(key, default)

    index._holders = CountingDict(holders)
    got, _ = index.matched_blocks_memo(hash_blocks(turn2, BS), ["d0"], memo)
    assert got == {"d0": 100}
    assert gets <= 7  # the anchor, then blocks 100.. until the first one d0 lacks


class CountingGets(dict[int, int]):
    """The index's holder map, counting the probes a lookup makes."""

    gets = 0

    def get(self, key: int, default: int = 0) -> int:  # type: ignore[override]
        self.gets += 1
        return super().get(key, default)


def test_a_long_prefix_is_checked_a_window_at_a_time() -> None:
    """A replica that stored a chain whole answers for each window of it with one probe, also when the chain
    came in several events (a chunked prefill); a removal inside a window sends the lookup back to walking
    that window block by block, and finds the hole."""
    index = KvIndex(BS, span_blocks=8)
    tokens = list(range(64 * BS))
    for start in range(0, 64, 20):  # four events, the windows they split joined through each event's tip
        stop = min(64, start + 20)
        index.apply_stored(
            "r", list(range(start, stop)), start - 1 if start else None, tokens[start * BS : stop * BS]
        )
    index._holders = probes = CountingGets(index._holders)
    hashes = hash_blocks(tokens, BS)
    assert index.matched_blocks(hashes, ["r"]) == {"r": 64}
    assert probes.gets == 8  # one checkpoint a window
    index.apply_removed("r", [42])
    probes.gets = 0
    assert index.matched_blocks(hashes, ["r"]) == {"r": 42}
    # The five windows before the hole, the hole's window's checkpoint (held, no longer vouched for), then
    # that window block by block up to the hole.
    assert probes.gets == 5 + 1 + 3


def test_a_hole_the_engine_did_not_refill_is_still_a_hole() -> None:
    """Events no engine would send (a chain extended past a hole in it, an engine hash reused inside one
    event) leave the index with a hole inside a window: the lookup still stops at it."""
    index = KvIndex(BS, span_blocks=4)
    tokens = list(range(8 * BS))
    hashes = hash_blocks(tokens, BS)
    index.apply_stored("a", [0, 1, 2], None, tokens[: 3 * BS])
    index.apply_removed("a", [1])
    index.apply_stored("a", [3, 4, 5, 6, 7], 2, tokens[3 * BS :])  # ends window 0, whole from block 4
    assert index.matched_blocks(hashes, ["a"]) == {"a": 1}
    # Block 7's engine hash names block 4's: block 4 is dropped while window 4..7 is being stored.
    index.apply_stored("b", [10, 11, 12, 13], None, tokens[: 4 * BS])
    index.apply_stored("b", [14, 15, 16, 14], 13, tokens[4 * BS :])
    assert index.matched_blocks(hashes, ["b"]) == {"b": 4}


def test_a_chain_stored_a_block_at_a_time_keeps_one_tip_and_stays_vouched() -> None:
    """A decode stream stores its blocks one event each: the replica keeps the chain's end, not every event's,
    and each window it completes is vouched for."""
    index = KvIndex(BS, span_blocks=4)
    tokens = list(range(40 * BS))
    for b in range(40):
        index.apply_stored("r", [b], b - 1 if b else None, tokens[b * BS : (b + 1) * BS])
    assert len(index._replicas["r"].spans.tips) == 1
    index._holders = probes = CountingGets(index._holders)
    assert index.matched_blocks(hash_blocks(tokens, BS), ["r"]) == {"r": 40}
    assert probes.gets == 10


def test_removals_forgotten_to_bound_memory_are_only_those_no_vouch_needs() -> None:
    """Removal stamps are pruned once they outnumber what they guard: the one still newer than a vouched
    window's survives, and the hole it marks is still found."""
    index = KvIndex(BS, span_blocks=4)
    tokens = list(range(16 * BS))
    index.apply_stored("r", list(range(16)), None, tokens)
    index.apply_removed("r", [9])  # a hole in window 8..11, vouched at the store
    for k in range(400):  # other chains, each stored and removed: a stamp each in windows of their own
        other = [100_000 + 8 * k + t for t in range(2 * BS)]
        index.apply_stored("r", [1000 + 2 * k, 1001 + 2 * k], None, other)
        index.apply_removed("r", [1000 + 2 * k, 1001 + 2 * k])
    spans = index._replicas["r"].spans
    assert len(spans.broken) < 300  # pruned
    assert index.matched_blocks(hash_blocks(tokens, BS), ["r"]) == {"r": 9}
