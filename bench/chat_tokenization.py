"""Tokenizing an agent's next turn: the whole conversation again vs incrementally
(router/intake/chat_encoder.py).

A session grows turn by turn (an assistant tool call, a tool result of `--turn-tokens`-ish tokens) up to each
`--context-tokens`; at that size the next turn is tokenized both ways, on the built-in model's tokenizer and
chat template, and the ids are checked equal. Prints milliseconds per turn (p50 over `--turns` turns) and
the ratio. Rendering the template is included in both (the router renders every turn).

    .venv/bin/python -m bench.chat_tokenization [--context-tokens 8192 32768 131072]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.tiny_model import ensure_tiny_model
from router.intake.chat_encoder import SessionChatEncoder
from router.intake.tokenizer import PromptTokenizer

WORDS = [
    "the", "file", "build", "error", "test", "src", "def", "return", "import", "class", "self", "value",
    "path", "line", "python", "router",
]  # fmt: skip


def tool_turn(rng: random.Random, n: int, words: int) -> list[dict[str, Any]]:
    call = {"id": f"call_{n}", "type": "function", "function": {"name": "run", "arguments": {"cmd": "ls"}}}
    result = " ".join(rng.choice(WORDS) for _ in range(words))
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context-tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--turn-tokens", type=int, default=300, help="about this many tokens appended per turn")
    ap.add_argument("--turns", type=int, default=10, help="turns measured at each context size")
    ap.add_argument("--model-cache", type=Path, default=None, help="where the built-in model is built")
    args = ap.parse_args()
    cache = args.model_cache or Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    tok = PromptTokenizer(ensure_tiny_model(cache))
    rng = random.Random(0)
    words_per_turn = max(1, args.turn_tokens // 2)  # ~2 tokens per word with the built-in tokenizer
    print(f"{'context':>8} {'full ms':>9} {'incremental ms':>15} {'full/incr':>10}")
    for target in args.context_tokens:
        enc = SessionChatEncoder(tok)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
        n = 0
        while len(enc.encode("s", messages)) < target:  # grow the session to the size measured
            messages += tool_turn(rng, n, words_per_turn)
            n += 1
        full_ms, incr_ms = [], []
        for _ in range(args.turns):
            messages += tool_turn(rng, n, words_per_turn)
            n += 1
            t0 = time.perf_counter()
            incremental = enc.encode("s", messages)
            t1 = time.perf_counter()
            full = tok.encode_chat(messages)
            t2 = time.perf_counter()
            if incremental != full:
                raise SystemExit(f"incremental ids differ from the full encoding at {len(full)} tokens")
            incr_ms.append((t1 - t0) * 1e3)
            full_ms.append((t2 - t1) * 1e3)
        f, i = statistics.median(full_ms), statistics.median(incr_ms)
        print(f"{len(full):>8} {f:>9.2f} {i:>15.2f} {f / i:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
