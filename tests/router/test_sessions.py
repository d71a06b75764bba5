"""The router's session state: one entry per session holding every part's value, one LRU order and one
bound (sessions and tokens held) for all of them."""

from __future__ import annotations

import threading

import pytest

from router.config import RouterConfig
from router.sessions import Part, Sessions

CHAT = Part[str]("chat", len)
PIN = Part[list[int]]("pin", len)
PLACE = Part[str]("place")


def test_every_part_of_a_session_lives_and_goes_together() -> None:
    s = Sessions(max_sessions=2, max_tokens=100)
    s.put("a", CHAT, "xxx")
    s.put("a", PLACE, "d0")
    s.put("b", CHAT, "yyy")
    s.put("a", PIN, [1, 2])  # any part's use makes the session the most recent
    s.put("c", CHAT, "zzz")  # three sessions > 2: b goes, not a
    assert (s.get("a", CHAT), s.get("a", PLACE), s.get("a", PIN)) == ("xxx", "d0", [1, 2])
    assert "b" not in s and s.get("c", CHAT) == "zzz"
    assert s.tokens == 3 + 2 + 3


def test_the_token_bound_counts_every_part_and_evicts_whole_sessions() -> None:
    s = Sessions(max_sessions=10, max_tokens=10)
    s.put("a", CHAT, "xxxx")
    s.put("a", PIN, [0] * 4)
    s.put("b", CHAT, "yyyy")  # 12 > 10: a goes whole
    assert "a" not in s and s.tokens == 4
    s.put("b", CHAT, "y" * 11)  # alone larger than the bound: not kept, its old value gone too
    assert s.get("b", CHAT) is None and s.tokens == 0
    s.put("b", PLACE, "d1")
    assert s.pop("b", PLACE) == "d1" and s.pop("b", PLACE) is None
    s.forget("b")
    assert len(s) == 0


def test_new_bounds_apply_at_once_least_recent_first() -> None:
    s = Sessions.of(RouterConfig())
    assert (s.max_sessions, s.max_tokens) == (100_000, 32_000_000)
    for sid in "abcd":
        s.put(sid, CHAT, "xx")
    s.resize(max_sessions=2, max_tokens=100)
    assert [sid for sid in "abcd" if sid in s] == ["c", "d"]
    with pytest.raises(ValueError, match="positive"):
        Sessions(max_sessions=0, max_tokens=1)


def test_parts_written_from_threads_keep_the_accounting_exact() -> None:
    s = Sessions(max_sessions=50, max_tokens=1_000)

    def writer(k: int) -> None:
        for i in range(2_000):
            s.put(f"s{(i * 7 + k) % 80}", CHAT, "x" * (i % 20))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = sum(len(v) for sid in list(s._states) if (v := s.get(sid, CHAT)) is not None)
    assert s.tokens == held <= 1_000 and len(s) <= 50
