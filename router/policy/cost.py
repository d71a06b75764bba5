"""pdserve's routing cost: one formula, in estimated seconds of this request's latency.

    cost(P, D) = w_prefill  * prefill_s(uncached on P, cached on P)    computing the prompt on P
               + w_queue    * queued_prefill_s(P)                     waiting behind P's queued prompts
               + w_transfer * transfer_s(tokens D lacks, P~D node)     pulling the KV from P to D
               + w_decode   * out * tpot_s(active(D) + 1, context(D) + prompt)   decoding the reply on D
               + kv_full_s  * kv_usage(D)                             KV pressure on D (preemption risk)
             [ + w_stall    * prefill_s * (active(D) + 1)             local prefill only: D's batch waits ]

(w_stall is `long_stall` for a local prefill of a suffix longer than the local-prefill threshold, outside
prefill overflow: see below.)

Every time comes from `router.policy.service_time.ServiceTimeModel`, the model the trace replay charges, so a
cached token is worth what it saves: a hit on a long context saves the attention over all of it (quadratic),
which a count of tokens undervalues against a few thousand queued tokens. `queued_prefill_s(P)` is the sum of
the same estimate over the prompts queued on P (`router.load.LoadTracker` keeps it; `out` is the request's
`max_tokens`, capped at `max_output_tokens` because clients often send a large ceiling).

For the local-prefill option (D computes the prompt itself, no P) the same formula applies with P := D and no
transfer, plus the stall term: while D computes a prompt, every sequence in its batch (and the next one it
admits) waits, so the prompt's seconds are charged once per sequence. For a suffix under the local-prefill
threshold it is small and weighted `stall`; it ranks decode replicas. A longer suffix (the selector offers it
to a decode replica holding the prompt's context, `PdservePolicyConfig.long_local_prefill`) spans many engine
steps and slows every running sequence for all of them: weighted `long_stall`, so that it is taken when the
context's recompute elsewhere costs far more than the batch's wait, and kept off busy batches. When the
prefill pool is backed up (prefill overflow), the queue it would wait in is the alternative: `stall` again.
With KV readback (`RouteRequest.readback`: the session's previous decode replica keeps its KV pinned), "cached
on P" is the longer of P's own prefix and the pinned one, and the pull of the difference is one more transfer
term. The selector (`router.policy.selector`) decides which options exist and adds that term; this module only
scores them.

Defaults: with every weight 1 the cost would be the request's own estimated end-to-end seconds. That greedy
choice gives up a cached prefix whenever its holder's queue is longer than the miss, but a miss also occupies
the replica for everything queued after it and evicts other sessions' prefixes (future misses), so the prefill
weight is 5: a miss is charged five times its own seconds. Chosen by a sweep on the trace replay (weight 1 / 3
/ 5 / 10 on Claude Code at ~50% utilisation: hit/bound 0.94 / 0.97 / 0.98 / 0.99, with max/mean load rising;
on Mooncake 0.64 / 0.73 / 0.75 / 0.80 with TTFT P99 flat to weight 10); it is a tuning knob, not a measurement
(topology `router.prefill_weight`). Re-swept with long local prefill (readback off): on Mooncake (time scale
2.5 / 2.947 / 3.4, prefill utilisation 0.48-0.67) weight 5 / 20 / 40 gives hit/bound 0.796-0.818 / 0.846-0.856
/ 0.861-0.873, TTFT P99 7.26-7.52 / 7.40-7.71 / 7.62-8.87 s (dynamo_kv 7.61-8.46 s, sglang_launcher 0.865 at
14-15 s); on Claude Code (concurrency 64 and 72, seeds 0-4) 5 / 20 / 40 gives 0.979-0.990 / 0.995-0.997 /
0.996-0.998, but max/mean prefill tokens up to 1.13 / 1.18 / 1.18 and decode TPOT P99 up to 31 / 32 / 37 ms.
20 keeps Mooncake's TTFT P99 below every baseline's at all three loads, 40 does not. 5 stays the default: long
agent contexts already make a miss costly, and more weight there only costs balance. `stall` 1 charges each
waiting sequence the whole prefill, as the replay models it (vLLM's chunked prefill interleaves decode steps
with it, so this overstates the wait). `long_stall` 20 (topology `router.long_stall_weight`) was chosen on the
replay (Claude Code, readback off, concurrency 64, seeds 0-4, long local prefill offered at every queue
length, one weight for every local prefill's stall): weight 1 / 5 / 10 / 20 gave hit/bound 0.997-0.998 /
0.994-0.996 / 0.992-0.993 / 0.988-0.990, TTFT P99 18-21 / 24-33 / 28-45 / 44-64 s and decode TPOT P99 42-52 /
24-32 / 20-26 / 18-19 ms (no long local prefill: 0.961-0.975, 56-123 s, 18-28 ms). 20 keeps TPOT where
disaggregation puts it; lighter weights buy TTFT with decode latency. As configured by default (short local
prefills and prefill overflow at `stall`) 20 gives 0.988-0.990, 26-35 s, 20-22 ms. `kv_full_s` is a judgement,
not a measurement: a decode replica at full KV preempts and recomputes sequences; 2 s is the recompute of a
~40k-token context on the default model. Decoding's slowdown of the sequences already on D is not charged (it
is small against the terms above: one more sequence adds ~1 ms to a ~25 ms step).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from router.policy.service_time import ServiceTimeModel
from router.policy.types import ReplicaView

NonNegative = Annotated[float, msgspec.Meta(ge=0)]


class CostWeights(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    timing: ServiceTimeModel = ServiceTimeModel()
    prefill: NonNegative = 5.0
    queue: NonNegative = 1.0
    transfer: NonNegative = 1.0
    decode: NonNegative = 1.0
    kv_full_s: NonNegative = 2.0
    stall: NonNegative = 1.0
    long_stall: NonNegative = 20.0
    max_output_tokens: Annotated[int, msgspec.Meta(ge=0)] = 1024


class CostTerms(msgspec.Struct, frozen=True, kw_only=True):
    uncached_prefill_tokens: int
    transfer_tokens: int
    # Weighted seconds of each term, and their sum.
    prefill_s: float
    queue_s: float
    transfer_s: float
    decode_s: float
    stall_s: float  # local prefill only
    total: float


def cached_tokens(matched_blocks: int, block_size: int, num_prompt_tokens: int) -> int:
    """Prompt tokens an engine can take from its prefix cache given `matched_blocks` leading blocks.

    vLLM always computes at least the prompt's last token (its logits start decoding), so a fully cached
    prompt still computes the block that holds its last token."""
    if num_prompt_tokens <= 0:
        return 0
    return min(matched_blocks * block_size, (num_prompt_tokens - 1) // block_size * block_size)


def estimated_prefill_s(timing: ServiceTimeModel, num_prompt_tokens: int, cached: int) -> float:
    """Seconds to prefill a prompt of which `cached` leading tokens are in the computing replica's cache: the
    estimate the cost uses and load accounting sums into `ReplicaView.queued_prefill_s`."""
    return timing.prefill_s(num_prompt_tokens - cached, cached)


# The formula's terms. `cost` adds them; the selector adds the same terms itself to search pairs in O(|P| +
# |D|).


def queued_prefill_s(timing: ServiceTimeModel, r: ReplicaView) -> float:
    """Estimated seconds of prefill work queued on `r`."""
    if r.queued_prefill_s is not None:
        return r.queued_prefill_s
    if r.queued_prefill_tokens <= 0:
        return 0.0
    # Only counts known: the queue as `requests` prompts of the mean size, nothing cached.
    reqs = max(r.queued_prefill_requests, 1)
    return reqs * timing.prefill_s(r.queued_prefill_tokens // reqs, 0)


def queued_s(w: CostWeights, r: ReplicaView) -> float:
    """Weighted seconds of prefill work queued on `r`."""
    return w.queue * queued_prefill_s(w.timing, r)


def prefill_term(w: CostWeights, num_prompt_tokens: int, cached: int, r: ReplicaView) -> float:
    """Weighted seconds until the prompt is computed on `r`: its own prefill plus `r`'s queue."""
    return w.prefill * estimated_prefill_s(w.timing, num_prompt_tokens, cached) + queued_s(w, r)


def decode_term(w: CostWeights, d: ReplicaView, num_prompt_tokens: int, max_tokens: int) -> float:
    """Weighted seconds to decode the reply on `d` with its current batch, plus `d`'s KV pressure."""
    out = min(max_tokens, w.max_output_tokens)
    step = w.timing.tpot_s(d.active_seqs + 1, d.active_context_tokens + num_prompt_tokens)
    return w.decode * out * step + w.kv_full_s * d.kv_usage


def stall_term(w: CostWeights, d: ReplicaView, prefill_s: float, *, long: bool = False) -> float:
    """Weighted seconds decode replica `d`'s batch waits while it computes a prompt itself (`long`: a suffix
    past the local-prefill threshold, outside prefill overflow)."""
    return (w.long_stall if long else w.stall) * prefill_s * (d.active_seqs + 1)


def transfer_term(w: CostWeights, transfer_tokens: int, within_node: bool) -> float:
    return w.transfer * w.timing.transfer_s(transfer_tokens, within_node)


def same_node(p: ReplicaView, d: ReplicaView) -> bool:
    return p.node_id is not None and p.node_id == d.node_id


def cost(
    w: CostWeights,
    num_prompt_tokens: int,
    max_tokens: int,
    computing: ReplicaView,
    cached_on_computing: int,
    decode: ReplicaView,
    cached_on_decode: int,
    *,
    long_stall: bool = False,
) -> CostTerms:
    """Score computing the prompt on `computing` and decoding on `decode` (the same replica = local
    prefill; `long_stall`: a long local prefill, its stall weighted `CostWeights.long_stall`)."""
    uncached = num_prompt_tokens - cached_on_computing
    local = computing.replica_id == decode.replica_id
    transfer = 0 if local else num_prompt_tokens - cached_on_decode
    own = estimated_prefill_s(w.timing, num_prompt_tokens, cached_on_computing)
    prefill = w.prefill * own
    queue = queued_s(w, computing)
    move = transfer_term(w, transfer, same_node(computing, decode))
    dec = decode_term(w, decode, num_prompt_tokens, max_tokens)
    stall = stall_term(w, decode, own, long=long_stall) if local else 0.0
    return CostTerms(
        uncached_prefill_tokens=uncached,
        transfer_tokens=transfer,
        prefill_s=prefill,
        queue_s=queue,
        transfer_s=move,
        decode_s=dec,
        stall_s=stall,
        total=prefill + queue + move + dec + stall,
    )
