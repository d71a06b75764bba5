"""A vLLM engine's prefill at token counts it has run before against counts it has not, in one process.

    .venv/bin/python -m bench.step_shapes [--tokens 1500] [--prompts 40] [--rounds 2]

On a CPU, vLLM's linear layers run through oneDNN with a primitive per layer and per token count (a cache of
32), and an engine step of a count it has not run lately is slower. An agent's turns almost never repeat a
count, so a timing that repeats one size times only the warm case: bench/served_timing.py times fresh counts
for that reason. This script shows the difference on the built-in tiny model, with vLLM alone (no pdserve):
`--prompts` prompts of fresh random ids, first all of `--tokens` tokens, then each of a count not used
before (just above `--tokens`: a few tokens more cost microseconds), one output token each, in rounds; it
prints the mean time of each.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from engine.tiny_model import default_max_model_len, ensure_tiny_model


def fresh_counts(tokens: int, prompts: int, round_: int) -> list[int]:
    """Round `round_`'s counts: `prompts` counts above `tokens` that no other round uses."""
    start = tokens + 1 + round_ * prompts
    return list(range(start, start + prompts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    context = default_max_model_len()
    if args.tokens + args.rounds * args.prompts > context - 8:
        ap.error(f"--tokens + --rounds * --prompts must stay within the tiny model's {context}-token context")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = str(ensure_tiny_model())
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=context, block_size=32)
    rng = random.Random(0)
    once = SamplingParams(max_tokens=1, ignore_eos=True)

    def prefill_ms(n: int) -> float:
        ids = [rng.randint(5, 2000) for _ in range(n)]  # fresh ids: nothing cached
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], once, use_tqdm=False)
        return (time.perf_counter() - t0) * 1e3

    prefill_ms(context - 8)  # the longest step first: what is left is the count, not a first-time size
    print(f"{'round':>5} {'same count, mean ms':>20} {'fresh counts, mean ms':>22} {'ratio':>6}")
    for r in range(args.rounds):
        same = statistics.mean(prefill_ms(args.tokens) for _ in range(args.prompts))
        fresh = statistics.mean(prefill_ms(n) for n in fresh_counts(args.tokens, args.prompts, r))
        print(f"{r + 1:>5} {same:>20.1f} {fresh:>22.1f} {fresh / same:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
