"""Trace loaders on a few real rows of the traces the project ships (bench/data/traces)."""

from __future__ import annotations

import gzip
import json
import lzma
import shutil
from pathlib import Path

import pytest

from bench.replay.traces import (
    CLAUDE_CODE_BLOCK_TOKENS,
    DEFAULT_TRACES_DIR,
    MOONCAKE_BLOCK_TOKENS,
    infinite_cache_hit_ratio,
    load_claude_code,
    load_mooncake,
)
from router.block_hash import hash_blocks

MOONCAKE = DEFAULT_TRACES_DIR / "mooncake" / "conversation_trace.jsonl"
SESSIONS = DEFAULT_TRACES_DIR / "claude-code" / "sessions"


def test_mooncake_rows_become_open_loop_requests_with_full_blocks_only() -> None:
    trace = load_mooncake(MOONCAKE, max_requests=50)
    with lzma.open(MOONCAKE.with_suffix(".jsonl.xz"), "rt") as f:
        rows = [json.loads(next(f)) for _ in range(50)]
    reqs = list(trace.requests())
    assert not trace.closed_loop and len(reqs) == 50
    for row, req in zip(rows, reqs, strict=True):
        assert req.arrival_s == row["timestamp"] / 1000
        assert req.num_prompt_tokens == row["input_length"]
        assert len(req.block_hashes) == min(
            len(row["hash_ids"]), row["input_length"] // MOONCAKE_BLOCK_TOKENS
        )
    # Rows 0 and 1 share their first block (hash id 0) and nothing after it.
    assert rows[0]["hash_ids"][0] == rows[1]["hash_ids"][0] == 0
    assert reqs[0].block_hashes[0] == reqs[1].block_hashes[0]
    assert reqs[0].block_hashes[1] != reqs[1].block_hashes[1]


def test_block_hashes_are_the_routers_hash_of_the_synthetic_tokens() -> None:
    trace = load_mooncake(MOONCAKE, max_requests=5)
    req = next(trace.requests())
    tokens = trace.hasher.tokens(list(req.block_hashes))
    assert hash_blocks(tokens, trace.hasher.token_block_size) == list(req.block_hashes)


def test_grouping_trace_blocks_into_larger_blocks_drops_the_partial_group() -> None:
    fine = load_mooncake(MOONCAKE, max_requests=20)
    coarse = load_mooncake(MOONCAKE, block_tokens=4 * MOONCAKE_BLOCK_TOKENS, max_requests=20)
    for a, b in zip(fine.requests(), coarse.requests(), strict=True):
        assert len(b.block_hashes) == len(a.block_hashes) // 4
    with pytest.raises(ValueError):
        load_mooncake(MOONCAKE, block_tokens=700, max_requests=1)


def test_claude_code_session_replays_turns_with_recorded_gaps_and_skips_subagents() -> None:
    path = SESSIONS / "trace_0003.json.xz"
    with lzma.open(path) as f:
        doc = json.load(f)
    parent_rows = [r for r in doc["requests"] if r.get("type") != "subagent"]
    trace = load_claude_code(SESSIONS, block_tokens=CLAUDE_CODE_BLOCK_TOKENS, max_sessions=3)
    session = next(s for s in trace.sessions if s.session_id == "trace_0003")
    assert trace.closed_loop and len(session.requests) == len(parent_rows)
    first, second = session.requests[:2]
    assert first.gap_s == 0.0 and second.gap_s == parent_rows[1]["think_time"]
    assert second.num_prompt_tokens == parent_rows[1]["in"]
    assert second.num_output_tokens == parent_rows[1]["out"]
    # Consecutive turns share their leading blocks: the second turn extends the first.
    shared = len(first.block_hashes)
    assert second.block_hashes[:shared] == first.block_hashes


def test_claude_code_ids_are_namespaced_per_session() -> None:
    trace = load_claude_code(SESSIONS, max_sessions=2)
    a, b = trace.sessions
    # Both sessions number their first block 1 locally; identities must differ.
    assert a.requests[0].block_hashes[0] != b.requests[0].block_hashes[0]


def test_seeded_sample_is_reproducible_and_differs_from_the_first_sessions() -> None:
    one = load_claude_code(SESSIONS, max_sessions=3, seed=7)
    two = load_claude_code(SESSIONS, max_sessions=3, seed=7)
    first = load_claude_code(SESSIONS, max_sessions=3)
    assert [s.session_id for s in one.sessions] == [s.session_id for s in two.sessions]
    assert [s.session_id for s in one.sessions] != [s.session_id for s in first.sessions]


def test_bound_of_agent_sessions_is_high() -> None:
    trace = load_claude_code(SESSIONS, max_sessions=5)
    assert 0.8 < infinite_cache_hit_ratio(trace) < 1.0


def test_a_traces_dir_may_hold_plain_gzip_or_xz_files_with_the_same_result(tmp_path: Path) -> None:
    """`--traces-dir` takes the traces as their sources publish them (plain jsonl, gzip sessions)."""
    (tmp_path / "mooncake").mkdir()
    with lzma.open(MOONCAKE.with_suffix(".jsonl.xz"), "rt") as f:
        head = [next(f) for _ in range(40)]
    (tmp_path / "mooncake" / "conversation_trace.jsonl").write_text("".join(head))
    plain = load_mooncake(tmp_path / "mooncake" / "conversation_trace.jsonl")
    assert plain.sessions == load_mooncake(MOONCAKE, max_requests=40).sessions

    sessions = tmp_path / "claude-code" / "sessions"
    sessions.mkdir(parents=True)
    names = ["trace_0001", "trace_0002", "trace_0003"]
    for i, name in enumerate(names):
        with lzma.open(SESSIONS / f"{name}.json.xz", "rt") as f:
            text = f.read()
        if i == 0:
            (sessions / f"{name}.json").write_text(text)
        elif i == 1:
            with gzip.open(sessions / f"{name}.json.gz", "wt") as out:
                out.write(text)
        else:
            shutil.copy(SESSIONS / f"{name}.json.xz", sessions)
    mixed = load_claude_code(sessions)
    assert [s.session_id for s in mixed.sessions] == names
    assert mixed.sessions == load_claude_code(SESSIONS, max_sessions=3).sessions


def test_the_shipped_traces_are_whole() -> None:
    """The copies in the repository are the full releases, so the published replay numbers reproduce."""
    assert len(list(SESSIONS.glob("*.json.xz"))) == 300
    assert load_mooncake(MOONCAKE).num_requests() == 12031
