"""The bounded per-session store behind the router's session caches."""

from __future__ import annotations

from router.session_store import SessionStore


def test_least_recently_stored_sessions_go_first_past_either_bound() -> None:
    store: SessionStore[str] = SessionStore(max_sessions=2, max_size=10, size=len)
    store.put("a", "xxx")
    store.put("b", "xxx")
    store.put("a", "yyy")  # replacing makes a the most recent
    store.put("c", "zzz")  # three sessions > 2: b goes
    assert (store.get("a"), store.get("b"), store.get("c")) == ("yyy", None, "zzz")
    store.put("d", "wwwwwwww")  # 3 + 8 > 10 (and three sessions): a goes, then c
    assert (len(store), store.get("d")) == (1, "wwwwwwww")


def test_an_entry_larger_than_the_budget_is_not_kept_and_replaces_nothing_else() -> None:
    store: SessionStore[str] = SessionStore(max_sessions=5, max_size=4, size=len)
    store.put("a", "xx")
    store.put("a", "xxxxx")  # too large: the session's old entry is gone, the new one not kept
    store.put("b", "yyyy")  # the whole budget is free again
    assert (store.get("a"), store.get("b"), len(store)) == (None, "yyyy", 1)
    assert store.pop("b") == "yyyy" and store.pop("b") is None
    store.put("c", "zzzz")
    assert store.get("c") == "zzzz"
