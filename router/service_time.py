"""How long a prefill, a decode step and a KV transfer take on one replica: the single time model behind the
routing cost (`router.policy.cost`) and the trace replay's simulated engines (`bench.replay.sim`).

The modelled replica is `ServiceTime` (the topology's `router.service_time`): `gpus_per_replica` GPUs of a
named `hardware`, whose measured per-GPU rates are router/hardware/<hardware>.json, serving a model of a
given shape (`ModelShape`; default DeepSeek-V3). The formulas and what is measured against assumed:
docs/routing.md ("The service-time model").
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from pathlib import Path
from typing import Annotated, Literal

import msgspec

Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]


HARDWARE_DIR = Path(__file__).resolve().parent / "hardware"
Hardware = Literal["h200"]  # the files in HARDWARE_DIR


class ModelShape(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the service times need of the served model (defaults: DeepSeek-V3)."""

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
    # Of the KV cache's dtype: halve it for an fp8 cache (engines' model.kv_cache_dtype).
    kv_bytes_per_token: Positive = 70e3  # MLA latent, bf16
    # Whether tensor parallelism splits a token's KV between the GPUs (by KV head, as GQA's), or every GPU
    # keeps all of it (MLA's one latent, as vLLM stores it): what a replica's KV capacity is.
    kv_split_by_gpus: bool = False


class GpuRates(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-GPU rates, as measured."""

    gemm_flops: Positive
    attention_flops: Positive
    weight_stream_bytes_per_s: Positive
    kv_stream_bytes_per_s: Positive

    @staticmethod
    @functools.cache
    def measured(hardware: Hardware = "h200") -> GpuRates:
        """The rates of `HARDWARE_DIR/<hardware>.json`: large-M GEMM rate (median over shapes at M >= 2048),
        small-M weight-streaming rate (median at M <= 64), causal prefill attention rate at the longest
        sequence, best decode-attention KV streaming rate."""
        cal = json.loads((HARDWARE_DIR / f"{hardware}.json").read_text())
        gemm = [row["TFLOPs"] for rows in cal["gemm_bf16"].values() for row in rows if row["M"] >= 2048]
        stream = [row["GBps"] for rows in cal["gemm_bf16"].values() for row in rows if row["M"] <= 64]
        attn = max(cal["prefill_attention_causal_h64_d128"], key=lambda r: r["S"])["TFLOPs"]
        kv = max(r["kv_GBps"] for r in cal["decode_attention_gqa64_8_h128"])
        return GpuRates(
            gemm_flops=statistics.median(gemm) * 1e12,
            attention_flops=attn * 1e12,
            weight_stream_bytes_per_s=statistics.median(stream) * 1e9,
            kv_stream_bytes_per_s=kv * 1e9,
        )


# Memory of one GPU of each hardware, and the share of it vLLM takes (its gpu_memory_utilization default).
GPU_MEMORY_BYTES: dict[str, float] = {"h200": 141e9}
ENGINE_MEMORY_SHARE = 0.9


class Speculation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding on the modelled decode replica: each step drafts `draft_tokens` tokens a sequence
    and the target verifies them with the sequence's next token in one pass."""

    draft_tokens: PositiveInt  # vLLM's num_speculative_tokens
    # Accepted / drafted tokens, as the engines report it (pdserve_engine_spec_* metrics, `pdserve bench`).
    acceptance_rate: Annotated[float, msgspec.Meta(ge=0, le=1)]
    # A drafted token's cost as a share of a target step: an MTP or EAGLE head is about one layer.
    draft_cost: NonNegative = 0.05

    @property
    def tokens_per_step(self) -> float:
        """Tokens a sequence gains a step: the verified one and the accepted drafts."""
        return 1.0 + self.acceptance_rate * self.draft_tokens


class MeasuredTiming(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Service times fitted to one engine's own measurements (`python -m bench.engine_timing` measures a vLLM
    engine on this machine and prints this section): a prefill costs a fixed part, a part per new token
    and a part per attention pair (new tokens against the cached and new ones before them); a decode step
    a fixed part, a part per running sequence and a part per context token; a KV pull a fixed part and a
    part per token."""

    prefill_fixed_s: NonNegative
    prefill_token_s: NonNegative
    prefill_pair_s: NonNegative
    decode_step_s: NonNegative
    decode_seq_s: NonNegative
    decode_context_token_s: NonNegative
    transfer_fixed_s: NonNegative
    transfer_token_s: NonNegative
    # Where the engines share their cores with the serving layer and with each other (CPU engines on one
    # machine): a prefill, and a decode step, take (1 + x * sqrt(k)) times as long while k other requests are
    # in flight on other replicas (`python -m bench.served_timing` measures both; GPU engines: 0).
    prefill_contention: NonNegative = 0.0
    decode_contention: NonNegative = 0.0


class ServiceTime(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The topology's `router.service_time`: what one replica is, for the routing cost's estimates."""

    hardware: Hardware = "h200"
    gpus_per_replica: PositiveInt = 8
    # The decode engines' token budget per step (their vLLM max_num_batched_tokens; vLLM's default on
    # H100/H200-class GPUs): how a prefill on a decode replica is chunked between its decode steps.
    decode_chunk_tokens: PositiveInt = 8192
    model: ModelShape = msgspec.field(default_factory=ModelShape)
    # An engine measured on the machine it runs on (`python -m bench.engine_timing`): when set, its fitted
    # times replace those of hardware, gpus_per_replica and model.
    measured: MeasuredTiming | None = None
    # Speculative decoding on the decode replicas (None: none); with either timing.
    speculation: Speculation | None = None

    def describe(self) -> str:
        """What the service times are for, in a line (the replay's report)."""
        m = self.measured
        if m is not None:
            return (
                f"a measured engine: prefill {1e3 * m.prefill_fixed_s:.1f} ms + "
                f"{1e6 * m.prefill_token_s:.1f} us a token, decode step {1e3 * m.decode_step_s:.1f} ms + "
                f"{1e6 * m.decode_seq_s:.1f} us a sequence, KV pull {1e3 * m.transfer_fixed_s:.1f} ms + "
                f"{1e6 * m.transfer_token_s:.2f} us a token"
                + (
                    f", prefill / step x(1 + {m.prefill_contention:.2f} / {m.decode_contention:.2f} sqrt(k)) "
                    "with k requests on other replicas"
                    if m.prefill_contention or m.decode_contention
                    else ""
                )
                + self._speculation_words()
            )
        return (
            f"{self.gpus_per_replica} {self.hardware} GPUs a replica, a model of "
            f"{self.model.total_params / 1e9:.0f}B parameters ({self.model.active_params / 1e9:.0f}B"
            f" active), {self.model.kv_bytes_per_token / 1e3:.0f} KB of KV a token"
            + self._speculation_words()
        )

    def _speculation_words(self) -> str:
        s = self.speculation
        if s is None:
            return ""
        return (
            f", speculation: {s.draft_tokens} drafts a step, {s.acceptance_rate:.0%} accepted"
            f" ({s.tokens_per_step:.2f} tokens a step)"
        )

    def timing(self) -> ServiceTimeModel | MeasuredEngine:
        if self.measured is not None:
            return MeasuredEngine(
                fit=self.measured, chunk_tokens=self.decode_chunk_tokens, speculation=self.speculation
            )
        return ServiceTimeModel(
            shape=self.model,
            rates=GpuRates.measured(self.hardware),
            gpus_per_replica=self.gpus_per_replica,
            chunk_tokens=self.decode_chunk_tokens,
            speculation=self.speculation,
            gpu_memory_bytes=GPU_MEMORY_BYTES[self.hardware],
        )


class _ChunkedPrefill(msgspec.Struct, frozen=True, kw_only=True):
    """What both service-time models share: a prefill on a decode replica, chunked between its steps."""

    chunk_tokens: PositiveInt = 8192  # ServiceTime.decode_chunk_tokens
    speculation: Speculation | None = None  # ServiceTime.speculation

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        raise NotImplementedError

    def step_s(self, batch: int, context_tokens: int, tokens_per_seq: int = 1) -> float:
        """Seconds of one decode step of `batch` sequences holding `context_tokens` KV tokens, computing
        `tokens_per_seq` tokens of each (more than one: verifying speculative drafts)."""
        raise NotImplementedError

    def tpot_s(self, batch: int, context_tokens: int) -> float:
        """Seconds per output token of each of `batch` sequences holding `context_tokens` KV tokens: a decode
        step, or with speculation a step that drafts k tokens a sequence and verifies k + 1, over the tokens
        it gains (1 + acceptance x k)."""
        spec = self.speculation
        if spec is None:
            return self.step_s(batch, context_tokens)
        k = spec.draft_tokens
        step = self.step_s(batch, context_tokens, 1 + k) + k * spec.draft_cost * self.step_s(
            batch, context_tokens
        )
        return step / spec.tokens_per_step

    def mixed_prefill(
        self,
        new_tokens: int,
        cached_tokens: int,
        batch: int,
        context_tokens: int,
        *,
        prefill_s: float | None = None,
        tpot_s: float | None = None,
    ) -> tuple[int, float]:
        """(steps, seconds per step) of a prefill on a decode replica running `batch` sequences of
        `context_tokens`: vLLM's chunked prefill fills each step's token budget (`chunk_tokens`, less one
        token per running sequence) with prompt tokens, so the prompt takes ceil(new / chunk) steps, each
        about the larger of the decode step and its share of the prefill (both bound by the same GPUs, a
        mixed step is as slow as its slower part). Every running sequence makes one token per step.
        `prefill_s`, `tpot_s`: the prefill's and the batch's decode step's seconds, when already known."""
        prefill = self.prefill_s(new_tokens, cached_tokens) if prefill_s is None else prefill_s
        tpot = self.tpot_s(batch, context_tokens) if tpot_s is None else tpot_s
        chunk = max(1, self.chunk_tokens - batch)
        steps = max(1, -(-new_tokens // chunk))
        return steps, max(tpot, prefill / steps)


class ServiceTimeModel(_ChunkedPrefill, frozen=True, kw_only=True, forbid_unknown_fields=True):
    shape: ModelShape = msgspec.field(default_factory=ModelShape)
    rates: GpuRates = msgspec.field(default_factory=GpuRates.measured)
    gpus_per_replica: PositiveInt = 8
    # Assumed: fraction of the per-GPU rate a multi-GPU replica keeps (communication, imbalance).
    parallel_efficiency: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.6
    prefill_overhead_s: NonNegative = 0.015
    decode_step_overhead_s: NonNegative = 0.008
    # Across nodes: 8 x 400 Gb/s InfiniBand. Within a node: 8 x ~450 GB/s NVLink (one direction).
    link_bytes_per_s: Positive = 400e9
    same_node_link_bytes_per_s: Positive = 3.6e12
    transfer_setup_s: NonNegative = 0.002
    gpu_memory_bytes: Positive = GPU_MEMORY_BYTES["h200"]

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to compute `new_tokens` prompt tokens after `cached_tokens` taken from the prefix cache."""
        if new_tokens <= 0:
            return self.prefill_overhead_s
        m, r = self.shape, self.rates
        scale = self.gpus_per_replica * self.parallel_efficiency
        linear = 2.0 * m.active_params * new_tokens / (r.gemm_flops * scale)
        pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
        flops_per_pair = 2.0 * m.heads * (m.qk_head_dim + m.v_head_dim) * m.layers
        attention = flops_per_pair * pairs / (r.attention_flops * scale)
        return self.prefill_overhead_s + linear + attention

    def step_s(self, batch: int, context_tokens: int, tokens_per_seq: int = 1) -> float:
        """A decode step streams the weights its tokens' experts need and the batch's KV, unless computing its
        tokens takes longer (a wide batch of speculative drafts)."""
        if batch <= 0:
            return self.decode_step_overhead_s
        m, r = self.shape, self.rates
        tokens = batch * tokens_per_seq
        untouched = (1.0 - m.experts_per_token / m.num_experts) ** tokens
        expert_params = m.total_params - m.dense_params
        weight_bytes = (m.dense_params + expert_params * (1.0 - untouched)) * m.weight_bytes_per_param
        weights = weight_bytes / (r.weight_stream_bytes_per_s * self.gpus_per_replica)
        kv = context_tokens * m.kv_bytes_per_token / (r.kv_stream_bytes_per_s * self.gpus_per_replica)
        compute = (
            2.0 * m.active_params * tokens / (r.gemm_flops * self.gpus_per_replica * self.parallel_efficiency)
        )
        # The overhead added first in both: the memory-bound sum stays what it was, to the bit.
        return max(self.decode_step_overhead_s + weights + kv, self.decode_step_overhead_s + compute)

    def kv_capacity_tokens(self) -> float:
        """Tokens of KV one replica holds: its GPUs' memory share for the engine, less the weights, over a
        token's KV on each GPU (all of it unless tensor parallelism splits it)."""
        m = self.shape
        per_gpu = ENGINE_MEMORY_SHARE * self.gpu_memory_bytes - m.total_params * m.weight_bytes_per_param / (
            self.gpus_per_replica
        )
        token_per_gpu = m.kv_bytes_per_token / (self.gpus_per_replica if m.kv_split_by_gpus else 1)
        return max(0.0, per_gpu) / token_per_gpu

    def contention(self, others: int) -> tuple[float, float]:
        """(prefill, decode step) slowdown while `others` requests run on other replicas: none on GPUs."""
        return 1.0, 1.0

    def transfer_s(self, tokens: int, same_node: bool = False) -> float:
        """Seconds to move `tokens` tokens of KV from a prefill to a decode replica."""
        if tokens <= 0:
            return 0.0
        link = self.same_node_link_bytes_per_s if same_node else self.link_bytes_per_s
        return self.transfer_setup_s + tokens * self.shape.kv_bytes_per_token / link


class MeasuredEngine(_ChunkedPrefill, frozen=True, kw_only=True):
    """The service-time model of a measured engine (`ServiceTime.measured`): the same questions as
    `ServiceTimeModel`'s, answered from the fit."""

    fit: MeasuredTiming

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        f = self.fit
        if new_tokens <= 0:
            return f.prefill_fixed_s
        pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
        return f.prefill_fixed_s + f.prefill_token_s * new_tokens + f.prefill_pair_s * pairs

    def step_s(self, batch: int, context_tokens: int, tokens_per_seq: int = 1) -> float:
        f = self.fit
        if batch <= 0:
            return f.decode_step_s
        return (
            f.decode_step_s
            + f.decode_seq_s * batch * tokens_per_seq
            + f.decode_context_token_s * context_tokens
        )

    def contention(self, others: int) -> tuple[float, float]:
        """(prefill, decode step) slowdown while `others` requests run on other replicas
        (`MeasuredTiming.prefill_contention`)."""
        if others <= 0:
            return 1.0, 1.0
        root = math.sqrt(others)
        return 1.0 + self.fit.prefill_contention * root, 1.0 + self.fit.decode_contention * root

    def transfer_s(self, tokens: int, same_node: bool = False) -> float:
        """Seconds to pull `tokens` tokens of KV (measured on one machine: `same_node` changes nothing)."""
        if tokens <= 0:
            return 0.0
        return self.fit.transfer_fixed_s + self.fit.transfer_token_s * tokens


# Either model answers the routing cost's and the replay's questions.
Timing = ServiceTimeModel | MeasuredEngine
