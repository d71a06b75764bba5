"""Feeds the simulated caches' events into the router's real `KvIndex`, as vLLM's KV-event publisher would.

A simulated engine names its blocks with its own hashes (here: the router hash xor a salt, so the two differ
as they do live) and publishes the blocks' token ids; the index re-hashes the token ids with the router's
chain, maps engine hash -> router hash, and resolves removals through that map: the live code path, minus
ZMQ."""

from __future__ import annotations

from bench.replay.traces import Trace
from router.view.kv_index import KvIndex

_ENGINE_SALT = 0x5EED_5EED_5EED_5EED


class KvIndexFeed:
    """`CacheEvents` sink that updates a `KvIndex`; the policy queries `self.index`."""

    def __init__(self, trace: Trace, replica_ids: list[str]) -> None:
        self.index = KvIndex(block_size=trace.hasher.token_block_size)
        for rid in replica_ids:
            self.index.add_replica(rid)
        self._tokens = trace.hasher.tokens

    def on_stored(self, replica_id: str, block_hashes: list[int], parent_hash: int | None) -> None:
        self.index.apply_stored(
            replica_id,
            [h ^ _ENGINE_SALT for h in block_hashes],
            None if parent_hash is None else parent_hash ^ _ENGINE_SALT,
            self._tokens(block_hashes),
        )

    def on_removed(self, replica_id: str, block_hashes: list[int]) -> None:
        self.index.apply_removed(replica_id, [h ^ _ENGINE_SALT for h in block_hashes])
