"""pdserve's routing cost: one formula, in estimated seconds of this request's latency.

    cost = w_prefill  * prefill_s(uncached on C, cached on C)      computing the prompt on replica C (w_copy
                                                                  on seconds beyond the cheapest prefill
                                                                  replica's, for a new prompt)
         + w_queue    * queued_prefill_s(C)                       waiting behind C's queued prompts
         + w_over_slo * max(0, queued + prefill - TTFT SLO)        ... the first token past its SLO (C a P)
         + w_transfer * transfer_s(tokens C pulls, source~C node)  pulling a prefix C lacks (readback/export)
         + balance + churn                                        C's recent work above its pool's mean
         + w_decode   * out * tpot_s(active(D) + 1, context(D) + prompt) + kv_full_s * kv_usage(D)
         + w_transfer * transfer_s(tokens D lacks, C~D node)      moving the KV from C to D
         + w_stall    * (active(D) * delay + prefill wall)         C is D (local prefill): D's batch slows

C computes the prompt: a prefill replica, or D itself (local prefill: no transfer; D's batch waits). The
terms are here; router/policy/options.py adds each option's up, router/policy/selector.py picks. Every time is
`router.service_time.ServiceTimeModel`'s, the model the replay charges. What each term means and why each
weight has its value: docs/routing.md ("The cost").
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from router.config import RouterConfig
from router.messages import ReplicaView
from router.service_time import Timing

NonNegative = Annotated[float, msgspec.Meta(ge=0)]


# A local prefill that breaks the inter-token SLO of every running sequence on its decode replica is worth
# doing only if it saves this many times the delay it adds, and a wait past the TTFT SLO only if it saves this
# many times the excess (docs/routing.md: the replay's trade of cache hits against decode TPOT and TTFT).
OVER_SLO_WEIGHT = 20.0
# Seconds a new prompt spends recomputing a prefix another prefill replica holds (docs/routing.md: the
# Mooncake replay's hits against Claude Code's balance).
COPY_WEIGHT = 80.0


class CostWeights(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    timing: Timing
    prefill: NonNegative  # router.prefill_weight
    tpot_slo_s: NonNegative  # router.tpot_slo_ms / 1000
    ttft_slo_s: NonNegative  # router.ttft_slo_ms / 1000
    copy: NonNegative = COPY_WEIGHT
    queue: NonNegative = 1.0
    transfer: NonNegative = 1.0
    decode: NonNegative = 1.0
    kv_full_s: NonNegative = 2.0  # a judgement: the recompute of a ~40k-token context on the default model
    stall: NonNegative = 1.0
    over_slo: NonNegative = OVER_SLO_WEIGHT
    max_output_tokens: Annotated[int, msgspec.Meta(ge=0)] = 1024

    @staticmethod
    def of(cfg: RouterConfig, timing: Timing | None = None) -> CostWeights:
        """The weights `cfg` asks for, costed with `timing` (default: `cfg.service_time`'s)."""
        return CostWeights(
            timing=timing or cfg.service_time.timing(),
            prefill=cfg.prefill_weight,
            tpot_slo_s=cfg.tpot_slo_ms / 1000.0,
            ttft_slo_s=cfg.ttft_slo_ms / 1000.0,
        )


def cached_tokens(matched_blocks: int, block_size: int, num_prompt_tokens: int) -> int:
    """Prompt tokens an engine can take from its prefix cache given `matched_blocks` leading blocks.

    vLLM always computes at least the prompt's last token (its logits start decoding), so a fully cached
    prompt still computes the block that holds its last token."""
    if num_prompt_tokens <= 0:
        return 0
    return min(matched_blocks * block_size, (num_prompt_tokens - 1) // block_size * block_size)


def estimated_prefill_s(timing: Timing, num_prompt_tokens: int, cached: int) -> float:
    """Seconds to prefill a prompt of which `cached` leading tokens are in the computing replica's cache: the
    estimate the cost uses and load accounting sums into `ReplicaView.queued_prefill_s`."""
    return timing.prefill_s(num_prompt_tokens - cached, cached)


def queued_prefill_s(timing: Timing, r: ReplicaView) -> float:
    """Estimated seconds of prefill work queued on `r`."""
    if r.queued_prefill_s is not None:
        return r.queued_prefill_s
    if r.queued_prefill_tokens <= 0:
        return 0.0
    # Only counts known: the queue as `requests` prompts of the mean size, nothing cached.
    reqs = max(r.queued_prefill_requests, 1)
    return reqs * timing.prefill_s(r.queued_prefill_tokens // reqs, 0)


def wait_term(w: CostWeights, queued_s: float, own_s: float) -> float:
    """Weighted seconds of waiting `queued_s` before a prefill of `own_s`: the wait, and the first token's
    time past the TTFT SLO at the over-SLO weight."""
    return w.queue * queued_s + w.over_slo * max(0.0, queued_s + own_s - w.ttft_slo_s)


def decode_term(w: CostWeights, d: ReplicaView, num_prompt_tokens: int, max_tokens: int) -> float:
    """Weighted seconds to decode the reply on `d` with its current batch, plus `d`'s KV pressure."""
    out = min(max_tokens, w.max_output_tokens)
    step = w.timing.tpot_s(d.active_seqs + 1, d.active_context_tokens + num_prompt_tokens)
    return w.decode * out * step + w.kv_full_s * d.kv_usage


def breaks_slo(w: CostWeights, d: ReplicaView, new_tokens: int, cached: int, prefill_s: float) -> bool:
    """Whether computing `new_tokens` after `cached` on decode replica `d` makes the steps of its running
    sequences (or of the next one it admits) slower than the inter-token SLO. `prefill_s`: that prefill's
    own seconds."""
    _, step = w.timing.mixed_prefill(
        new_tokens, cached, d.active_seqs, d.active_context_tokens, prefill_s=prefill_s
    )
    return step > w.tpot_slo_s


def stall_term(
    w: CostWeights,
    d: ReplicaView,
    new_tokens: int,
    cached: int,
    prefill_s: float,
    *,
    overflow: bool = False,
) -> float:
    """Weighted seconds `d`'s running sequences lose while `d` computes `new_tokens` after `cached` between
    their decode steps, plus the whole prefill for the next sequence `d` admits (it starts after).
    `prefill_s`: that prefill's own seconds. `overflow`: the prefill pool is backed up, the SLO's weight
    does not apply."""
    timing = w.timing
    batch = d.active_seqs
    tpot = timing.tpot_s(batch, d.active_context_tokens)
    steps, step = timing.mixed_prefill(
        new_tokens, cached, batch, d.active_context_tokens, prefill_s=prefill_s, tpot_s=tpot
    )
    delay = steps * (step - tpot)
    weight = w.over_slo if step > w.tpot_slo_s and not overflow else w.stall
    return weight * (batch * delay + steps * step)


def transfer_term(w: CostWeights, tokens: int, within_node: bool) -> float:
    return w.transfer * w.timing.transfer_s(tokens, within_node)


def same_node(a: ReplicaView, b: ReplicaView) -> bool:
    return a.node_id is not None and a.node_id == b.node_id
