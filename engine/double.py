"""A TEST DOUBLE of the engine host: the interface and messages of the role engines
(prefill/engine.py, decode/engine.py, on engine.host.EngineHost), no vLLM.

Selected by `model.engine: double` in the topology. It exists so that cluster tests (scaling, rolling
updates, replica and node failures on a fake multi-node Ray cluster) run real Serve deployments, the real
registry and the real router in seconds on a small CPU machine. It is never used for serving, nor by tests
that claim real serving: those run vLLM (tests/e2e).

What it models, and what not:
- Tokens are deterministic and autoregressive, as greedy decoding is: each token is a hash of the whole
  sequence before it (prompt and tokens so far), so the same prompt gives the same tokens on any replica,
  with or without a prefill leg, and a continuation of prompt + first k tokens gives the rest. It never
  stops early (no EOS, stop strings are ignored): every completion finishes by length. Its text is a
  placeholder (" t<id>").
- Time: prefill takes `prefill_s_per_token` per uncached prompt token, decode `decode_s_per_token` per
  generated token, so streams take real time and drain/roll tests see requests in flight.
- Load: at most `max_num_seqs` (from the engine args, as vLLM) run at once, the rest wait; KV usage counts
  the blocks of running requests against a fixed capacity.
- Prefix cache: full prompt blocks are remembered (LRU, the same capacity), so repeated prefixes count as
  local cache hits. No KV events are published (the router's KV index learns nothing from a double).
- KV transfer: the prefill leg returns NixlConnector-shaped `kv_transfer_params`; a decode leg given them
  skips prefill time and counts the prompt as transferred. No bytes move.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.messages import EngineRequest, EngineStats, PrefillResult, ReplicaInfo, TokenBatch
from engine.spec import EngineSpec

# The built-in tiny model's vocabulary; ids 0-2 are its special tokens, which a double never emits.
VOCAB_SIZE = 2048
_FIRST_ORDINARY_TOKEN = 3
_DEFAULT_MAX_NUM_SEQS = 256
_ROOT = 0x646F75626C65  # any constant: the hash chains' start


@dataclass(frozen=True)
class DoubleTiming:
    prefill_s_per_token: float = 20e-6
    decode_s_per_token: float = 0.02
    kv_capacity_blocks: int = 4096


class _Sequence:
    """A sequence's running hash: the next token is a function of every id so far, and nothing else.

    CPython's hash of a tuple of ints does not depend on PYTHONHASHSEED, so every replica computes the same
    tokens; it is chained one id at a time, so a prompt extended by k tokens continues as the k-th state."""

    def __init__(self, token_ids: list[int]) -> None:
        self._state = _ROOT
        self.extend(token_ids)

    def extend(self, token_ids: list[int]) -> None:
        state = self._state
        for t in token_ids:
            state = hash((state, t))
        self._state = state

    def next_token(self) -> int:
        token = _FIRST_ORDINARY_TOKEN + self._state % (VOCAB_SIZE - _FIRST_ORDINARY_TOKEN)
        self.extend([token])
        return token


def double_tokens(prompt_token_ids: list[int], n: int) -> list[int]:
    """The first `n` tokens a double generates for this prompt (the same on every replica)."""
    seq = _Sequence(prompt_token_ids)
    return [seq.next_token() for _ in range(n)]


class _PrefixCache:
    """Which full prompt blocks this engine holds, keyed by the hash of the prefix up to each block."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self._block_size = block_size
        self._capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _keys(self, prompt: list[int]) -> list[int]:
        keys, running, bs = [], _ROOT, self._block_size
        for end in range(bs, len(prompt) + 1, bs):
            running = hash((running, *prompt[end - bs : end]))
            keys.append(running)
        return keys

    def lookup_and_insert(self, prompt: list[int]) -> int:
        """Prompt tokens already cached (a prefix of whole blocks); then cache all of its full blocks."""
        keys = self._keys(prompt)
        hits = 0
        for key in keys:
            if key not in self._blocks:
                break
            hits += 1
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)
        return hits * self._block_size


class DoubleEngineHost:
    """Test double of the prefill and decode engines (see the module docstring)."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        replica_id: str,
        node_id: str,
        node_ip: str,
        timing: DoubleTiming | None = None,
    ) -> None:
        self.spec = spec
        self.replica_id = replica_id
        self.node_id = node_id
        self.node_ip = node_ip
        self.timing = timing or DoubleTiming()
        self._max_num_seqs = int(spec.engine_args.get("max_num_seqs") or _DEFAULT_MAX_NUM_SEQS)
        self._started = False
        self.start_phases: dict[str, float] = {}
        self._slots: asyncio.Semaphore | None = None
        self._cache = _PrefixCache(spec.block_size, self.timing.kv_capacity_blocks)
        self._running_tokens: dict[str, int] = {}  # request id -> prompt + generated tokens so far
        self._waiting = 0
        self._aborted: set[str] = set()
        self._computed = self._cache_hits = self._external = self._transfers = self._finished = 0

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        started = time.monotonic()
        self._started = True
        self.start_phases = {"engine_other": time.monotonic() - started}

    def shutdown(self) -> None:
        self._started = False

    # ---- serving -------------------------------------------------------------------------------

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        started = time.monotonic()
        async with self._running(req.request_id, len(req.prompt_token_ids)):
            cached = await self._compute_prompt(req.prompt_token_ids)
        blocks = math.ceil(len(req.prompt_token_ids) / self.spec.block_size)
        return PrefillResult(
            request_id=req.request_id,
            replica_id=self.replica_id,
            node_id=self.node_id,
            kv_transfer_params={
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": f"{self.spec.role}-{self.replica_id}",
                "remote_block_ids": list(range(blocks)),
                "remote_host": self.node_ip,
                "remote_port": 0,
            },
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=cached,
            prefill_ms=(time.monotonic() - started) * 1e3,
        )

    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenBatch]:
        """Stream tokens in batches as DecodeEngine does: the first at once, then by count or time."""
        prompt = req.prompt_token_ids
        max_batch, max_wait = (1, 0.0) if req.stream is None else (req.stream.tokens, req.stream.ms / 1e3)
        async with self._running(req.request_id, len(prompt)):
            if req.kv_transfer_params:
                self._external += len(prompt)
                self._transfers += 1
                cached = len(prompt)
            else:
                cached = await self._compute_prompt(prompt)
            ids: list[int] = []
            seq = _Sequence(prompt)
            batch_started = step_at = time.monotonic()
            for position in range(req.sampling.max_tokens):
                if req.request_id in self._aborted:
                    self._aborted.discard(req.request_id)
                    yield self._last_batch(ids, "abort", len(prompt), cached)
                    return
                if position:  # the first token comes with the prompt's forward pass
                    # Steps keep the engine's cadence: a token the replica's event loop delayed does not
                    # push back the ones after it (an engine core steps in a process of its own).
                    step_at += self.timing.decode_s_per_token
                    await asyncio.sleep(max(0.0, step_at - time.monotonic()))
                if not ids:
                    batch_started = time.monotonic()
                ids.append(seq.next_token())
                self._running_tokens[req.request_id] += 1
                if position == req.sampling.max_tokens - 1:
                    break
                if position == 0 or len(ids) >= max_batch or time.monotonic() - batch_started >= max_wait:
                    yield TokenBatch(token_ids=ids, text=_text(ids), replica_id=self.replica_id)
                    ids = []
            self._finished += 1
            yield self._last_batch(ids, "length", len(prompt), cached)

    async def export(self, req: EngineRequest) -> dict[str, Any] | None:
        """As DecodeEngine.export: NixlConnector-shaped pin parameters (nothing is pinned or pulled here)."""
        if self.spec.kv_readback_ttl_s <= 0:
            return None
        prompt = req.prompt_token_ids
        async with self._running(req.request_id, len(prompt)):
            await self._compute_prompt(prompt)
        return {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_engine_id": f"{self.spec.role}-{self.replica_id}",
            "remote_request_id": req.request_id,
            "remote_block_ids": list(range(math.ceil(len(prompt) / self.spec.block_size))),
            "remote_host": self.node_ip,
            "remote_port": 0,
            "remote_num_tokens": len(prompt),
        }

    async def release(self, kv_transfer_params: dict[str, Any]) -> bool:
        """The double's prefill keeps no KV for a decode to pull: there is nothing to free."""
        return False

    async def abort(self, request_id: str) -> None:
        if request_id in self._running_tokens:
            self._aborted.add(request_id)

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        block = self.spec.block_size
        used = sum(math.ceil(n / block) for n in self._running_tokens.values())
        stepping = bool(self._running_tokens) and self.spec.role == "decode"
        return EngineStats(
            replica_id=self.replica_id,
            role=self.spec.role,
            node_id=self.node_id,
            running=len(self._running_tokens),
            waiting=self._waiting,
            kv_cache_usage=min(1.0, used / self.timing.kv_capacity_blocks),
            prompt_tokens_computed=self._computed,
            prompt_tokens_local_cache_hit=self._cache_hits,
            prompt_tokens_external_kv=self._external,
            nixl_bytes_transferred=0,
            nixl_transfers=self._transfers,
            requests_finished=self._finished,
            step_s=self.timing.decode_s_per_token if stepping else 0.0,
        )

    def info(self, *, draining: bool = False) -> ReplicaInfo:
        return ReplicaInfo(
            replica_id=self.replica_id,
            role=self.spec.role,
            node_id=self.node_id,
            kv_events_endpoint=None,
            kv_events_replay_endpoint=None,
            nixl_host=self.node_ip,
            nixl_port=0,
            block_size=self.spec.block_size,
            ready=self._started,
            draining=draining,
            stats=self.stats(),
            start_phases=self.start_phases,
        )

    def failure(self) -> str | None:
        return None  # a double never fails by itself (cluster tests kill its replica instead)

    async def check_health(self) -> None:
        if not self._started:
            raise RuntimeError("engine not started")

    # ---- internals -----------------------------------------------------------------------------

    def _running(self, request_id: str, prompt_len: int) -> _Slot:
        if self._slots is None:  # created on the replica's event loop, at first use
            self._slots = asyncio.Semaphore(self._max_num_seqs)
        return _Slot(self, self._slots, request_id, prompt_len)

    async def _compute_prompt(self, prompt: list[int]) -> int:
        cached = self._cache.lookup_and_insert(prompt)
        self._cache_hits += cached
        self._computed += len(prompt) - cached
        await asyncio.sleep((len(prompt) - cached) * self.timing.prefill_s_per_token)
        return cached

    def _last_batch(self, ids: list[int], reason: Any, prompt_len: int, cached: int) -> TokenBatch:
        return TokenBatch(
            token_ids=ids,
            text=_text(ids),
            finish_reason=reason,
            num_prompt_tokens=prompt_len,
            num_cached_tokens=cached,
            replica_id=self.replica_id,
            node_id=self.node_id,
        )


class _Slot:
    """One of `max_num_seqs` running slots: waiting until one is free, counted as running while held."""

    def __init__(
        self, host: DoubleEngineHost, slots: asyncio.Semaphore, request_id: str, tokens: int
    ) -> None:
        self._host, self._slots, self._request_id, self._tokens = host, slots, request_id, tokens

    async def __aenter__(self) -> None:
        self._host._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._host._waiting -= 1
        self._host._running_tokens[self._request_id] = self._tokens

    async def __aexit__(self, *exc: object) -> None:
        self._host._running_tokens.pop(self._request_id, None)
        self._host._aborted.discard(self._request_id)
        self._slots.release()


def _text(ids: list[int]) -> str:
    return "".join(f" t{i}" for i in ids)
