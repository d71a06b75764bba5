"""Agent sessions from a trace folder, replayed against a live endpoint: each session's turns in order, a turn
sent when the previous reply finished plus its recorded think/tool gap (`gap_scale` times, at most
MAX_GAP_S), every turn with the session's id (so the router keeps the session where its cache is).

The traces are Claude Code sessions (bench/data/traces, or another folder laid out the same way; the loader
is the replay's, bench/replay/traces.py). Their contexts (131k tokens on average) do not fit a small model,
so every prompt is scaled by one factor, block for block: each trace block becomes the same `k` token ids
wherever it recurs (drawn from its hash), so what turns and sessions share in the trace they share here,
and a turn's prompt extends its previous one as it does in the trace. What cannot be reproduced: the
previous reply inside the next prompt is the trace's, not what this model generated, so only the trace's
own reuse is cached (as with any trace replay against a different model).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from bench.live.workload import TOKEN_RANGE, Request
from bench.replay.traces import DEFAULT_TRACES_DIR, load_trace

TRACE_BLOCK_TOKENS = 512  # trace blocks grouped this coarsely: each becomes `k` live tokens
# A recorded gap longer than this is a person away, not a tool running: capped, so a run ends in minutes.
MAX_GAP_S = 30.0


@dataclass(frozen=True)
class Turn:
    request: Request
    gap_s: float  # after the previous turn's reply (0 for a session's first turn)


@dataclass(frozen=True)
class SessionPlan:
    sessions: list[list[Turn]]
    tokens_per_block: int  # live tokens per trace block of TRACE_BLOCK_TOKENS
    scale: float  # live prompt tokens per trace prompt token

    def describe(self, source: str) -> str:
        turns = sum(len(s) for s in self.sessions)
        return (
            f"{len(self.sessions)} agent sessions ({turns} turns) from {source}, "
            f"prompts scaled x{self.scale:.4f} "
            f"({self.tokens_per_block} tokens a {TRACE_BLOCK_TOKENS}-token block)"
        )


def plan_sessions(
    *,
    num_sessions: int,
    max_turns: int,
    max_model_len: int,
    max_output: int,
    gap_scale: float,
    seed: int,
    traces_dir: Path = DEFAULT_TRACES_DIR,
) -> SessionPlan:
    """`num_sessions` sessions (a seeded sample), their first `max_turns` turns, scaled to fit the model."""
    trace = load_trace(
        "claude-code", traces_dir, block_tokens=TRACE_BLOCK_TOKENS, limit=num_sessions, seed=seed
    )
    chosen = [s.requests[:max_turns] for s in trace.sessions]
    longest = max(r.num_prompt_tokens for turns in chosen for r in turns)
    room = max_model_len - max_output - 1
    k = max(1, room * TRACE_BLOCK_TOKENS // max(longest, 1))  # the longest prompt x k / block fits
    scale = k / TRACE_BLOCK_TOKENS
    sessions = []
    for turns in chosen:
        sessions.append(
            [
                Turn(
                    request=Request(
                        token_ids=_prompt(r.request_id, r.block_hashes, r.num_prompt_tokens, k, room),
                        # Not scaled: the decode length is what TPOT is measured over.
                        max_tokens=min(max_output, r.num_output_tokens),
                        group=-1,
                        session_id=r.session_id,
                    ),
                    gap_s=min(r.gap_s * gap_scale, MAX_GAP_S),
                )
                for r in turns
            ]
        )
    return SessionPlan(sessions=sessions, tokens_per_block=k, scale=scale)


def _prompt(request_id: str, blocks: tuple[int, ...], prompt_tokens: int, k: int, room: int) -> list[int]:
    ids: list[int] = []
    for h in blocks:
        rng = random.Random(h)  # the same block, the same ids, wherever it recurs
        ids += [rng.randint(*TOKEN_RANGE) for _ in range(k)]
    # The part of the prompt past its last full trace block: this request's own.
    tail = round((prompt_tokens - len(blocks) * TRACE_BLOCK_TOKENS) * k / TRACE_BLOCK_TOKENS)
    rng = random.Random(request_id)
    ids += [rng.randint(*TOKEN_RANGE) for _ in range(max(1, tail))]
    return ids[:room]
