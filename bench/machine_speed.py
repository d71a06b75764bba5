"""How steady this machine's own CPUs are: what a benchmark's ratios between two runs can resolve here.

    .venv/bin/python -m bench.machine_speed [--seconds 120] [--window 30] [--rounds 8]

Run it with nothing else running (stop any cluster first). It measures two things with a fixed pure-Python
loop, timed in CPU time (`time.thread_time`), so that waiting for a core does not count, only how fast the
core runs once it has the loop:
1. Swings: the loop on every core at once, back to back, for `--seconds`; each second's median loop time
   against that core's fastest tenth of seconds. On a virtual machine whose host runs other work the loop
   slows for seconds at a time with nothing of ours running. Printed per core: the share of seconds over
   1.2x and 1.5x, the slowest second, and how far the mean speed of two `--window`-second stretches can
   differ from the machine alone (the slowest stretch's mean against the fastest's).
2. Waking: the loop run briefly every 50 ms on an otherwise idle core, against the same with a nice-19
   busy loop keeping that core awake (the probe still gets the core at once), in alternating blocks of
   `--block-s`. A core that sleeps between bursts of work (a request after an idle pause) may run slower
   when it wakes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

_LOOP = 50_000  # ~2 ms of pure Python on this project's CI machines
_BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nos.nice(19)\nwhile True:\n    pass\n"


def loop_s() -> float:
    """CPU seconds of one fixed pure-Python loop."""
    began = time.thread_time()
    total = 0
    for i in range(_LOOP):
        total += i * i
    return time.thread_time() - began


def relative(per_second: Sequence[float]) -> list[float]:
    """Each second's loop time against the fastest tenth of seconds (1.0: as fast as this core gets)."""
    fast = sorted(per_second)[len(per_second) // 10]
    return [s / fast for s in per_second]


def window_spread(ratios: Sequence[float], window: int) -> float:
    """The slowest `window`-second stretch's mean against the fastest's (sliding by a second): how much two
    runs of that length can differ from the machine alone. 1.0 when the series is shorter than a window."""
    if len(ratios) < window:
        return 1.0
    means = [statistics.fmean(ratios[i : i + window]) for i in range(len(ratios) - window + 1)]
    return max(means) / min(means)


def _per_second(core: int, seconds: float, out: multiprocessing.SimpleQueue) -> None:  # type: ignore[type-arg]
    os.sched_setaffinity(0, {core})
    medians: list[float] = []
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        second_end = time.monotonic() + 1.0
        samples = []
        while time.monotonic() < second_end:
            samples.append(loop_s())
        medians.append(statistics.median(samples))
    out.put((core, medians))


def swings(seconds: float, cores: Sequence[int]) -> dict[int, list[float]]:
    """Per core, each second's median loop time (CPU seconds), all cores looping at once."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_per_second, args=(core, seconds, out)) for core in cores]
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return results


def waking(rounds: int, core: int, block_s: float) -> tuple[list[float], list[float]]:
    """Median loop time (CPU seconds) per block on `core`: idle between probes, and kept awake by a nice-19
    busy loop; the blocks alternate, each round in the other order."""
    os.sched_setaffinity(0, {core})
    idle: list[float] = []
    awake: list[float] = []
    for r in range(rounds):
        for keep_awake in (False, True) if r % 2 == 0 else (True, False):
            busy = subprocess.Popen([sys.executable, "-c", _BUSY, str(core)]) if keep_awake else None
            try:
                time.sleep(0.3)
                samples = []
                block_end = time.monotonic() + block_s
                while time.monotonic() < block_end:
                    samples.append(loop_s())
                    time.sleep(0.05)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
            (awake if keep_awake else idle).append(statistics.median(samples))
    return idle, awake


def _describe(ratios: Sequence[float], window: int) -> str:
    over = [sum(r > bound for r in ratios) / len(ratios) for bound in (1.2, 1.5)]
    return (
        f"{len(ratios)} s: {over[0]:.0%} of seconds over 1.2x, {over[1]:.0%} over 1.5x, slowest "
        f"{max(ratios):.2f}x; two {window} s stretches differ by up to {window_spread(ratios, window):.2f}x"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="how long the cores loop (swings)")
    ap.add_argument("--window", type=int, default=30, help="seconds a benchmark window lasts")
    ap.add_argument("--rounds", type=int, default=8, help="idle and awake blocks each (waking)")
    ap.add_argument("--block-s", type=float, default=3.0)
    args = ap.parse_args(argv)
    if args.seconds < 1 or args.window < 1 or args.rounds < 1 or args.block_s <= 0:
        ap.error("--seconds, --window and --rounds must be at least 1, --block-s above 0")
    cores = sorted(os.sched_getaffinity(0))
    print(f"swings: the loop on cores {cores} at once for {args.seconds:.0f} s", flush=True)
    for core, per_second in sorted(swings(args.seconds, cores).items()):
        print(f"  core {core}: {_describe(relative(per_second), args.window)}", flush=True)
    idle, awake = waking(args.rounds, cores[-1], args.block_s)
    print(f"waking, core {cores[-1]}: loop time per block, idle core / kept awake (ms)")
    print(f"  idle:  {' '.join(f'{s * 1e3:.2f}' for s in idle)}")
    print(f"  awake: {' '.join(f'{s * 1e3:.2f}' for s in awake)}")
    ratio = statistics.median(idle) / statistics.median(awake)
    print(f"  median idle / awake: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
