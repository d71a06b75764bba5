"""Load the real request traces into one model the simulator replays.

The traces ship with the project (`bench/data/traces`, xz-compressed; sources and licences in
`bench/data/README.md`); `--traces-dir` points at another copy laid out the same way, plain, gzip or xz.

Three sources, three shapes:
- Mooncake `conversation_trace.jsonl`: one request per line, `timestamp` (ms since the trace start),
  `input_length`, `output_length`, `hash_ids` (one id per 512-token block, global across the trace). It
  replays open-loop: each request arrives at its recorded time (divided by a time-scale factor).
- Azure LLM inference trace 2023, conversation service (`AzureLLMInferenceTrace_conv.csv`): `TIMESTAMP`,
  `ContextTokens`, `GeneratedTokens`; no prefix information, so every prompt's blocks are its own (no cache
  hits). Open-loop: the arrival pattern and the lengths are what it gives.
- Claude Code `sessions/*.json.gz`: one agent session per file, `block_size` 64, `requests[]` with `t`,
  `in`, `out`, `hash_ids`, `api_time`, `think_time`. Ids are local to a session, so identity is namespaced
  by session. It replays closed-loop: a turn is sent when the previous reply finished plus the recorded gap
  (`think_time`: the tool-call / think time between the previous response's end and this request). Sub-agent
  entries (`type == "subagent"`) are skipped: they run a different model (Haiku) that a cluster serving the
  parent's model would not serve, and they are 4% of the requests.

Block identity. Trace ids name blocks of `trace_block_tokens` tokens. The simulator's block (the router's
and the engine's block size) may be `k` trace blocks (`k = block_tokens / trace_block_tokens`, an integer),
which keeps the replay fast on long agent contexts (Claude Code prompts average 131k tokens = 2,000 64-token
blocks). Following the traces' README, each simulated block gets deterministic synthetic token ids built
from its `k` trace ids and the session's namespace (0 for Mooncake) (see `BlockHasher`); the router hashes
them with `router.block_hash` as it hashes a live prompt, so equal trace-id prefixes give equal router
hashes, and the KvIndex re-hashes the token ids carried by the simulated BlockStored events to the same
values. Only full blocks count (as in vLLM, a partial last block is never
cached): a request has `min(len(hash_ids), input_length // trace_block_tokens) // k` blocks."""

from __future__ import annotations

import csv
import gzip
import json
import lzma
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Literal

import msgspec

from router.block_hash import ROOT_PARENT, hash_blocks

TraceName = Literal["claude-code", "mooncake", "azure"]

DEFAULT_TRACES_DIR = Path(__file__).resolve().parents[1] / "data" / "traces"
MOONCAKE_FILE = "mooncake/conversation_trace.jsonl"
AZURE_FILE = "azure/AzureLLMInferenceTrace_conv.csv"
CLAUDE_CODE_SESSIONS = "claude-code/sessions"
# A trace file may be stored plain or compressed: the loaders take the first of these that exists.
_COMPRESSIONS = ("", ".xz", ".gz")
MOONCAKE_BLOCK_TOKENS = 512
CLAUDE_CODE_BLOCK_TOKENS = 64


class TraceRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    session_id: str
    # Open-loop traces: arrival time in the trace's clock (s). Closed-loop traces: time since session start as
    # recorded (informative only; the replay uses `gap_s`).
    arrival_s: float
    # Closed-loop: seconds between the previous turn's reply finishing and this request being sent.
    gap_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    # Chained hashes of the prompt's full simulated blocks, in prompt order.
    block_hashes: tuple[int, ...]


class Session(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    requests: tuple[TraceRequest, ...]


@dataclass(frozen=True)
class Trace:
    name: TraceName
    # True: sessions replay turn by turn (closed loop). False: requests replay at their arrival times.
    closed_loop: bool
    # Tokens per simulated block (the router's and the engines' block size).
    block_tokens: int
    sessions: tuple[Session, ...]
    # Synthetic token ids of every block (what a simulated BlockStored event carries).
    hasher: BlockHasher
    # Closed loop: when each session starts (its first turn is sent), in session order. None: `concurrency`
    # slots replay the sessions one after another (SimConfig).
    session_starts: tuple[float, ...] | None = None

    def requests(self) -> Iterator[TraceRequest]:
        for s in self.sessions:
            yield from s.requests

    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions)

    def unique_blocks(self) -> int:
        return len({h for r in self.requests() for h in r.block_hashes})


class BlockHasher:
    """Router hashes of trace blocks, and the synthetic token ids behind each (for the simulated KV events).

    A block's synthetic tokens are its compact content, `(namespace, *trace_ids)`: `group + 1` token ids
    stand in for the block's `block_tokens` real ones. Identity is all the router's index needs from them,
    and hashing ~10 ids instead of 512 per stored block is what keeps a full replay within minutes. So the
    index is built with `token_block_size` (= group + 1) as its block size, while requests and policies keep
    the real `block_tokens` for token accounting. Memoised on (parent hash, content) so the prefix an agent
    session repeats every turn is hashed once.
    """

    def __init__(self, block_tokens: int, group: int) -> None:
        self.block_tokens = block_tokens
        self.group = group
        self.token_block_size = group + 1
        self._memo: dict[tuple[int, ...], int] = {}
        self.content: dict[int, tuple[int, ...]] = {}  # router hash -> synthetic tokens

    def hashes(self, trace_ids: list[int], num_full_trace_blocks: int, namespace: int) -> tuple[int, ...]:
        g = self.group
        usable = min(len(trace_ids), num_full_trace_blocks) // g * g
        out: list[int] = []
        parent = ROOT_PARENT
        memo = self._memo
        for i in range(0, usable, g):
            content = (namespace, *trace_ids[i : i + g])
            key = (parent, *content)
            h = memo.get(key)
            if h is None:
                h = hash_blocks(content, self.token_block_size, parent)[0]
                memo[key] = h
                self.content[h] = content
            out.append(h)
            parent = h
        return tuple(out)

    @classmethod
    def of_tokens(cls, block_tokens: int) -> BlockHasher:
        """A hasher of real prompts: a block's content is its `block_tokens` token ids (`token_hashes`)."""
        return cls(block_tokens, block_tokens - 1)

    def token_hashes(self, token_ids: list[int]) -> tuple[int, ...]:
        """Router hashes of a real prompt's full blocks, as the live router hashes it (`of_tokens` only)."""
        size = self.token_block_size
        hashes = hash_blocks(token_ids, size)
        for i, h in enumerate(hashes):
            self.content.setdefault(h, tuple(token_ids[i * size : (i + 1) * size]))
        return tuple(hashes)

    def tokens(self, router_hashes: list[int]) -> list[int]:
        """Synthetic token ids of consecutive blocks, as a BlockStored event carries them."""
        content = self.content
        out: list[int] = []
        for h in router_hashes:
            out += content[h]
        return out


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".xz":
        return lzma.open(path, "rt")
    if path.suffix == ".gz":
        return gzip.open(path, "rt")
    return path.open()


def find_trace_file(path: Path) -> Path:
    """`path` as stored: itself, or with a compression suffix. FileNotFoundError names the plain path."""
    for suffix in _COMPRESSIONS:
        candidate = path.with_name(path.name + suffix)
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(2, "No such file or directory", str(path))


def trace_files(name: TraceName, traces_dir: Path) -> Path:
    """The file (Mooncake) or folder of sessions (Claude Code) a trace is read from, for reports."""
    if name == "mooncake":
        return find_trace_file(traces_dir / MOONCAKE_FILE)
    if name == "azure":
        return find_trace_file(traces_dir / AZURE_FILE)
    return traces_dir / CLAUDE_CODE_SESSIONS


def _group(block_tokens: int, trace_block_tokens: int) -> int:
    if block_tokens <= 0 or block_tokens % trace_block_tokens:
        raise ValueError(
            f"block_tokens={block_tokens} must be a positive multiple of the trace's block size "
            f"({trace_block_tokens})"
        )
    return block_tokens // trace_block_tokens


def load_mooncake(
    path: Path,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    max_requests: int | None = None,
) -> Trace:
    """The first `max_requests` requests of the Mooncake conversation trace (arrival order), one session each.

    A sample of a time-ordered open-loop trace would thin out its prefix sharing, so slicing takes a prefix.
    """
    hasher = BlockHasher(block_tokens, _group(block_tokens, MOONCAKE_BLOCK_TOKENS))
    sessions: list[Session] = []
    with _open_text(find_trace_file(path)) as f:
        for i, line in enumerate(f):
            if max_requests is not None and i >= max_requests:
                break
            row = json.loads(line)
            rid = f"mc-{i}"
            req = TraceRequest(
                request_id=rid,
                session_id=rid,
                arrival_s=row["timestamp"] / 1000.0,
                gap_s=0.0,
                num_prompt_tokens=int(row["input_length"]),
                num_output_tokens=max(1, int(row["output_length"])),
                block_hashes=hasher.hashes(
                    row["hash_ids"], int(row["input_length"]) // MOONCAKE_BLOCK_TOKENS, 0
                ),
            )
            sessions.append(Session(session_id=rid, requests=(req,)))
    return Trace(
        name="mooncake", closed_loop=False, block_tokens=block_tokens, sessions=tuple(sessions), hasher=hasher
    )


def load_azure(
    path: Path,
    *,
    block_tokens: int = 512,
    max_requests: int | None = None,
    copies: int = 1,
    seed: int = 0,
) -> Trace:
    """The first `max_requests` requests of the Azure conversation trace (arrival order), one session each;
    arrival times from the first request's.

    `copies` > 1 raises the rate without compressing the clock (which would compress the hour's seasons
    too): the trace plays `copies` times at once, each copy but the first shifted by its own seeded offset
    within a minute (the timescale of an autoscaler's decisions, so the minutes' rates are kept)."""
    rng = random.Random(seed)
    shifts = [0.0] + [rng.uniform(0.0, 60.0) for _ in range(copies - 1)]
    hasher = BlockHasher(block_tokens, 1)
    sessions: list[Session] = []
    start: datetime | None = None
    with _open_text(find_trace_file(path)) as f:
        for i, row in enumerate(csv.DictReader(f)):
            if max_requests is not None and i >= max_requests:
                break
            at = datetime.fromisoformat(row["TIMESTAMP"][:26])  # the file gives 100 ns, Python takes 1 us
            start = start or at
            prompt = int(row["ContextTokens"])
            blocks = prompt // block_tokens
            for copy, shift in enumerate(shifts):
                rid = f"az-{i}" if copy == 0 else f"az-{i}.{copy}"
                req = TraceRequest(
                    request_id=rid,
                    session_id=rid,
                    arrival_s=(at - start).total_seconds() + shift,
                    gap_s=0.0,
                    num_prompt_tokens=prompt,
                    num_output_tokens=max(1, int(row["GeneratedTokens"])),
                    # No prefix information: blocks of the request's own namespace, never shared.
                    block_hashes=hasher.hashes(list(range(blocks)), blocks, len(sessions) + 1),
                )
                sessions.append(Session(session_id=rid, requests=(req,)))
    return Trace(
        name="azure", closed_loop=False, block_tokens=block_tokens, sessions=tuple(sessions), hasher=hasher
    )


def _session_from_claude_code(doc: dict, session_id: str, hasher: BlockHasher) -> Session:
    if doc.get("block_size", CLAUDE_CODE_BLOCK_TOKENS) != CLAUDE_CODE_BLOCK_TOKENS:
        raise ValueError(f"{session_id}: block_size {doc.get('block_size')} != {CLAUDE_CODE_BLOCK_TOKENS}")
    namespace = zlib.crc32(session_id.encode())
    out: list[TraceRequest] = []
    prev: dict | None = None
    for row in doc["requests"]:
        if row.get("type") == "subagent":
            continue
        if "think_time" in row:
            gap = float(row["think_time"])
        elif prev is not None and "api_time" in prev:
            # A few rows lack think_time: recover it from the recorded clock.
            gap = max(0.0, float(row["t"]) - float(prev["t"]) - float(prev["api_time"]))
        else:
            gap = 0.0
        n = len(out)
        out.append(
            TraceRequest(
                request_id=f"{session_id}/{n}",
                session_id=session_id,
                arrival_s=float(row["t"]),
                gap_s=0.0 if n == 0 else gap,
                num_prompt_tokens=int(row["in"]),
                num_output_tokens=max(1, int(row["out"])),
                block_hashes=hasher.hashes(
                    row["hash_ids"], int(row["in"]) // CLAUDE_CODE_BLOCK_TOKENS, namespace
                ),
            )
        )
        prev = row
    return Session(session_id=session_id, requests=tuple(out))


def load_claude_code(
    sessions_dir: Path,
    *,
    block_tokens: int = 512,
    max_sessions: int | None = None,
    seed: int | None = None,
) -> Trace:
    """Claude Code sessions: all, the first `max_sessions` by file name, or (with `seed`) a seeded sample."""
    hasher = BlockHasher(block_tokens, _group(block_tokens, CLAUDE_CODE_BLOCK_TOKENS))
    by_name: dict[str, Path] = {}
    for f in sessions_dir.glob("*.json*"):
        stem = f.name.removesuffix(f.suffix) if f.suffix in (".gz", ".xz") else f.name
        if stem.endswith(".json"):
            by_name.setdefault(stem.removesuffix(".json"), f)
    files = [by_name[k] for k in sorted(by_name)]
    if not files:
        raise FileNotFoundError(f"no sessions (*.json, *.json.gz, *.json.xz) in {sessions_dir}")
    if max_sessions is not None and max_sessions < len(files):
        files = (
            sorted(random.Random(seed).sample(files, max_sessions))
            if seed is not None
            else files[:max_sessions]
        )
    sessions = []
    for f in files:
        with _open_text(f) as fh:
            doc = json.load(fh)
        s = _session_from_claude_code(doc, f.name.split(".json")[0], hasher)
        if s.requests:
            sessions.append(s)
    return Trace(
        name="claude-code",
        closed_loop=True,
        block_tokens=block_tokens,
        sessions=tuple(sessions),
        hasher=hasher,
    )


def load_trace(
    name: TraceName,
    traces_dir: Path = DEFAULT_TRACES_DIR,
    *,
    block_tokens: int = 512,
    limit: int | None = None,
    seed: int | None = None,
) -> Trace:
    """`limit`: sessions (Claude Code) or requests (Mooncake, Azure)."""
    if name == "mooncake":
        return load_mooncake(
            traces_dir / MOONCAKE_FILE,
            block_tokens=block_tokens,
            max_requests=limit,
        )
    if name == "azure":
        return load_azure(traces_dir / AZURE_FILE, block_tokens=block_tokens, max_requests=limit)
    return load_claude_code(
        traces_dir / CLAUDE_CODE_SESSIONS, block_tokens=block_tokens, max_sessions=limit, seed=seed
    )


def infinite_cache_hit_ratio(trace: Trace) -> float:
    """The bound: block hit ratio of one unbounded cache that sees the slice in replay order.

    Claude Code identity is per session (namespaced) and each session's turns are sequential, so the order of
    sessions does not matter; Mooncake replays in arrival order.
    """
    seen: set[int] = set()
    hits = total = 0
    reqs = list(trace.requests())
    if not trace.closed_loop:
        reqs.sort(key=lambda r: r.arrival_s)
    for r in reqs:
        for h in r.block_hashes:
            hits += h in seen
            seen.add(h)
        total += len(r.block_hashes)
    return hits / total if total else 0.0
