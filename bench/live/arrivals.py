"""When requests are sent: open-loop arrival processes at a rate (requests per second)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrivals:
    """`poisson` (exponential gaps), `gamma:B` (gamma gaps of burstiness B: 1 is Poisson, < 1 burstier),
    `constant` (evenly spaced)."""

    kind: str
    burstiness: float = 1.0

    @staticmethod
    def parse(text: str) -> Arrivals:
        kind, _, arg = text.partition(":")
        if kind in ("poisson", "constant") and not arg:
            return Arrivals(kind)
        if kind == "gamma":
            try:
                b = float(arg)
            except ValueError:
                b = -1.0
            if b > 0:
                return Arrivals("gamma", b)
        raise ValueError(f"{text!r}: expected poisson, constant or gamma:BURSTINESS (> 0)")

    def offsets(self, n: int, rate: float, seed: int) -> list[float]:
        """Send times (seconds from the start) of `n` requests at `rate` per second on average."""
        rng = random.Random(seed)
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            if self.kind == "constant":
                t += 1.0 / rate
            elif self.kind == "poisson":
                t += rng.expovariate(rate)
            else:  # gamma with mean 1/rate: shape = burstiness, scale = 1 / (rate * burstiness)
                t += rng.gammavariate(self.burstiness, 1.0 / (rate * self.burstiness))
        return out

    def __str__(self) -> str:
        return f"gamma:{self.burstiness:g}" if self.kind == "gamma" else self.kind
