"""Incremental tokenization of a session's growing chat prompt.

An agent re-sends its whole conversation every turn, and tokenizing all of it again costs time linear in the
context, paid before every tool call's first token (docs/benchmarks.md, "The router's own costs"). A turn's
rendered prompt almost always extends the previous turn's text (the reply and the tool result are appended),
so `SessionChatEncoder` encodes only the text from the last added token inside the shared part on, and reuses
the previous turn's ids before it. Those ids are the previous turn's own int objects, which also makes the
router's next-turn prefix check (`router.block_hash.SessionHasher`) an identity comparison.

Why it is exact. A Hugging Face tokenizer first splits the raw text at its added tokens (`<|im_start|>`
and the like) and then normalizes, pre-tokenizes and merges each piece between them on its own. If both
turns share text[:L] and an added token occupies text[c:e] with e <= L, the pieces before c are the same in
both, so the ids before that token are the same, and the ids from c on are the encoding of text[c:]. That
argument needs added tokens that match the raw text exactly: none may strip neighbouring whitespace
(lstrip/rstrip), be matched after normalization, be required to stand as a whole word, or contain another;
and special tokens must be split out (`split_special_tokens` off). `incremental_unsupported` checks this
when the router starts; a tokenizer that fails is encoded in full every turn, and the router says why in its
log.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable
from typing import Any

from router.intake.tokenizer import PromptTokenizer
from router.messages import PromptReuse
from router.sessions import Part, Sessions

log = logging.getLogger(__name__)


def incremental_unsupported(hf_tokenizer: Any) -> str | None:
    """Why incremental encoding would not be exact for this Hugging Face tokenizer, or None."""
    if getattr(hf_tokenizer, "split_special_tokens", False):
        return "split_special_tokens is on (special tokens are encoded as text)"
    added = dict(getattr(hf_tokenizer, "added_tokens_decoder", {}) or {})
    contents = [str(t.content) for t in added.values()]
    for token in added.values():
        for flag in ("lstrip", "rstrip", "single_word", "normalized"):
            if getattr(token, flag, False):
                return f"added token {token.content!r} has {flag}=True"
    for a in contents:
        if not a:
            return "an added token is empty"
        for b in contents:
            if a != b and a in b:
                return f"added token {a!r} is part of added token {b!r}"
    return None


class _Entry:
    __slots__ = ("ends", "ids", "reused", "starts", "text", "token_at")

    def __init__(self, text: str, ids: list[int], reused: int = 0) -> None:
        self.text = text
        self.ids = ids
        self.reused = reused  # leading ids copied from the previous turn's entry
        # Each added token's occurrence: its char span [starts[k], ends[k]) and its index in `ids`.
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.token_at: list[int] = []


CHAT = Part[_Entry]("chat", lambda e: len(e.ids))


class SessionChatEncoder:
    """Chat prompts to token ids, per session incrementally (see the module docstring).

    Thread-safe: called through `asyncio.to_thread` by concurrent requests. Each session's rendered turn is
    kept in `sessions` (router/sessions.py, which bounds them)."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        sessions: Sessions | None = None,
        on_encoded: Callable[[int, int], None] | None = None,
    ) -> None:
        """`on_encoded(reused, encoded)` is told, per prompt, how many ids came from the previous turn and
        how many were encoded (metrics). `sessions`: the router's (default: one of its own)."""
        self._tok = tokenizer
        self.unsupported = incremental_unsupported(tokenizer.hf_tokenizer)
        if self.unsupported is not None:
            log.warning(
                "incremental chat tokenization off (every turn encoded in full): %s", self.unsupported
            )
        added = dict(getattr(tokenizer.hf_tokenizer, "added_tokens_decoder", {}) or {})
        self._added: dict[int, str] = {int(i): str(t.content) for i, t in added.items()}
        self._sessions = sessions if sessions is not None else Sessions.default()
        self._lock = threading.Lock()  # guards the totals
        self._on_encoded = on_encoded
        # Totals: token ids taken from previous turns, and ids encoded.
        self.reused_tokens = 0
        self.encoded_tokens = 0

    def encode(
        self,
        session_id: str | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat (equal to `PromptTokenizer.encode_chat`).

        The returned list is kept for the session's next turn: callers must not mutate it."""
        return self.encode_reusing(session_id, messages, tools, template_kwargs)[0]

    def encode_reusing(
        self,
        session_id: str | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], PromptReuse | None]:
        """`encode`, and which of the ids were copied from the session's previous prompt (for the router's
        block hasher, which then need not compare them). Template variables change the text, so a turn that
        changes them reuses only what still renders the same."""
        return self.encode_rendered_reusing(
            session_id, self._tok.render_chat(messages, tools, template_kwargs)
        )

    def encode_rendered_reusing(
        self, session_id: str | None, text: str
    ) -> tuple[list[int], PromptReuse | None]:
        """`encode_reusing` of a chat the caller rendered (`PromptTokenizer.render_chat`)."""
        if session_id is None or self.unsupported is not None:
            ids = self._tok.encode_rendered(text)
            self._count(0, len(ids))
            return ids, None
        prev = self._sessions.get(session_id, CHAT)
        entry = self._extend(prev, text) if prev is not None else None
        reuse = None
        if entry is None:
            entry = _Entry(text, self._tok.encode_rendered(text))
            self._mark(entry, 0, 0)
            self._count(0, len(entry.ids))
        elif prev is not None:
            reuse = PromptReuse(prev.ids, entry.reused)
        self._remember(session_id, entry)
        return entry.ids, reuse

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, CHAT)

    def _extend(self, prev: _Entry, text: str) -> _Entry | None:
        """The new turn's entry, re-encoding from the last added token inside the shared text; None when
        no added token lies inside it."""
        shared = _common_prefix_len(prev.text, text)
        # The last added token that starts inside the shared text and ends inside it too.
        k = bisect.bisect_right(prev.starts, shared) - 1
        while k >= 0 and prev.ends[k] > shared:
            k -= 1
        if k < 0:
            return None
        cut, at = prev.starts[k], prev.token_at[k]
        tail = self._tok.encode_rendered(text[cut:])
        entry = _Entry(text, prev.ids[:at] + tail, at)
        entry.starts = prev.starts[:k]
        entry.ends = prev.ends[:k]
        entry.token_at = prev.token_at[:k]
        self._mark(entry, cut, at)
        self._count(at, len(tail))
        return entry

    def _count(self, reused: int, encoded: int) -> None:
        with self._lock:
            self.reused_tokens += reused
            self.encoded_tokens += encoded
        if self._on_encoded is not None:
            self._on_encoded(reused, encoded)

    def _mark(self, entry: _Entry, char_from: int, token_from: int) -> None:
        """Record where each added token of entry.ids[token_from:] sits in entry.text (from char_from).

        Added tokens are matched on the raw text left to right, so the k-th added id is the k-th
        occurrence of an added token's text. If the text and ids ever disagree, the marks stop there: a
        missing mark only costs reuse, never exactness."""
        added = self._added
        text, ids = entry.text, entry.ids
        cursor = char_from
        for j in range(token_from, len(ids)):
            content = added.get(ids[j])
            if content is None:
                continue
            pos = text.find(content, cursor)
            if pos < 0:
                return
            entry.starts.append(pos)
            entry.ends.append(pos + len(content))
            entry.token_at.append(j)
            cursor = pos + len(content)

    def _remember(self, session_id: str, entry: _Entry) -> None:
        self._sessions.put(session_id, CHAT, entry)


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings, by C-level slice comparisons."""
    if b.startswith(a):
        return len(a)  # the usual next turn: the previous text extended
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; a[:hi+1] != b[:hi+1] beyond the shorter
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
