"""The live benchmark's agent sessions as a replay trace: `pdserve bench --mode sessions` and `pdserve replay`
then run one workload.

bench/live/sessions.py scales the Claude Code sessions to a small model's context; this turns that plan
into a `Trace` with the same prompts (their real token ids, hashed in blocks of the engines' block size as
the live router hashes them), output lengths, gaps (already scaled and capped by the plan) and session start
times (the live run's arrival offsets). The replay then needs `gap_scale` 1 and no gap cap of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.live.sessions import SessionPlan
from bench.replay.traces import BlockHasher, Session, Trace, TraceRequest


def trace_of_plan(plan: SessionPlan, starts: Sequence[float], block_tokens: int) -> Trace:
    """`plan`'s sessions, session i starting at `starts[i]` seconds."""
    if len(starts) != len(plan.sessions):
        raise ValueError(f"{len(starts)} start times for {len(plan.sessions)} sessions")
    hasher = BlockHasher.of_tokens(block_tokens)
    sessions = []
    for i, turns in enumerate(plan.sessions):
        session_id = turns[0].request.session_id or f"session-{i}"
        requests = tuple(
            TraceRequest(
                request_id=f"{session_id}/{n}",
                session_id=session_id,
                arrival_s=0.0,
                gap_s=turn.gap_s,
                num_prompt_tokens=len(turn.request.token_ids),
                num_output_tokens=turn.request.max_tokens,
                block_hashes=hasher.token_hashes(turn.request.token_ids),
            )
            for n, turn in enumerate(turns)
        )
        sessions.append(Session(session_id=session_id, requests=requests))
    return Trace(
        name="claude-code",
        closed_loop=True,
        block_tokens=block_tokens,
        sessions=tuple(sessions),
        hasher=hasher,
        session_starts=tuple(starts),
    )
