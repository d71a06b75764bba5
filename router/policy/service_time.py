"""How long a prefill, a decode step and a KV transfer take on one replica: the single time model behind the
routing cost (`router.policy.cost`) and the trace replay's simulated engines (`bench.replay.sim`).

The router estimates with the same formula the replay charges, so a policy decision is scored in the units the
benchmark measures (seconds) and a mismatch between belief and simulated cost can only come from what the
router does not know (cache state at prefill start, queue contents), not from two different formulas.

The modelled replica: one 8x H200 node serving a DeepSeek-V3-class model (671B MoE, 37B active parameters, MLA
attention, 61 layers, 128 heads), the class DESIGN.md targets. The default per-GPU rates are the measured H200
numbers of bench/data/calibration/h200_calibration.json, rounded (`bench.replay.timing.model_from_calibration`
reads them from the file):

- Prefill = per-request overhead + linear layers + causal attention, both compute-bound:
  * linear: 2 x active_params FLOPs per new token, at the measured large-M bf16 GEMM rate (median over the
    calibration's GEMM shapes at M >= 2048) x gpus x `parallel_efficiency` (TP/EP communication);
  * attention: for `n` new tokens after `c` cached ones, n*c + n(n+1)/2 (query, key) pairs, each 4 x heads x
    (qk_dim + v_dim)/2 x layers FLOPs (MLA prefill runs un-absorbed: q/k 192, v 128), at the measured causal
    prefill attention rate (largest sequence length) x gpus x efficiency. This term is why a turn with a
    long cached context still costs: the new tokens attend to all of it, and why a miss on a 100k-token
    context costs ~25x a hit.
- Decode step (TPOT) for a batch of B sequences holding K context tokens: step overhead + expert/dense
  weight bytes touched by B tokens (top-8 of 256 experts, fp8) streamed at the measured small-M weight-
  streaming rate + K x kv_bytes_per_token streamed at the measured decode-attention rate.
- KV transfer P -> D: bytes / link bandwidth (8 x 400 Gb/s InfiniBand per node across nodes; NVLink within a
  node), plus a fixed setup latency.

The constants that are not measured (efficiency, overheads, links) are named fields.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]


class ServiceTimeModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    gpus_per_replica: PositiveInt = 8
    active_params: Positive = 37e9
    total_params: Positive = 671e9
    # Parameters every token touches (attention projections, dense layers, shared experts, embeddings).
    dense_params: Positive = 17e9
    num_experts: PositiveInt = 256
    experts_per_token: PositiveInt = 8
    weight_bytes_per_param: Positive = 1.0  # fp8
    layers: PositiveInt = 61
    heads: PositiveInt = 128
    qk_head_dim: PositiveInt = 192
    v_head_dim: PositiveInt = 128
    kv_bytes_per_token: Positive = 70e3  # MLA latent, bf16
    # Measured per-GPU rates (calibration); defaults are the file's values rounded.
    gemm_flops: Positive = 680e12
    attention_flops: Positive = 570e12
    weight_stream_bytes_per_s: Positive = 3.4e12
    kv_stream_bytes_per_s: Positive = 4.4e12
    # Assumed: fraction of the per-GPU rate a multi-GPU replica keeps (communication, imbalance).
    parallel_efficiency: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.6
    prefill_overhead_s: NonNegative = 0.015
    decode_step_overhead_s: NonNegative = 0.008
    # Across nodes: 8 x 400 Gb/s InfiniBand. Within a node: 8 x ~450 GB/s NVLink (one direction).
    link_bytes_per_s: Positive = 400e9
    same_node_link_bytes_per_s: Positive = 3.6e12
    transfer_setup_s: NonNegative = 0.002

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to compute `new_tokens` prompt tokens after `cached_tokens` taken from the prefix cache."""
        if new_tokens <= 0:
            return self.prefill_overhead_s
        scale = self.gpus_per_replica * self.parallel_efficiency
        linear = 2.0 * self.active_params * new_tokens / (self.gemm_flops * scale)
        pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
        flops_per_pair = 2.0 * self.heads * (self.qk_head_dim + self.v_head_dim) * self.layers
        attention = flops_per_pair * pairs / (self.attention_flops * scale)
        return self.prefill_overhead_s + linear + attention

    def tpot_s(self, batch: int, context_tokens: int) -> float:
        """Seconds per decode step of a batch of `batch` sequences holding `context_tokens` KV tokens."""
        if batch <= 0:
            return self.decode_step_overhead_s
        untouched = (1.0 - self.experts_per_token / self.num_experts) ** batch
        expert_params = self.total_params - self.dense_params
        weight_bytes = (self.dense_params + expert_params * (1.0 - untouched)) * self.weight_bytes_per_param
        weights = weight_bytes / (self.weight_stream_bytes_per_s * self.gpus_per_replica)
        kv = context_tokens * self.kv_bytes_per_token / (self.kv_stream_bytes_per_s * self.gpus_per_replica)
        return self.decode_step_overhead_s + weights + kv

    def transfer_s(self, tokens: int, same_node: bool = False) -> float:
        """Seconds to move `tokens` tokens of KV from a prefill to a decode replica."""
        if tokens <= 0:
            return 0.0
        link = self.same_node_link_bytes_per_s if same_node else self.link_bytes_per_s
        return self.transfer_setup_s + tokens * self.kv_bytes_per_token / link
