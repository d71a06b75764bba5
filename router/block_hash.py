"""The router's own block hash chain over prompt token ids.

Block identity in pdserve is computed by the router, never taken from the engine: vLLM's default block hash
depends on the engine's hash seed and hash algorithm, so the router re-hashes the `token_ids` carried by every
`BlockStored` event with this function and hashes each incoming prompt with the same function. Only full
blocks are hashed, as in the engine's prefix cache.

Hash: block i's hash is `h_i = h_{i-1} * P + hash(tokens_of_block_i) mod 2**64`, with a fixed root before
the first block. `hash` of a tuple of ints is CPython's 64-bit xxHash-style mix, which does not depend on
PYTHONHASHSEED (only str/bytes hashing is salted), so it is stable across processes of the same CPython
build. Router hashes are only ever compared inside one router process (index and prompts hashed by the same
code), never persisted or sent over the wire, so that is all the stability needed. The blocks' own hashes
run in C (`map` over `zip`), and the chain, being linear, is a cumulative sum that numpy computes for a long
prompt at once: a 128k-token prompt hashes in about half the time of a chain of tuple hashes
`hash((h_{i-1}, *tokens))` (docs/benchmarks.md, "The router's own costs").

It is not collision-resistant against an adversary; a collision only misleads a routing decision (the engine's
own prefix cache decides what is reused), so that is an accepted risk.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from router.messages import PromptReuse
from router.sessions import Part, Sessions

# Fixed parent of every chain's first block (any constant works; this one is "pdserve" in ASCII).
ROOT_PARENT = 0x7064736572766500

_MASK = (1 << 64) - 1
# The chain's multiplier: odd, so invertible mod 2**64 (the cumulative form below divides by its powers).
_P = 0x9E3779B97F4A7C15
_P_INV = pow(_P, -1, 1 << 64)
# From this many blocks on the chain is computed with numpy (below it, a Python loop is cheaper).
_VECTOR_BLOCKS = 64


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Hashes of the full blocks of `token_ids`, chained from `parent` (the hash of the block before the first
    one, or None when `token_ids` starts the prompt). A trailing partial block is ignored."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if isinstance(token_ids, np.ndarray):
        token_ids = token_ids.tolist()  # tuple-hash plain ints (the same values, faster than numpy scalars)
    elif not isinstance(token_ids, list | tuple):
        token_ids = list(token_ids)
    h = ROOT_PARENT if parent is None else parent
    n = len(token_ids) // block_size
    # zip drops the trailing partial block.
    own = map(hash, zip(*[iter(token_ids)] * block_size, strict=False))
    if n < _VECTOR_BLOCKS:
        out: list[int] = []
        append = out.append
        for b in own:
            h = (h * _P + b) & _MASK
            append(h)
        return out
    # h_j = P^j * (h * P + sum_{l <= j} b_l * P^-l), all mod 2**64 (uint64 arithmetic wraps).
    own_hashes = np.fromiter(own, dtype=np.int64, count=n).view(np.uint64)
    acc = np.cumsum(own_hashes * _powers(_P_INV, n), dtype=np.uint64)
    acc += np.uint64(h * _P & _MASK)
    chained: list[int] = (acc * _powers(_P, n)).tolist()
    return chained


def _powers(base: int, n: int) -> np.ndarray:
    """base**0 .. base**(n-1) mod 2**64."""
    a = np.full(n, base, dtype=np.uint64)
    a[0] = 1
    return np.cumprod(a, dtype=np.uint64)


def _shares_int_objects(a: list[int], b: list[int]) -> bool:
    """Whether two equal-length token lists look like they hold the same int objects, judged at the first id
    above 256 from the middle on (CPython caches ints up to 256, so a small id's identity says nothing). The
    middle, not the end: an incrementally tokenized turn re-encodes the last few ids of the previous one."""
    start = len(b) // 2
    for i in range(start, min(start + 64, len(b))):
        if b[i] > 256:
            return a[i] is b[i]
    return True


def _equal_blocks_from(prev: list[int], token_ids: list[int], start: int, stop: int, bs: int) -> int:
    """The first block index in start..stop whose tokens differ between the two lists (stop if none)."""
    while start < stop and token_ids[start * bs : (start + 1) * bs] == prev[start * bs : (start + 1) * bs]:
        start += 1
    return start


class _SessionEntry:
    __slots__ = ("digest", "digest_wanted", "hashes", "n_full", "tokens")

    def __init__(self, tokens: list[int], n_full: int, hashes: list[int], digest_wanted: bool) -> None:
        self.tokens = tokens  # the previous turn's prompt; its first `n_full` tokens fill whole blocks
        self.n_full = n_full
        self.hashes = hashes
        # Whether `seal` computes a digest. Not when this turn's ids were the previous turn's int objects
        # (the incremental chat encoder's: the next check is an identity compare), nor when intake hashed
        # the prompt (the next turn comes hashed too or with a reuse hint; a short token-id turn that does
        # neither compares the lists, as before a turn is sealed).
        self.digest_wanted = digest_wanted
        # hash(tuple(tokens)), computed by `SessionHasher.seal` once the turn's decision is made.
        self.digest: int | None = None


HASHED = Part[_SessionEntry]("hashed_prompt", lambda e: e.n_full)


class SessionHasher:
    """Hashes prompts, reusing the previous turn's hashes for the part of a session's prompt that is
    unchanged.

    An agent turn's prompt is usually the previous turn's prompt plus new messages, so the next turn hashes
    only its new blocks. The previous prompt is checked against the start of the new one, and hashing
    restarts at the first block that differs, so an edited history (e.g. context compaction or a re-rendered
    last message) is handled correctly.

    The check. A re-tokenized prompt is a list of new int objects, and comparing 8k of them element by
    element costs ~110 us, more than half of a next turn's decision budget. Hashing them as one tuple costs
    about half that, so once a turn is routed `seal` stores the digest `hash(tuple(prompt))`, off the
    decision path, and the next turn compares `hash(tuple(new[:len(prev)]))` with it. That is the same
    64-bit CPython tuple hash the block chain itself is made of, so it adds no new way to be wrong: a
    collision misleads one routing decision, never what the engine computes. Without a digest (not sealed
    yet) the lists are compared directly.

    Each session's hashed prompt is kept in the router's `Sessions` (router/sessions.py, which bounds them).
    One per event loop.
    """

    # Width of the coarse scan that locates the first differing block when the fast whole-prefix check fails.
    _SCAN_CHUNK_BLOCKS = 64

    def __init__(self, block_size: int, sessions: Sessions | None = None) -> None:
        """`sessions`: the router's (default: one of its own)."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._sessions = sessions if sessions is not None else Sessions.default()
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def hash(
        self,
        session_id: str | None,
        token_ids: Sequence[int],
        reuse_hint: PromptReuse | None = None,
        hashed: list[int] | None = None,
    ) -> list[int]:
        """Block hashes of `token_ids` (same result as `hash_blocks(token_ids, block_size)`).

        With a session, `token_ids` (when a list) is kept by reference for the next turn's comparison:
        the caller must not mutate it afterwards (a prompt's token list never is). `reuse_hint`, when its
        base is the session's previous prompt, vouches for the shared head and replaces the comparison.
        `hashed`: `hash_blocks(token_ids, block_size)`, computed by the caller (intake, in the thread that
        tokenized the prompt); it is taken as given, and the session keeps that very list (later turns
        extend it in place). The returned list is the caller's own."""
        if not isinstance(token_ids, list):
            token_ids = list(token_ids)
        bs = self.block_size
        n_full = len(token_ids) // bs * bs
        if hashed is not None:
            if len(hashed) != n_full // bs:
                raise ValueError(f"{len(hashed)} block hashes for {n_full // bs} full blocks")
            self.hashed_blocks += len(hashed)
            if session_id is None:
                return hashed
            self._sessions.put(session_id, HASHED, _SessionEntry(token_ids, n_full, hashed, False))
            return hashed.copy()
        entry = None if session_id is None else self._sessions.get(session_id, HASHED)
        if entry is None:
            reuse, shared = 0, False
        elif reuse_hint is not None and reuse_hint.base is entry.tokens:
            # The builder copied these ids from the previous prompt: exact without a comparison. It
            # re-encodes the last few, so the blocks they fall in are compared rather than re-hashed: the
            # session's list is then extended in place instead of copied (a 128k context's is 8k hashes).
            both = min(entry.n_full, n_full) // bs
            reuse = _equal_blocks_from(entry.tokens, token_ids, min(reuse_hint.tokens // bs, both), both, bs)
            shared = True
        else:
            reuse, shared = self._reusable_blocks(entry, token_ids, n_full)
        if reuse:
            assert entry is not None
            new = hash_blocks(token_ids[reuse * bs : n_full], bs, parent=entry.hashes[reuse - 1])
            if reuse == len(entry.hashes):
                own = entry.hashes  # the usual next turn: extend the session's own list in place
                own += new
            else:
                own = entry.hashes[:reuse] + new
        else:
            own = hash_blocks(token_ids, bs)
        self.reused_blocks += reuse
        self.hashed_blocks += len(own) - reuse
        if session_id is None:
            return own
        # The session keeps its own list of the hashes (the caller may mutate what it gets back), and the
        # tokens by reference (a copy of a long prompt would cost as much as the comparison).
        self._sessions.put(session_id, HASHED, _SessionEntry(token_ids, n_full, own, not shared))
        return own.copy()

    def seal(self, session_id: str | None) -> None:
        """Store the digest of the session's latest prompt for the next turn's check. Call it after the
        turn's routing decision (its cost, about that of hashing the prompt as one tuple, is off the
        decision's path). Skipped where the next turn's check will not need it (`_SessionEntry`)."""
        entry = None if session_id is None else self._sessions.get(session_id, HASHED)
        if entry is not None and entry.digest is None and entry.digest_wanted:
            entry.digest = hash(tuple(entry.tokens))

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, HASHED)

    def _reusable_blocks(self, entry: _SessionEntry, token_ids: list[int], n_full: int) -> tuple[int, bool]:
        """Number of leading full blocks shared with the cached turn, and whether the new prompt holds the
        cached turn's int objects."""
        bs = self.block_size
        n_prev = min(entry.n_full, n_full)
        prev = entry.tokens
        if prev is token_ids:
            return n_prev // bs, True
        # The usual next turn extends the whole previous prompt.
        if len(prev) <= len(token_ids):
            head = token_ids[: len(prev)]
            # Comparing lists is cheap when they share their int objects (a caller that extends the previous
            # turn's list); a re-tokenized prompt does not, and then the digest is the cheaper check.
            shared = _shares_int_objects(head, prev)
            same = head == prev if shared or entry.digest is None else hash(tuple(head)) == entry.digest
            if same:
                return n_prev // bs, shared
        if token_ids[:n_prev] == prev[:n_prev]:
            return n_prev // bs, False
        # Coarse scan by chunks of blocks, then block by block inside the first differing chunk.
        chunk = self._SCAN_CHUNK_BLOCKS * bs
        start = 0
        while start + chunk <= n_prev and token_ids[start : start + chunk] == prev[start : start + chunk]:
            start += chunk
        return _equal_blocks_from(prev, token_ids, start // bs, n_prev // bs, bs), False
