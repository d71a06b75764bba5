"""What the benchmarks count as a good request, and the percentile they report latencies at: one definition
for the trace replay (bench/replay) and the live benchmark (bench/live)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec


class Slo(msgspec.Struct, frozen=True, kw_only=True):
    """Goodput counts requests whose TTFT and whose TPOT (mean time per output token after the first) are
    both within these."""

    ttft_s: float
    tpot_s: float

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        """`tpot_s` None: a one-token reply, judged by its TTFT alone."""
        return ttft_s <= self.ttft_s and (tpot_s is None or tpot_s <= self.tpot_s)

    @staticmethod
    def given(text: str) -> dict[str, float]:
        """The fields `ttft=SECONDS,tpot=SECONDS` sets (either may be left out), for
        `msgspec.structs.replace(default, **given)`. ValueError names the part it cannot read."""
        out: dict[str, float] = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if key.strip() not in ("ttft", "tpot") or not seconds > 0:
                raise ValueError(f"{part!r}: expected ttft=SECONDS or tpot=SECONDS (> 0)")
            out[f"{key.strip()}_s"] = seconds
        return out


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]
