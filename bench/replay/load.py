"""Choosing the offered load: the open-loop time scale or the closed-loop session concurrency that puts
the prefill pool at a target utilisation.

First an analytic estimate, policy-neutral: every request's prefill costs what it would with the
infinite-cache bound's hits (`ServiceTimeModel.prefill_s`), and
- open loop: utilisation = total prefill work x time_scale / (replicas x trace span);
- closed loop: a session slot is busy for its turns' prefill + decode + gaps and loads the prefill pool
  only during its prefills, so utilisation = concurrency x (sum of work / sum of session time) / replicas.
Then `refine` corrects the estimate with pilot runs of a reference policy (misses add work the estimate
omits).
"""

from __future__ import annotations

from collections.abc import Callable

from bench.replay.traces import Trace
from router.service_time import Timing

# Decode batch assumed when estimating a session's reply time (refined by pilots anyway).
_NOMINAL_DECODE_BATCH = 16


def bound_prefill_work(trace: Trace, timing: Timing) -> dict[str, float]:
    """Prefill seconds per request id with the infinite-cache bound's hits."""
    seen: set[int] = set()
    work: dict[str, float] = {}
    reqs = list(trace.requests())
    if not trace.closed_loop:
        reqs.sort(key=lambda r: r.arrival_s)
    for r in reqs:
        hits = 0
        for h in r.block_hashes:
            if h not in seen:
                break
            hits += 1
        seen.update(r.block_hashes)
        cached = min(hits * trace.block_tokens, r.num_prompt_tokens - 1)
        work[r.request_id] = timing.prefill_s(r.num_prompt_tokens - cached, cached)
    return work


def estimate_time_scale(trace: Trace, timing: Timing, prefill_replicas: int, target: float) -> float:
    work = bound_prefill_work(trace, timing)
    arrivals = [r.arrival_s for r in trace.requests()]
    span = max(arrivals) - min(arrivals)
    if span <= 0:
        raise ValueError("the trace slice spans no time; take more requests")
    return target * prefill_replicas * span / sum(work.values())


def estimate_concurrency(
    trace: Trace,
    timing: Timing,
    prefill_replicas: int,
    target: float,
    *,
    gap_scale: float,
    max_gap_s: float,
) -> float:
    work = bound_prefill_work(trace, timing)
    total_work = sum(work.values())
    total_time = 0.0
    for s in trace.sessions:
        for i, r in enumerate(s.requests):
            ctx = _NOMINAL_DECODE_BATCH * r.num_prompt_tokens
            decode = r.num_output_tokens * timing.tpot_s(_NOMINAL_DECODE_BATCH, ctx)
            gap = 0.0 if i == 0 else min(r.gap_s, max_gap_s) * gap_scale
            total_time += gap + work[r.request_id] + decode
    return target * prefill_replicas * total_time / total_work


def refine(
    knob: float,
    target: float,
    measure: Callable[[float], float],
    *,
    rounds: int,
    integer: bool,
    tolerance: float = 0.05,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[float, float]:
    """Pilot runs: move `knob` (offered load) until the measured utilisation is within `tolerance` of
    `target`. Returns (knob, last measured utilisation).

    Below saturation utilisation is close to linear in load, so a proportional step is taken; a saturated
    pool (utilisation near 1; agent sessions fall off a cache cliff: misses recompute whole contexts) says
    nothing about how far over it is, so the load is halved. Once the target is bracketed, bisect
    (geometrically) between the two closest pilots."""
    lo: float | None = None  # highest knob measured below target
    hi: float | None = None  # lowest knob measured above target
    util = measure(knob)
    log(f"pilot: knob={knob:.4g} util={util:.3f}")
    for _ in range(rounds):
        if abs(util - target) <= tolerance or util <= 0:
            break
        if util > target:
            hi = knob if hi is None else min(hi, knob)
        else:
            lo = knob if lo is None else max(lo, knob)
        if lo is not None and hi is not None:
            nxt = (lo * hi) ** 0.5
        elif util >= 0.95:
            nxt = knob / 2
        else:
            nxt = knob * target / util
        if integer:
            nxt = max(1.0, float(round(nxt)))
            if nxt in (lo, hi):
                break  # bracket narrower than one step
        knob = nxt
        util = measure(knob)
        log(f"pilot: knob={knob:.4g} util={util:.3f}")
    return knob, util
