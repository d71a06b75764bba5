"""The work pdserve's policy recently gave each replica: what breaks ties between equal options and what the
balance and churn charges compare against the pool's mean.

Decayed per decision (a half-life counted in decisions, not seconds), so the policy needs no clock and a
replay decides deterministically.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.messages import ReplicaView

HALF_LIFE_DECISIONS = 2000.0
# Costs closer than this are equivalent: the estimate is not more precise, and the replica given the least
# recent work takes the request (otherwise every cold prompt at low load goes to the first replica).
TIE_TOLERANCE_S = 0.05


class RecentWork:
    """An amount per replica, decayed per decision. Values are stored multiplied by a growing scale (so a
    decay step touches one float, not every replica) and rescaled before it overflows."""

    def __init__(self, half_life: float = HALF_LIFE_DECISIONS) -> None:
        self._growth = 2.0 ** (1.0 / half_life)
        self._scale = 1.0
        self._work: dict[str, float] = {}

    def tick(self) -> None:
        self._scale *= self._growth
        if self._scale > 1e200:
            self._work = {k: v / self._scale for k, v in self._work.items()}
            self._scale = 1.0

    def add(self, replica_id: str, amount: float) -> None:
        self._work[replica_id] = self._work.get(replica_id, 0.0) + amount * self._scale

    def key(self, replica_id: str) -> float:
        """Comparable between replicas (not in the amount's unit)."""
        return self._work.get(replica_id, 0.0)

    def seconds(self, replica_id: str) -> float:
        return self._work.get(replica_id, 0.0) / self._scale

    def above_mean(self, replicas: Sequence[ReplicaView], weight: float) -> list[float]:
        """`weight` x each replica's amount above the mean of `replicas` (0 at or below it)."""
        xs = [self.seconds(r.replica_id) for r in replicas]
        mean = sum(xs) / len(xs)
        return [weight * (x - mean) if x > mean else 0.0 for x in xs]


def pick(replicas: Sequence[ReplicaView], costs: Sequence[float], recent: RecentWork) -> int:
    """Index of the lowest cost; among costs within `TIE_TOLERANCE_S` of it, the replica with the least recent
    work (then the lower cost)."""
    if len(costs) == 1:
        return 0
    limit = min(costs) + TIE_TOLERANCE_S
    key = recent.key
    best = -1
    best_key = (0.0, 0.0)
    for i, c in enumerate(costs):
        if c <= limit:
            k = (key(replicas[i].replica_id), c)
            if best < 0 or k < best_key:
                best, best_key = i, k
    return best
