"""Which replica holds which KV blocks, keyed by the router's own block hashes.

Fed by engine KV events (`router.view.kv_events`), read by the routing policy through `matched_blocks` (the
`PrefixLookup` protocol of `router.policy.types`).

Identity: a `BlockStored` event carries the blocks' token ids; the index hashes them with `router.block_hash`
(chained from the parent block's router hash), so routing never depends on the engine's hash seed. Per replica
it keeps engine hash -> the block's entry (its router hash, window and position: `router.view.kv_spans`), so a
`BlockRemoved` (which names engine hashes only) finds its block.

Unanchored blocks: a `BlockStored` whose parent engine hash this replica's map does not know (its parent was
stored before the router subscribed, or its event was lost) is resolved through the other replicas' maps
(engines with the same hash configuration name the same content with the same engine hash; a 64-bit
coincidence across different configurations is negligible). If no replica knows the parent the blocks cannot
be placed in the chain: they are not indexed and are counted in `stats.unanchored_blocks`. The engine may
still hold them, so the router then under-predicts hits for that prefix, which is the safe direction (it never
promises a hit the engine lacks). Their descendants are unanchored too, until the prefix is stored again from
its root.

Events the router cannot use are counted and skipped: blocks from another KV cache group (`group_idx` not 0),
another medium (e.g. CPU offload tiers), LoRA adapters or extra hash keys (multimodal, cache salt), and a
block size other than the index's.

Lookup: exact, one probe per window of 64 blocks the replica's own events vouch for (`router.view.kv_spans`).

Memory: one dict entry router hash -> replica bitmask (single-bit masks are shared objects) and one dict entry
per (replica, block) engine hash -> entry, an int of three words (bench/routing_decision.py prints the bytes
per indexed block).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

import msgspec

from router.block_hash import hash_blocks
from router.view.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from router.view.kv_spans import DEFAULT_SPAN_BLOCKS, ReplicaSpans, Spans, block_of
from router.view.prefix_memo import PrefixMemo

DEFAULT_MEDIA: frozenset[str | None] = frozenset({None, "GPU"})


class KvIndexStats(msgspec.Struct, kw_only=True):
    stored_blocks: int = 0
    removed_blocks: int = 0
    # Removals of engine hashes the index never indexed (unanchored, skipped, or stored before subscribing).
    unknown_removals: int = 0
    unanchored_blocks: int = 0
    # Parents found only in another replica's engine-hash map.
    parents_from_other_replicas: int = 0
    skipped_blocks: int = 0
    clears: int = 0


class _Replica:
    __slots__ = ("bit", "engine_to_entry", "extra_refs", "removed_at", "slot", "spans")

    def __init__(self, slot: int, removed_at: int) -> None:
        self.slot = slot
        self.bit = 1 << slot
        # Removal clock at this replica's latest block removal (or its creation: memos older than the
        # replica, e.g. of a removed replica with the same id, are not trusted).
        self.removed_at = removed_at
        self.engine_to_entry: dict[int, int] = {}
        # router hash -> number of additional engine hashes of this replica naming it (rare; only counts > 1)
        self.extra_refs: dict[int, int] = {}
        self.spans = ReplicaSpans()


class KvIndex:
    """Per-replica block sets keyed by router block hash. Single-threaded (one event loop)."""

    def __init__(
        self,
        block_size: int,
        media: frozenset[str | None] = DEFAULT_MEDIA,
        group_idx: int = 0,
        span_blocks: int = DEFAULT_SPAN_BLOCKS,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.media = media
        self.group_idx = group_idx
        self.stats = KvIndexStats()
        self._holders: dict[int, int] = {}  # router hash -> bitmask of replica slots
        self._spans = Spans(span_blocks)  # whole windows of chains, checked with one probe (kv_spans.py)
        self._replicas: dict[str, _Replica] = {}
        self._slot_ids: list[str | None] = []  # slot -> replica id
        self._bits: list[int] = []  # slot -> shared int object 1 << slot
        self._slot_spans: list[ReplicaSpans] = []  # slot -> its replica's windows
        # Advances at every block removal (and replica creation); see PrefixMemo.
        self._removal_clock = 0
        # Replica-id lists asked about -> their slots' bitmask (a router asks about the same few lists);
        # emptied when membership changes.
        self._masks: dict[tuple[str, ...], int] = {}

    # ---- replicas ----------------------------------------------------------------------

    def add_replica(self, replica_id: str) -> None:
        if replica_id in self._replicas:
            return
        try:
            slot = self._slot_ids.index(None)  # reuse a removed replica's slot so masks stay small
            self._slot_ids[slot] = replica_id
        except ValueError:
            slot = len(self._slot_ids)
            self._slot_ids.append(replica_id)
            self._bits.append(1 << slot)
            self._slot_spans.append(ReplicaSpans())
        self._removal_clock += 1
        rep = self._replicas[replica_id] = _Replica(slot, self._removal_clock)
        self._slot_spans[slot] = rep.spans
        self._masks.clear()

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica that left the cluster (its slot may be reused)."""
        if replica_id not in self._replicas:
            return
        self.clear_replica(replica_id)
        rep = self._replicas.pop(replica_id)
        self._slot_ids[rep.slot] = None
        self._masks.clear()

    def clear_replica(self, replica_id: str) -> None:
        """The replica's cache is empty (engine restart, AllBlocksCleared, or lost events)."""
        rep = self._replicas.get(replica_id)
        if rep is None:
            return
        self.stats.clears += 1
        self._removal_clock += 1
        rep.removed_at = self._removal_clock
        keep = ~rep.bit
        holders = self._holders
        for r in set(map(block_of, rep.engine_to_entry.values())):
            m = holders.get(r, 0) & keep
            if m:
                holders[r] = m
            else:
                holders.pop(r, None)
        rep.engine_to_entry.clear()
        rep.extra_refs.clear()
        rep.spans.clear()

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def num_blocks(self, replica_id: str) -> int:
        rep = self._replicas.get(replica_id)
        return 0 if rep is None else len(rep.engine_to_entry)

    def __len__(self) -> int:
        """Distinct router hashes held by at least one replica."""
        return len(self._holders)

    def holds(self, replica_id: str, router_hash: int) -> bool:
        rep = self._replicas.get(replica_id)
        return rep is not None and bool(self._holders.get(router_hash, 0) & rep.bit)

    # ---- events ----------------------------------------------------------------------

    def apply(self, replica_id: str, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            if (
                event.medium not in self.media
                or (event.group_idx or 0) != self.group_idx
                or event.lora_id is not None
                or event.lora_name is not None
                or event.has_extra_keys
                or event.block_size != self.block_size
            ):
                self.stats.skipped_blocks += len(event.block_hashes)
                return
            self.apply_stored(replica_id, event.block_hashes, event.parent_block_hash, event.token_ids)
        elif isinstance(event, BlockRemoved):
            if event.medium not in self.media or (event.group_idx or 0) != self.group_idx:
                return
            self.apply_removed(replica_id, event.block_hashes)
        elif isinstance(event, AllBlocksCleared) and (event.medium is None or event.medium in self.media):
            self.clear_replica(replica_id)

    def apply_stored(
        self,
        replica_id: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int],
    ) -> int:
        """Index blocks stored on a replica; returns how many were indexed (0 when unanchored)."""
        self.add_replica(replica_id)
        rep = self._replicas[replica_id]
        n = min(len(engine_hashes), len(token_ids) // self.block_size)
        if n == 0:
            return 0
        parent: int | None = None  # the parent's entry
        if parent_engine_hash is not None:
            parent = self._resolve_parent(rep, parent_engine_hash)
            if parent is None:
                self.stats.unanchored_blocks += n
                return 0
        tokens = token_ids[: n * self.block_size]
        router_hashes = hash_blocks(tokens, self.block_size, None if parent is None else block_of(parent))
        entries = self._spans.entries(router_hashes, parent)
        self._spans.tick += 1
        since = self._spans.tick
        bit = rep.bit
        shared_bit = self._bits[rep.slot]
        holders = self._holders
        e2e = rep.engine_to_entry
        for e, r, x in zip(engine_hashes, router_hashes, entries, strict=False):
            prev = e2e.get(e)
            if prev == x:
                continue  # re-announced block (e.g. prefix-cache reuse report)
            if prev is not None:  # an engine hash reused for other content after a missed removal
                self._forget(rep, [prev])
            e2e[e] = x
            m = holders.get(r, 0)
            if m & bit:
                rep.extra_refs[r] = rep.extra_refs.get(r, 1) + 1
            else:
                holders[r] = (m | bit) if m else shared_bit
        self._spans.stored(rep.spans, entries, parent, since)
        self.stats.stored_blocks += n
        return n

    def apply_removed(self, replica_id: str, engine_hashes: Iterable[int]) -> None:
        rep = self._replicas.get(replica_id)
        if rep is None:
            return
        e2e, gone = rep.engine_to_entry, []
        for e in engine_hashes:
            x = e2e.pop(e, None)
            if x is None:
                self.stats.unknown_removals += 1
                continue
            gone.append(x)
        self.stats.removed_blocks += len(gone)
        self._forget(rep, gone)

    def _forget(self, rep: _Replica, gone: list[int]) -> None:
        """An engine hash of `rep` naming each of these entries is gone."""
        dropped = []
        holders, extra_refs, keep = self._holders, rep.extra_refs, ~rep.bit
        for x in gone:
            r = block_of(x)
            refs = extra_refs.pop(r, None)
            if refs is not None:  # another engine hash of `rep` still names it
                if refs > 2:
                    extra_refs[r] = refs - 1
                continue
            dropped.append(x)
            m = holders.get(r, 0) & keep
            if m:
                holders[r] = m
            else:
                holders.pop(r, None)
        if dropped:
            self._removal_clock += 1
            rep.removed_at = self._removal_clock
            self._spans.removed(rep.spans, dropped)

    def _resolve_parent(self, rep: _Replica, parent_engine_hash: int) -> int | None:
        """The parent block's entry."""
        r = rep.engine_to_entry.get(parent_engine_hash)
        if r is not None:
            return r
        for other in self._replicas.values():
            if other is not rep:
                r = other.engine_to_entry.get(parent_engine_hash)
                if r is not None:
                    self.stats.parents_from_other_replicas += 1
                    return r
        return None

    # ---- lookup ----------------------------------------------------------------------

    def matched_blocks(self, block_hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """Number of leading blocks of `block_hashes` each replica holds (0 for unknown replicas)."""
        return self.matched_blocks_memo(block_hashes, replica_ids, None)[0]

    def matched_blocks_memo(
        self, block_hashes: Sequence[int], replica_ids: Iterable[str], memo: object | None
    ) -> tuple[dict[str, int], PrefixMemo]:
        """`matched_blocks`, resumed from `memo` (a `PrefixMemo` of an earlier lookup, e.g. the session's
        previous turn; anything else is ignored), and the memo of this lookup.

        The walk checks block i for the replicas that held every block before i. A replica the memo vouches
        for (no removal since, same prefix) joins the walk at its memo count instead of at block 0, so a
        session's next turn checks its new blocks, not its whole history. Same result as the full walk."""
        ids = tuple(replica_ids)
        result = dict.fromkeys(ids, 0)
        asked = self._mask_of(ids)
        holders = self._holders
        joins: dict[int, int] = {}  # block position -> replicas known to hold every block before it
        n = len(block_hashes)
        if isinstance(memo, PrefixMemo):
            anchors, stamp = memo.anchors, memo.stamp
            for rid, m in memo.counts.items():
                rep = self._replicas.get(rid)
                if (
                    rep is not None
                    and asked & rep.bit
                    and 0 < m <= n
                    and rep.removed_at <= stamp
                    and block_hashes[m - 1] == anchors[m]
                    and holders.get(anchors[m], 0) & rep.bit
                ):
                    joins[m] = joins.get(m, 0) | rep.bit
        # Replicas walked from block 0: every one asked about that the memo does not vouch for.
        alive = asked
        for mask in joins.values():
            alive &= ~mask
        i = 0
        for join, mask in sorted(joins.items()):
            if alive:
                alive = self._walk(block_hashes, i, join, alive, result)
            alive |= mask
            i = join
        if alive:
            alive = self._walk(block_hashes, i, n, alive, result)
            self._record(result, alive, n)
        new_counts = {rid: c for rid, c in result.items() if c}
        return result, PrefixMemo(
            self._removal_clock, new_counts, {c: block_hashes[c - 1] for c in new_counts.values()}
        )

    def _mask_of(self, ids: tuple[str, ...]) -> int:
        mask = self._masks.get(ids)
        if mask is None:
            if len(self._masks) >= 64:
                self._masks.clear()
            mask = 0
            for rid in ids:
                rep = self._replicas.get(rid)
                if rep is not None:
                    mask |= rep.bit
            self._masks[ids] = mask
        return mask

    def expect_stored(self, memo: object, replica_ids: Iterable[str], block_hashes: Sequence[int]) -> None:
        """Note in `memo` (from `matched_blocks_memo` of `block_hashes`) that these replicas will hold every
        block of `block_hashes`: the request was sent there. The session's next turn then checks each with
        one probe instead of walking the whole prefix it just acquired (see `PrefixMemo`).

        A replica that already holds the last block without all before it (a hole left by an eviction) is
        not noted: holding that block later would not mean it was stored with its prefix."""
        if not isinstance(memo, PrefixMemo) or not block_hashes:
            return
        m = len(block_hashes)
        anchor = block_hashes[m - 1]
        held = self._holders.get(anchor, 0)
        for rid in replica_ids:
            rep = self._replicas.get(rid)
            if rep is None or memo.counts.get(rid, 0) == m or held & rep.bit:
                continue
            memo.counts[rid] = m
            memo.anchors[m] = anchor

    def _walk(
        self, block_hashes: Sequence[int], start: int, stop: int, alive: int, result: dict[str, int]
    ) -> int:
        """Check blocks start..stop-1 for the `alive` replicas (each holds every block before `start`); record
        where each one's prefix ends; return those that hold them all (`Spans.walk`)."""

        def scan(first: int, end: int, replicas: int) -> int:
            return self._scan(block_hashes, first, end, replicas, result)

        return self._spans.walk(block_hashes, start, stop, alive, self._holders.get, self._slot_spans, scan)

    def _scan(
        self, block_hashes: Sequence[int], start: int, stop: int, alive: int, result: dict[str, int]
    ) -> int:
        """`_walk`, one block at a time."""
        get = self._holders.get
        i = start
        # A segment after a join is short (a turn's new blocks): copy it rather than skip to it.
        for h in block_hashes[start:stop] if start else islice(block_hashes, stop):
            m = get(h, 0) & alive
            if m != alive:
                if i:  # counts start at 0: most replicas lack a prompt's first block
                    self._record(result, alive & ~m, i)
                alive = m
                if not alive:
                    return 0
            i += 1
        return alive

    def _record(self, result: dict[str, int], mask: int, count: int) -> None:
        slot_ids = self._slot_ids
        while mask:
            low = mask & -mask
            rid = slot_ids[low.bit_length() - 1]
            assert rid is not None
            result[rid] = count
            mask ^= low
