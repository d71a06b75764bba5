"""Whole windows of a replica's cached chains, so a long prefix is checked with one probe per window.

A lookup must say how many leading blocks of a prompt a replica holds, exactly: a block evicted from the
middle of a chain leaves a hole, and the blocks after it must not count. Checking every block of a 128k-token
prompt is 8,192 lookups in a large index. Here a chain is cut into windows of `span_blocks` blocks by position
(block i is in window i // span_blocks), and a window's last block, its checkpoint, can vouch for the whole
window on a replica:

- An engine stores a block only while every block before it is in its cache (they belong to the request
  being computed). So when a stored event carries a whole window, or ends one that the replica's previous
  event on that chain had vouched for so far (its tip), the replica held the whole window at that moment.
- A window loses a block only through a removal, and every removal stamps the replica's `broken[window]`
  with the index's tick. A checkpoint vouched at tick t still vouches while no removal in its window is newer.

Windows are named by content, the router hash of their first block, so the chains sharing a prefix share its
windows, and a removal in one session's window does not spoil another's. `place` keeps each indexed block's
position and window, which a removal needs (it names a block, not its chain) and an event's next block needs
(its parent may be any block). Everything here is conservative: what is not vouched is walked block by block,
so a lookup's answer is the same as the full walk's (tests/router/view/test_kv_index.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import chain, repeat
from operator import lshift, or_

_MASK = (1 << 64) - 1
DEFAULT_SPAN_BLOCKS = 64  # a 128k-token prompt at 16 tokens a block: 128 windows


class ReplicaSpans:
    """One replica's vouched windows."""

    __slots__ = ("broken", "tips", "vouched")

    def __init__(self) -> None:
        self.vouched: dict[int, int] = {}  # checkpoint router hash -> tick its window was whole at
        self.tips: dict[
            int, int
        ] = {}  # last block of a stored event -> tick, when its window was whole so far
        self.broken: dict[int, int] = {}  # window (its first block's hash) -> tick of its latest removal

    def clear(self) -> None:
        self.vouched.clear()
        self.tips.clear()
        self.broken.clear()


class Spans:
    """Positions and windows of every indexed block (shared by the replicas: both depend on content only)."""

    def __init__(self, span_blocks: int = DEFAULT_SPAN_BLOCKS) -> None:
        if span_blocks < 2:
            raise ValueError(f"span_blocks must be at least 2, got {span_blocks}")
        self.span_blocks = span_blocks
        self.place: dict[int, int] = {}  # router hash -> position << 64 | window
        self.tick = 0

    def stored(
        self, rep: ReplicaSpans, hashes: Sequence[int], parent: int | None, since: int, place: bool
    ) -> None:
        """`hashes` (a chain after `parent`, or from the root) are now held by `rep`; `since` is the tick
        taken before the event's blocks were applied (a removal while applying them is newer). `place`:
        some of them are new to the index (blocks another replica holds have their places already)."""
        k, places = self.span_blocks, self.place
        if parent is None:
            pos, window, whole = 0, hashes[0], True
        else:
            placed = places.get(parent)
            if placed is None:  # a parent indexed with no position: this chain's windows are not vouched
                return
            pos, window = (placed >> 64) + 1, placed & _MASK
            # The chain's end moves to this event's last block: a tip per chain, not per event (a decode
            # stream stores a block at a time). Another branch from `parent` is then walked in this window.
            tip = rep.tips.pop(parent, None)
            whole = tip is not None and rep.broken.get(window, 0) < tip
        i, n, broken = 0, len(hashes), rep.broken
        while i < n:
            if pos % k == 0:
                window, whole = hashes[i], True
            j = min(n, i + k - pos % k)  # the end of this window, or of the event
            if place:
                positions = map(lshift, range(pos, pos + j - i), repeat(64))
                places.update(zip(hashes[i:j], map(or_, positions, repeat(window)), strict=True))
            whole = whole and broken.get(window, 0) < since
            if whole and (pos + j - i) % k == 0:
                rep.vouched[hashes[j - 1]] = self.tick
            pos += j - i
            i = j
        if whole:
            rep.tips[hashes[-1]] = self.tick

    def removed(self, rep: ReplicaSpans, hashes: Iterable[int]) -> None:
        """`rep` no longer holds these blocks (`forget` after this those no replica holds)."""
        self.tick += 1
        tick, place, broken, vouched, tips = self.tick, self.place, rep.broken, rep.vouched, rep.tips
        for r in hashes:
            placed = place.get(r)
            if placed is not None:
                broken[placed & _MASK] = tick
            if vouched:
                vouched.pop(r, None)
            if tips:
                tips.pop(r, None)
        if len(broken) > 4 * (len(vouched) + len(tips)) + 256:
            self._prune(rep)

    def forget(self, hashes: Iterable[int]) -> None:
        """No replica holds these blocks any more."""
        for r in hashes:
            self.place.pop(r, None)

    def _prune(self, rep: ReplicaSpans) -> None:
        """Keep only the removals newer than some vouch of their window: the rest can reject nothing."""
        keep: dict[int, int] = {}
        for r, t in chain(rep.vouched.items(), rep.tips.items()):
            window = self.place[r] & _MASK
            latest = rep.broken.get(window)
            if latest is not None and latest > t:
                keep[window] = latest
        rep.broken = keep

    def walk(
        self,
        hashes: Sequence[int],
        start: int,
        stop: int,
        alive: int,
        holders: Callable[[int, int], int],
        spans_of_slot: Sequence[ReplicaSpans],
        scan: Callable[[int, int, int], int],
    ) -> int:
        """The replicas of bitmask `alive` (each holds every block before `start`) that hold blocks
        start..stop-1 of the prompt `hashes`: a whole window is one probe for a replica whose checkpoint
        vouches for it; `scan(first, end, replicas)` checks the rest block by block (and records where each
        replica's prefix ends)."""
        k = self.span_blocks
        a = -(-start // k) * k  # the first window starting at or after `start`
        if a + k > stop:
            return scan(start, stop, alive)
        if start < a:
            alive = scan(start, a, alive)
        while alive and a + k <= stop:
            checkpoint, window = hashes[a + k - 1], hashes[a]
            held, whole = holders(checkpoint, 0) & alive, 0
            while held:
                low = held & -held
                rep = spans_of_slot[low.bit_length() - 1]
                t = rep.vouched.get(checkpoint)
                if t is not None and rep.broken.get(window, 0) < t:
                    whole |= low
                held ^= low
            rest = alive & ~whole
            alive = whole | (scan(a, a + k, rest) if rest else 0)
            a += k
        if alive and a < stop:
            alive = scan(a, stop, alive)
        return alive
