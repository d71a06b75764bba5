"""A replica's prefix cache: capacity-bounded LRU over block hashes, emitting vLLM-style KV events.

Like vLLM's prefix cache, a hit is a prefix: the leading blocks of a prompt that are present, up to the
first missing one. Inserting (or hitting) blocks makes them most recently used; when full, the least
recently used block is evicted. Within one prompt the tail is older than the head, as in vLLM (it frees a
request's blocks in reverse order so that tail blocks are evicted first): a chain is lost from its end,
never leaving a tail whose head is gone. Every insertion is reported as BlockStored and every eviction as
BlockRemoved, to whoever listens (the simulator forwards them to the router's KvIndex), so the router sees
what it would see live. Blocks of running requests are not pinned: with a capacity large against one prompt,
that rarely matters, and it keeps the model simple (documented approximation)."""

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
        # Oldest first; the value is unused (an ordered set).
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def lru_order(self) -> list[int]:
        """Blocks from least to most recently used."""
        return list(self._blocks)

    def prefix_hits(self, block_hashes: Sequence[int]) -> int:
        """Leading blocks present, without touching recency."""
        n = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def access(self, block_hashes: Sequence[int]) -> int:
        """A request computes this prompt here: returns its cached prefix length (blocks), then holds all
        of its blocks, most recently used (the head most recent), evicting as needed."""
        hits = self.prefix_hits(block_hashes)
        blocks = self._blocks
        # New blocks are announced in contiguous runs, each with its parent, as the engine does.
        run: list[int] = []
        run_parent: int | None = block_hashes[hits - 1] if hits else None
        for i in range(hits, len(block_hashes)):
            h = block_hashes[i]
            if h in blocks:
                # Present past the first miss (its prefix was evicted): recomputed, kept, already announced.
                self._announce(run, run_parent)
                run = []
                run_parent = h
            else:
                blocks[h] = None
                run.append(h)
        self._announce(run, run_parent)
        for h in reversed(block_hashes):
            blocks.move_to_end(h)
        self._evict()
        return hits

    def _announce(self, run: list[int], parent: int | None) -> None:
        if run and self._events is not None:
            self._events.on_stored(self.replica_id, run, parent)

    def _evict(self) -> None:
        if self.capacity is None or len(self._blocks) <= self.capacity:
            return
        evicted: list[int] = []
        while len(self._blocks) > self.capacity:
            h, _ = self._blocks.popitem(last=False)
            evicted.append(h)
        if self._events is not None:
            self._events.on_removed(self.replica_id, evicted)
