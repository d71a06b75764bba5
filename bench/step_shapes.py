"""A vLLM engine's prefill at token counts it has run before against counts it has not, in one process.

    .venv/bin/python -m bench.step_shapes [--topology deploy/local.yaml] [--tokens 1500] [--prompts 40] \
        [--rounds 2]

On a CPU, vLLM's linear layers run through oneDNN with a primitive per layer and per token count (a cache of
32), and an engine step of a count it has not run lately is slower. An agent's turns almost never repeat a
count, so a timing that repeats one size times only the warm case: bench/served_timing.py times fresh counts
for that reason. This script shows the difference on the topology's decode engine as its replica hosts it
(bench/engine_timing.py's `start_engines`; no router, no Serve): `--prompts` prompts of fresh random ids,
first all of `--tokens` tokens, then each of a count not used before (just above `--tokens`: a few tokens
more cost microseconds), one output token each, in rounds; it prints the mean time of each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

from bench.engine_timing import REPO, _Engines, start_engines
from cluster.topology_file import TopologyError, load_topology


def fresh_counts(tokens: int, prompts: int, round_: int) -> list[int]:
    """Round `round_`'s counts: `prompts` counts above `tokens` that no other round uses."""
    start = tokens + 1 + round_ * prompts
    return list(range(start, start + prompts))


async def _rounds(engines: _Engines, tokens: int, prompts: int, rounds: int) -> None:
    async def prefill_ms(n: int) -> float:
        return await engines.decode_s([engines.prompt(n)], 1) * 1e3  # fresh ids: nothing cached

    # The longest step first: what is left is the count, not a first-time size.
    await prefill_ms(engines.max_model_len - 8)
    print(f"{'round':>5} {'same count, mean ms':>20} {'fresh counts, mean ms':>22} {'ratio':>6}")
    for r in range(rounds):
        same = statistics.mean([await prefill_ms(tokens) for _ in range(prompts)])
        fresh = statistics.mean([await prefill_ms(n) for n in fresh_counts(tokens, prompts, r)])
        print(f"{r + 1:>5} {same:>20.1f} {fresh:>22.1f} {fresh / same:>6.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", type=Path, default=REPO / "deploy" / "local.yaml")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        topo = load_topology(args.topology)
    except TopologyError as exc:
        print(f"bench.step_shapes: {exc}", file=sys.stderr)
        return 2
    context = topo.model.max_model_len
    if args.tokens + args.rounds * args.prompts > context - 8:
        ap.error(f"--tokens + --rounds * --prompts must stay within the model's {context}-token context")
    try:
        engines = start_engines(topo)
    except TopologyError as exc:
        print(f"bench.step_shapes: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_rounds(engines, args.tokens, args.prompts, args.rounds))
    finally:
        engines.prefill.shutdown()
        engines.decode.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
