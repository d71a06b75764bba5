"""What a cluster's caches could hit on a trace at best, to read a policy's hit ratio against.

- `infinite_cache_hit_ratio` (traces.py): every block ever seen stays cached — the issue's bound.
- `pooled_lru_hit_ratio`: one LRU prefix cache as large as several replicas' caches together, seeing every
  request in replay order: roughly what routing can reach with LRU caches (vLLM's eviction) if it never
  stores a block twice. A disaggregated request stores its prompt on its prefill and its decode replica, so
  the prefill pool's caches pooled are the mark for prefill hits unless turns are prefilled on decode.
- `belady_hit_ratio`: the same pooled capacity with optimal replacement (evict the block needed furthest in
  the future, per block): what capacity alone allows, whatever the eviction policy.

Order: open-loop traces (Mooncake) in arrival order, as replayed. Closed-loop traces (agent sessions) session
after session, the order of the infinite-cache bound: the replay interleaves its concurrent sessions, so for
them these ceilings are optimistic (one session at a time never evicts another's prefix).
"""

from __future__ import annotations

import heapq

from bench.replay.cache import LruBlockCache
from bench.replay.traces import Trace, TraceRequest


def _in_replay_order(trace: Trace) -> list[TraceRequest]:
    reqs = list(trace.requests())
    if not trace.closed_loop:
        reqs.sort(key=lambda r: r.arrival_s)
    return reqs


def pooled_lru_hit_ratio(trace: Trace, capacity_blocks: int) -> float:
    cache = LruBlockCache("pooled", capacity_blocks)
    hits = total = 0
    for r in _in_replay_order(trace):
        hits += cache.access(r.block_hashes)
        total += len(r.block_hashes)
    return hits / total if total else 0.0


def belady_hit_ratio(trace: Trace, capacity_blocks: int) -> float:
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    seq = [h for r in _in_replay_order(trace) for h in r.block_hashes]
    never = len(seq)
    next_use = [never] * len(seq)
    last: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = last.get(seq[i], never)
        last[seq[i]] = i
    cached: dict[int, int] = {}  # block -> its next use
    furthest: list[tuple[int, int]] = []  # (-next use, block); stale entries skipped
    hits = 0
    for i, h in enumerate(seq):
        if h in cached:
            hits += 1
        elif len(cached) >= capacity_blocks:
            if next_use[i] == never:
                continue  # never needed again: not worth a slot (optimal replacement bypasses it)
            while True:
                neg, victim = heapq.heappop(furthest)
                if cached.get(victim) == -neg:
                    break
            if -neg < next_use[i]:  # every cached block is needed sooner than this one: keep them
                heapq.heappush(furthest, (neg, victim))
                continue
            del cached[victim]
        cached[h] = next_use[i]
        heapq.heappush(furthest, (-next_use[i], h))
    return hits / len(seq) if seq else 0.0
