"""KV readback: a session's next prefill pulls the prefix its previous decode replica still holds.

With `pools.kv_readback_ttl_s` > 0 every decode engine keeps a finished request's KV blocks pinned for that
long (vLLM's bidirectional NIXL transfer) and says where (`pinned_kv`). This table keeps, per session, the
latest such pin and the token ids its blocks hold (that turn's prompt + generated ids). For the session's
next turn it offers the policy what a prefill replica could pull instead of computing (`Readback`), and
hands the prefill leg the parameters that pull it.

Exports (`router.kv_readback_exports`): the policy may instead pick a prefix that any decode replica holds in
its prefix cache (not pinned: a session's evicted pin, another session's shared prefix, a request without a
session). The orchestrator then has that replica pin it first (a one-token request, `DecodeEngine.export`),
and `cut_pinned` cuts what it returns to the prefix the policy counted on.

`KvPulls` is all the decider (router/decision/decider.py) sees of it: what a request may pull, for the policy,
and once the policy chose, what the legs must do (`Route`'s readback and export fields). With readback off
there is no `KvPulls` and the request path runs none of this.

Safety, because a NIXL read copies whatever the named blocks hold:
- the pull is cut to the blocks whose tokens equal the new prompt's (a client may edit its history), to
  full blocks, and short of the prompt's last token (the prefill engine computes at least that one);
- a pin is handed out once (`take`): the read unpins it, and the engine may then reuse those blocks;
- the engine's own expiry stays in the parameters, so a prefill engine declines a read that comes too late
  (and computes the prompt instead); the router stops offering a pin `expiry_margin_s` before its TTL.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from router.config import LiveConfig
from router.messages import Decision, PromptReuse, Readback, ReplicaView
from router.sessions import Part, Sessions

# Compared in slices this long: list equality runs in C, a Python loop per token would not.
_CHUNK = 4096


class _Pin(msgspec.Struct):
    decode_replica: str
    params: dict[str, Any]
    # The token ids the pinned blocks hold, in order (the turn's prompt, then its generated ids).
    prompt: list[int]
    output: list[int]
    expires_at: float


class Offer(msgspec.Struct, frozen=True):
    readback: Readback
    # The engine parameters that pull exactly `readback.tokens` tokens (block list and count cut to them).
    params: dict[str, Any]


def common_prefix_len(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of `a` and `b`, whose first `start` ids are known to be equal."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n:
        j = min(i + _CHUNK, n)
        if a[i:j] == b[i:j]:
            i = j
            continue
        while a[i] == b[i]:
            i += 1
        return i
    return n


PIN = Part[_Pin]("readback_pin", lambda p: len(p.prompt) + len(p.output))


class ReadbackTable:
    def __init__(
        self,
        *,
        block_size: int,
        ttl_s: float,
        expiry_margin_s: float = 10.0,
        sessions: Sessions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`sessions`: the router's, where each session's latest pin is kept (default: one of its own)."""
        if block_size <= 0 or ttl_s <= 0:
            raise ValueError("block_size and ttl_s must be positive")
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.expiry_margin_s = expiry_margin_s
        self._clock = clock
        self._sessions = sessions if sessions is not None else Sessions.default()

    def record(
        self,
        session_id: str,
        decode_replica: str,
        params: dict[str, Any] | None,
        prompt: list[int],
        output: list[int],
    ) -> None:
        """The session's turn finished on `decode_replica`, which pinned its blocks (`params`; None: it did
        not, and the session has nothing to read back)."""
        blocks = block_id_groups(params)
        if params is None or not blocks:
            self._sessions.pop(session_id, PIN)
            return
        # The engine's TTL started when it finished the request, just before this call.
        expires_at = self._clock() + self.ttl_s - self.expiry_margin_s
        params = {**params, "remote_block_ids": blocks}
        self._sessions.put(session_id, PIN, _Pin(decode_replica, params, prompt, output, expires_at))

    def offer(
        self, session_id: str | None, prompt: list[int], reuse: PromptReuse | None = None
    ) -> Offer | None:
        """What the session's pinned blocks hold of `prompt`'s prefix, if anything still pinned. `reuse`: the
        ids `prompt` copied from the session's previous prompt (not compared again)."""
        if session_id is None:
            return None
        pin = self._sessions.get(session_id, PIN)
        if pin is None:
            return None
        left = pin.expires_at - self._clock()
        if left <= 0:
            self._sessions.pop(session_id, PIN)
            return None
        known = reuse.tokens if reuse is not None and reuse.base is pin.prompt else 0
        shared = common_prefix_len(pin.prompt, prompt, known)
        if shared == len(pin.prompt):
            shared += common_prefix_len(pin.output, prompt[shared : shared + len(pin.output)])
        params = cut_pinned(pin.params, min(shared, len(prompt) - 1), self.block_size)
        if params is None:
            return None
        return Offer(Readback(pin.decode_replica, params["remote_num_tokens"], expires_in_s=left), params)

    def take(self, session_id: str) -> None:
        """The pin was handed to a prefill leg: reading it unpins it, so it is never offered again."""
        self._sessions.pop(session_id, PIN)


class PullPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What one request's legs do about readback and exports (`router.legs.orchestrator.Route`'s fields)."""

    readback_params: dict[str, Any] | None = None
    readback_replica: str = ""
    pin_kv: bool = False
    export_replica: str = ""
    export_tokens: int = 0


class KvPulls:
    """KV readback and exports on the request path: the seam between them and the router."""

    def __init__(self, table: ReadbackTable, config: LiveConfig) -> None:
        self.table = table
        self._config = config

    @property
    def export_ttl_s(self) -> float | None:
        """How long an exported prefix is counted on (None: exports off, `router.kv_readback_exports`): the
        engines' TTL, less the margin the table keeps."""
        exports = self._config.current.kv_readback_exports
        return self.table.ttl_s - self.table.expiry_margin_s if exports else None

    def offer(self, session_id: str | None, prompt: list[int], reuse: PromptReuse | None) -> Offer | None:
        return self.table.offer(session_id, prompt, reuse)

    def plan(
        self, d: Decision, offer: Offer | None, session_id: str | None, decode: list[ReplicaView]
    ) -> PullPlan:
        """The legs' part in the policy's decision `d` (`offer`: what `offer` gave this request)."""
        pin = session_id is not None
        if d.readback_export and d.readback_replica is not None and d.prefill is not None:
            # The prefill leg starts from `predicted_cached_tokens`: its own prefix, then what it pulls. The
            # session's pin (if any) is not handed out and expires on its engine.
            return PullPlan(
                readback_replica=d.readback_replica,
                pin_kv=pin,
                export_replica=d.readback_replica,
                export_tokens=d.predicted_cached_tokens,
            )
        if offer is not None and d.prefill is not None and session_id is not None:
            self.table.take(session_id)
            source = offer.readback.replica_id
            # Handed to the prefill leg even when it holds the prefix itself: its read (or its notice that
            # it needs none) unpins the blocks on the decode engine. Not when that engine is gone: the
            # prefill engine would only wait on a dead peer before computing the prompt anyway.
            if any(v.replica_id == source and v.ready for v in decode):
                return PullPlan(readback_params=offer.params, readback_replica=source, pin_kv=pin)
        return PullPlan(pin_kv=pin)

    def turn_done(
        self,
        session_id: str | None,
        decode_replica: str,
        pinned_kv: dict[str, Any] | None,
        prompt: list[int],
        output: list[int],
    ) -> None:
        if session_id is not None:
            self.table.record(session_id, decode_replica, pinned_kv, prompt, output)


def cut_pinned(params: dict[str, Any], tokens: int, block_size: int) -> dict[str, Any] | None:
    """The parameters that pull the first `tokens` tokens (cut to full blocks) of what `params` pins (None:
    not one full block is pinned there)."""
    held = int(params.get("remote_num_tokens") or 0)
    blocks = min(tokens, held) // block_size
    groups = block_id_groups(params)
    if blocks == 0 or not groups or any(len(g) < blocks for g in groups):
        return None
    cut = [g[:blocks] for g in groups]
    return {**params, "remote_block_ids": cut, "remote_num_tokens": blocks * block_size}


def block_id_groups(params: dict[str, Any] | None) -> list[list[int]]:
    """vLLM's remote_block_ids: one list per KV cache group (flat in older versions: one group)."""
    if not params:
        return []
    ids = params.get("remote_block_ids") or []
    if ids and not isinstance(ids[0], list):
        return [list(ids)]
    return [list(g) for g in ids]
