"""What requests a benchmark sends: prompt and output lengths drawn from distributions, and shared prefixes.

Prompts are token ids (sent as `token_ids`, so the benchmark needs no tokenizer and measures the serving path,
not tokenization), drawn from a range of ordinary tokens that even the built-in model's 2048-entry vocabulary
has (past the special and byte tokens at the start). Requests in the same prefix group start with the
same `prefix_len` ids, as agent sessions or shared system prompts do, so the prefix cache and the router's
prefix routing are exercised. With `repeat_period`, each prompt's own tokens are one random run of that many
ids, repeated: text that repeats itself, as a tool result quoting code the context already holds does, and
what ngram speculative decoding drafts from.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

TOKEN_RANGE = (300, 2000)
RAMP_STEPS = 4  # warm-up prompts up to the run's longest, at most
RAMP_OUTPUT = 8  # tokens each of them generates: decode steps at a long context warm too


@dataclass(frozen=True)
class Lengths:
    """A length distribution: `fixed:N`, `normal:MEAN,STD`, `lognormal:MEAN,SIGMA` (MEAN in tokens)."""

    kind: str
    mean: float
    spread: float = 0.0

    @staticmethod
    def parse(text: str) -> Lengths:
        kind, _, args = text.partition(":")
        try:
            values = [float(x) for x in args.split(",")] if args else []
        except ValueError:
            raise ValueError(f"{text!r}: expected fixed:N, normal:MEAN,STD or lognormal:MEAN,SIGMA") from None
        if kind == "fixed" and len(values) == 1 and values[0] >= 1:
            return Lengths("fixed", values[0])
        if kind in ("normal", "lognormal") and len(values) == 2 and values[0] >= 1 and values[1] >= 0:
            return Lengths(kind, values[0], values[1])
        raise ValueError(
            f"{text!r}: expected fixed:N, normal:MEAN,STD or lognormal:MEAN,SIGMA (N, MEAN >= 1)"
        )

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.mean)
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.mean, self.spread)))
        # lognormal with the given mean: mu = ln(mean) - sigma^2 / 2
        mu = math.log(self.mean) - self.spread**2 / 2
        return max(1, round(rng.lognormvariate(mu, self.spread)))

    def __str__(self) -> str:
        return f"{self.kind}:{self.mean:g}" + (f",{self.spread:g}" if self.kind != "fixed" else "")


@dataclass(frozen=True)
class Request:
    token_ids: list[int]
    max_tokens: int
    group: int  # prefix group (-1: none)
    session_id: str = ""  # an agent session's turns share it (the router keeps them where their cache is)


@dataclass(frozen=True)
class Workload:
    input_len: Lengths
    output_len: Lengths
    prefix_groups: int = 0  # 0: no shared prefixes
    prefix_len: int = 0  # tokens every request of a group starts with
    max_model_len: int = 2048
    repeat_period: int = 0  # 0: every prompt token drawn afresh

    def requests(self, n: int, seed: int) -> list[Request]:
        """`n` requests; prompts and outputs fit the model's context."""
        rng = random.Random(seed)
        prefixes = [
            [rng.randint(*TOKEN_RANGE) for _ in range(self.prefix_len)] for _ in range(self.prefix_groups)
        ]
        out = []
        for _ in range(n):
            group = rng.randrange(self.prefix_groups) if self.prefix_groups else -1
            head = prefixes[group] if group >= 0 else []
            max_tokens = min(self.output_len.draw(rng), self.max_model_len - 2)
            room = self.max_model_len - max_tokens - len(head)
            own = max(1, min(self.input_len.draw(rng), room))
            period = self.repeat_period or own
            run = [rng.randint(*TOKEN_RANGE) for _ in range(min(period, own))]
            ids = head + [run[i % len(run)] for i in range(own)]
            out.append(Request(token_ids=ids, max_tokens=max_tokens, group=group))
        return out

    def warmup(self, n: int, longest: int, seed: int) -> list[Request]:
        """`n` of the workload's requests, then (unless `n` is 0) `ramp`'s up to the run's `longest`."""
        warm = self.requests(n, seed)
        if not warm:
            return warm
        top = min(longest, self.max_model_len - RAMP_OUTPUT)
        return warm + ramp(top, max(len(r.token_ids) for r in warm), random.Random(seed + 1))

    def describe(self) -> str:
        shared = (
            f", {self.prefix_groups} prefix groups of {self.prefix_len} tokens" if self.prefix_groups else ""
        )
        repeated = f", prompts repeating every {self.repeat_period} tokens" if self.repeat_period else ""
        return f"input {self.input_len}, output {self.output_len}{shared}{repeated}"


def ramp(longest: int, reached: int, rng: random.Random) -> list[Request]:
    """Warm-up prompts of fresh ids from about an eighth of `longest` up to it, each twice the one before,
    those no longer than `reached` (what a warm-up reached already) left out. On a CPU the first prefills
    after an engine starts, and the first at a length it has not reached yet, cost up to twice what they do
    after (docs/benchmarks.md, "Warm-up"): a measurement would otherwise pay it."""
    lengths = [m for m in (longest >> k for k in range(RAMP_STEPS)) if m > reached]
    return [
        Request(token_ids=[rng.randint(*TOKEN_RANGE) for _ in range(m)], max_tokens=RAMP_OUTPUT, group=-1)
        for m in reversed(lengths)
    ]
