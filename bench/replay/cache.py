"""A replica's prefix cache: capacity-bounded LRU over block hashes, emitting vLLM-style KV events.

Like vLLM's prefix cache, a hit is a prefix: the leading blocks of a prompt that are present, up to the
first missing one. Inserting (or hitting) blocks makes them most recently used; when full, the least
recently used block is evicted. Within one prompt the tail is older than the head, as in vLLM (it frees a
request's blocks in reverse order so that tail blocks are evicted first): a chain is lost from its end,
never leaving a tail whose head is gone. Every insertion is reported as BlockStored and every eviction as
BlockRemoved, to whoever listens (the simulator forwards them to the router's KvIndex), so the router sees
what it would see live. A prompt computed on a prefill replica is not pinned while it waits for its KV
transfer (with a capacity large against one prompt that rarely matters); a decode replica's running
sequences are (`access(pin=True)`): their blocks are allocated until they finish.

Pins (KV readback): a decode engine keeps a finished request's blocks allocated until a prefill engine reads
them or their TTL passes. Pinned blocks stay in the cache (hits), are never evicted, and count against the
capacity, so they shrink what the LRU part can keep (with every block pinned, a new prompt's blocks are not
kept at all); unpinned, a block rejoins the LRU as most recently used (vLLM frees it then). Running
sequences may need more than the capacity: `overflow` records the most blocks held above it (a real engine
would make new sequences wait or preempt one)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class CacheEvents(Protocol):
    def on_stored(self, replica_id: str, block_hashes: list[int], parent_hash: int | None) -> None: ...

    def on_removed(self, replica_id: str, block_hashes: list[int]) -> None: ...


class LruBlockCache:
    def __init__(
        self, replica_id: str, capacity_blocks: int | None, events: CacheEvents | None = None
    ) -> None:
        """`capacity_blocks=None`: unbounded (the infinite-cache bound)."""
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.replica_id = replica_id
        self.capacity = capacity_blocks
        self._events = events
        # Oldest first; the value is unused (an ordered set). Pinned blocks are out of it, counted by pins.
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._pinned: dict[int, int] = {}
        self.overflow = 0

    def __len__(self) -> int:
        return len(self._blocks) + len(self._pinned)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks or block_hash in self._pinned

    @property
    def pinned_blocks(self) -> int:
        return len(self._pinned)

    def pin(self, block_hashes: Sequence[int]) -> list[int]:
        """Pin the blocks still present; returns them (what `unpin` must be given back)."""
        pinned = []
        for h in block_hashes:
            if h in self._pinned:
                self._pinned[h] += 1
            elif h in self._blocks:
                del self._blocks[h]
                self._pinned[h] = 1
            else:
                continue
            pinned.append(h)
        return pinned

    def unpin(self, block_hashes: Sequence[int]) -> None:
        for h in reversed(block_hashes):  # the head most recently freed, as access() leaves a prompt
            n = self._pinned[h] - 1
            if n:
                self._pinned[h] = n
            else:
                del self._pinned[h]
                self._blocks[h] = None
        self._evict()

    def lru_order(self) -> list[int]:
        """Blocks from least to most recently used."""
        return list(self._blocks)

    def prefix_hits(self, block_hashes: Sequence[int]) -> int:
        """Leading blocks present, without touching recency."""
        n = 0
        blocks, pinned = self._blocks, self._pinned
        for h in block_hashes:
            if h not in blocks and h not in pinned:
                break
            n += 1
        return n

    def access(self, block_hashes: Sequence[int], *, pin: bool = False) -> int:
        """A request computes this prompt here: returns its cached prefix length (blocks), then holds all
        of its blocks, most recently used (the head most recent), evicting as needed. `pin`: the blocks stay
        allocated (a running sequence) until `unpin(block_hashes)`."""
        hits = self.prefix_hits(block_hashes)
        blocks, pinned = self._blocks, self._pinned
        # New blocks are announced in contiguous runs, each with its parent, as the engine does.
        run: list[int] = []
        run_parent: int | None = block_hashes[hits - 1] if hits else None
        for i in range(hits, len(block_hashes)):
            h = block_hashes[i]
            if h in blocks or h in pinned:
                # Present past the first miss (its prefix was evicted): recomputed, kept, already announced.
                self._announce(run, run_parent)
                run = []
                run_parent = h
            else:
                blocks[h] = None
                run.append(h)
        self._announce(run, run_parent)
        for h in reversed(block_hashes):
            if h in blocks:
                blocks.move_to_end(h)
        if pin:
            self.pin(block_hashes)
        self._evict()
        return hits

    def _announce(self, run: list[int], parent: int | None) -> None:
        if run and self._events is not None:
            self._events.on_stored(self.replica_id, run, parent)

    def _evict(self) -> None:
        if self.capacity is None or len(self) <= self.capacity:
            return
        evicted: list[int] = []
        while self._blocks and len(self) > self.capacity:
            h, _ = self._blocks.popitem(last=False)
            evicted.append(h)
        self.overflow = max(self.overflow, len(self) - self.capacity)
        if evicted and self._events is not None:
            self._events.on_removed(self.replica_id, evicted)
