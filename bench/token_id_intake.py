"""Taking in a token-id session's next turn: converting all its ids vs reusing the previous turn's
(router.intake.token_sessions).

For each `--context-tokens`, a session's previous turn of that many ids and a next turn that appends
`--turn-tokens` ids are serialized as the client sends them; the server's work on the next turn is timed both
ways, from the wire bytes to the validated list of ids: parse + convert and check every id, vs parse + scan
the wire for the packed ids + compare with the previous turn's + convert and check the new ids. The lists are
checked equal. Prints microseconds per turn (median of `--repeat`) and the ratio.

    .venv/bin/python -m bench.token_id_intake [--context-tokens 8192 32768 131072]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pdserve_client.api import pdserve_pb2 as pb
from router.intake.token_sessions import SessionTokenIds
from router.intake.validation import ModelLimits, validate_generate

LIMITS = ModelLimits(served_name="m", max_model_len=1 << 20, vocab_size=150_000)


def _full(raw: bytes) -> list[int]:
    return validate_generate(pb.GenerateRequest.FromString(raw), LIMITS).input.prompt_token_ids


def _reusing(sessions: SessionTokenIds, raw: bytes) -> list[int]:
    req = pb.GenerateRequest.FromString(raw)
    turn = sessions.start(req, raw)
    ids = validate_generate(req, LIMITS, None if turn is None else turn.prior).input.prompt_token_ids
    if turn is not None:
        sessions.finish(turn, ids)
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context-tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    rng = random.Random(0)
    print(f"{'context':>8} {'full us':>9} {'reusing us':>10} {'full/reusing':>12}")
    for n in args.context_tokens:
        prev = [rng.randrange(LIMITS.vocab_size) for _ in range(n)]
        nxt = prev + [rng.randrange(LIMITS.vocab_size) for _ in range(args.turn_tokens)]
        raw_prev = pb.GenerateRequest(session_id="s", prompt_token_ids=prev).SerializeToString()
        raw_next = pb.GenerateRequest(session_id="s", prompt_token_ids=nxt).SerializeToString()
        full, reusing = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            a = _full(raw_next)
            full.append(time.perf_counter() - t0)
            sessions = SessionTokenIds()
            _reusing(sessions, raw_prev)  # the previous turn, as the server took it in
            t0 = time.perf_counter()
            b = _reusing(sessions, raw_next)
            reusing.append(time.perf_counter() - t0)
            assert a == b == nxt
        f, r = statistics.median(full) * 1e6, statistics.median(reusing) * 1e6
        print(f"{n:>8} {f:>9.0f} {r:>10.0f} {f / r:>12.1f}", flush=True)


if __name__ == "__main__":
    main()
