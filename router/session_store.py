"""Per-session state kept between an agent's turns, bounded in count and size.

The one store behind the router's session caches (`router.chat_encoder`, `router.token_sessions`,
`router.block_hash`): each keeps its own entries, sized in its own unit (characters, ids, tokens)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

E = TypeVar("E")


class SessionStore(Generic[E]):
    """Entries by session id. At most `max_sessions` entries whose `size`s add up to at most `max_size` are
    kept; the least recently stored are dropped first, and an entry larger than the whole budget is not kept.
    Not thread-safe: callers that share one across threads lock around it."""

    def __init__(self, max_sessions: int, max_size: int, size: Callable[[E], int]) -> None:
        self.max_sessions = max_sessions
        self.max_size = max_size
        self._size = size
        self._entries: OrderedDict[str, E] = OrderedDict()
        self._total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def __iter__(self) -> Iterator[str]:
        """Session ids, least recently stored first."""
        return iter(self._entries)

    def get(self, session_id: str) -> E | None:
        return self._entries.get(session_id)

    def put(self, session_id: str, entry: E) -> None:
        """Store the session's entry (replacing its previous one) as the most recent."""
        self.pop(session_id)
        size = self._size(entry)
        if size > self.max_size:
            return
        self._entries[session_id] = entry
        self._total += size
        while len(self._entries) > self.max_sessions or self._total > self.max_size:
            _, evicted = self._entries.popitem(last=False)
            self._total -= self._size(evicted)

    def pop(self, session_id: str) -> E | None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._total -= self._size(entry)
        return entry
