"""Everything the router keeps about a session between its turns, in one place with one bound.

Each part of the router that remembers a session declares a `Part` (its slot and how many tokens a value
holds) and keeps its value here: the chat encoder its rendered turn (router/intake/chat_encoder.py), the
token-id intake its ids (router/intake/token_sessions.py), the block hasher its hashed prompt
(router/block_hash.py), KV readback the turn's pin (router/decision/readback.py), the routing policy its
placement (router/policy/selector.py). A
session is one entry: used by any part, it becomes the most recent; past `router.max_sessions` sessions or
`router.max_session_tokens` tokens held (all parts, all sessions), the least recently used session goes
whole, so no part keeps a session another has dropped.

Thread-safe: the chat encoder runs in worker threads, everything else on the event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from router.config import RouterConfig

T = TypeVar("T")


class Part(Generic[T]):
    """One part's slot in a session's state. `size(value)`: the tokens the value holds."""

    def __init__(self, name: str, size: Callable[[T], int] = lambda _: 0) -> None:
        self.name = name
        self.size = size

    def __repr__(self) -> str:
        return f"Part({self.name})"


class _State:
    __slots__ = ("parts", "sizes", "total")

    def __init__(self) -> None:
        self.parts: dict[Part[Any], Any] = {}
        self.sizes: dict[Part[Any], int] = {}
        self.total = 0


class Sessions:
    def __init__(self, max_sessions: int, max_tokens: int) -> None:
        if max_sessions <= 0 or max_tokens <= 0:
            raise ValueError("max_sessions and max_tokens must be positive")
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._states: OrderedDict[str, _State] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    @staticmethod
    def of(config: RouterConfig) -> Sessions:
        return Sessions(config.max_sessions, config.max_session_tokens)

    @staticmethod
    def default() -> Sessions:
        """Bounded as the router's default config says (for parts used on their own, e.g. in tests)."""
        return Sessions.of(RouterConfig())

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._states

    @property
    def tokens(self) -> int:
        return self._tokens

    def get(self, session_id: str, part: Part[T]) -> T | None:
        state = self._states.get(session_id)
        if state is None:
            return None
        value: T | None = state.parts.get(part)
        return value

    def put(self, session_id: str, part: Part[T], value: T) -> None:
        """Keep `value` as the session's `part`; the session becomes the most recent. A value that alone
        exceeds the token bound is not kept (the part's previous value goes too)."""
        size = part.size(value)
        with self._lock:
            state = self._states.get(session_id)
            if state is None:
                state = self._states[session_id] = _State()
            else:
                self._states.move_to_end(session_id)
                self._drop(state, part)
            if size <= self.max_tokens:
                state.parts[part] = value
                state.sizes[part] = size
                state.total += size
                self._tokens += size
            self._evict(keep=session_id)

    def touch(self, session_id: str) -> None:
        """The session was used (a part changed its value in place): it becomes the most recent."""
        with self._lock:
            if session_id in self._states:
                self._states.move_to_end(session_id)

    def pop(self, session_id: str, part: Part[T]) -> T | None:
        with self._lock:
            state = self._states.get(session_id)
            if state is None:
                return None
            value: T | None = state.parts.get(part)
            self._drop(state, part)
            return value

    def forget(self, session_id: str) -> None:
        with self._lock:
            state = self._states.pop(session_id, None)
            if state is not None:
                self._tokens -= state.total

    def resize(self, max_sessions: int, max_tokens: int) -> None:
        """New bounds (the router's config applied in place); sessions past them go, least recent first."""
        with self._lock:
            self.max_sessions, self.max_tokens = max_sessions, max_tokens
            self._evict(keep=None)

    def _drop(self, state: _State, part: Part[Any]) -> None:
        if part in state.parts:
            del state.parts[part]
            size = state.sizes.pop(part)
            state.total -= size
            self._tokens -= size

    def _evict(self, keep: str | None) -> None:
        while len(self._states) > self.max_sessions or self._tokens > self.max_tokens:
            session_id, state = next(iter(self._states.items()))
            if session_id == keep:  # the session just stored is too big with the others: it stays alone
                if len(self._states) == 1:
                    return
                self._states.move_to_end(session_id)
                continue
            del self._states[session_id]
            self._tokens -= state.total
