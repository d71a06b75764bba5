"""The replay's service-time model: `router.policy.service_time.ServiceTimeModel` (the same model the routing
cost estimates with), with its per-GPU rates read from a calibration file measured on one H200."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from router.policy.service_time import ServiceTimeModel

DEFAULT_CALIBRATION = Path(__file__).resolve().parents[1] / "data" / "calibration" / "h200_calibration.json"


def model_from_calibration(path: Path = DEFAULT_CALIBRATION) -> ServiceTimeModel:
    """The default model with its per-GPU rates read from a calibration file (as measured on one H200):
    large-M GEMM rate (median over shapes at M >= 2048), small-M weight-streaming rate (median at M <= 64),
    causal prefill attention rate at the longest sequence, best decode-attention KV streaming rate."""
    cal = json.loads(path.read_text())
    gemm = [row["TFLOPs"] for rows in cal["gemm_bf16"].values() for row in rows if row["M"] >= 2048]
    stream = [row["GBps"] for rows in cal["gemm_bf16"].values() for row in rows if row["M"] <= 64]
    attn = max(cal["prefill_attention_causal_h64_d128"], key=lambda r: r["S"])["TFLOPs"]
    kv = max(r["kv_GBps"] for r in cal["decode_attention_gqa64_8_h128"])
    return ServiceTimeModel(
        gemm_flops=statistics.median(gemm) * 1e12,
        attention_flops=attn * 1e12,
        weight_stream_bytes_per_s=statistics.median(stream) * 1e9,
        kv_stream_bytes_per_s=kv * 1e9,
    )
