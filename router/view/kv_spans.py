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
windows, and a removal in one session's window does not spoil another's. The index keeps each block of a
replica as an entry, its router hash with its window and position, which a removal needs (it names a block,
not its chain) and an event's next block needs (its parent may be any block). Everything here is
conservative: what is not vouched is walked block by block, so a lookup's answer is the same as the full
walk's (tests/router/view/test_kv_index.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import chain, repeat
from operator import lshift, or_

_MASK = (1 << 64) - 1
DEFAULT_SPAN_BLOCKS = 64  # a 128k-token prompt at 16 tokens a block: 128 windows


def entry(block: int, window: int, position: int) -> int:
    """What the index keeps of a block for a replica: its router hash, window and position in one int."""
    return block | window << 64 | position << 128


def block_of(e: int) -> int:
    return e & _MASK


class ReplicaSpans:
    """One replica's vouched windows. Keys are entries (`entry`): a removal names them without a lookup."""

    __slots__ = ("broken", "tips", "vouched")

    def __init__(self) -> None:
        self.vouched: dict[int, int] = {}  # a window's last block -> tick its window was whole at
        self.tips: dict[int, int] = {}  # a chain's last stored block -> tick, when its window was whole
        self.broken: dict[int, int] = {}  # window (its first block's hash) -> tick of its latest removal

    def clear(self) -> None:
        self.vouched.clear()
        self.tips.clear()
        self.broken.clear()


class Spans:
    """The windows of every replica's chains, and the tick their stores and removals are ordered by."""

    def __init__(self, span_blocks: int = DEFAULT_SPAN_BLOCKS) -> None:
        if span_blocks < 2:
            raise ValueError(f"span_blocks must be at least 2, got {span_blocks}")
        self.span_blocks = span_blocks
        self.tick = 0

    def entries(self, hashes: Sequence[int], parent: int | None) -> list[int]:
        """The entries of a chain of blocks after the entry `parent`, or from the root."""
        k, out = self.span_blocks, list[int]()
        pos, window = (0, hashes[0]) if parent is None else ((parent >> 128) + 1, (parent >> 64) & _MASK)
        i, n = 0, len(hashes)
        while i < n:
            if pos % k == 0:
                window = hashes[i]
            j = min(n, i + k - pos % k)  # the end of this window, or of the chain
            high = map(or_, map(lshift, range(pos, pos + j - i), repeat(128)), repeat(window << 64))
            out += map(or_, hashes[i:j], high)
            pos, i = pos + j - i, j
        return out

    def stored(self, rep: ReplicaSpans, entries: Sequence[int], parent: int | None, since: int) -> None:
        """The blocks of `entries` (after the entry `parent`, or from the root) are now held by `rep`;
        `since` is the tick taken before they were applied (a removal while applying them is newer)."""
        k = self.span_blocks
        if parent is None:
            whole = True
        else:
            # The chain's end moves to this event's last block: a tip per chain, not per event (a decode
            # stream stores a block at a time). Another branch from `parent` is then walked in this window.
            tip = rep.tips.pop(parent, None)
            whole = tip is not None and rep.broken.get((parent >> 64) & _MASK, 0) < tip
        i, n, broken = 0, len(entries), rep.broken
        pos = entries[0] >> 128
        while i < n:
            if pos % k == 0:
                whole = True
            j = min(n, i + k - pos % k)
            whole = whole and broken.get((entries[i] >> 64) & _MASK, 0) < since
            if whole and (pos + j - i) % k == 0:
                rep.vouched[entries[j - 1]] = self.tick
            pos, i = pos + j - i, j
        if whole:
            rep.tips[entries[-1]] = self.tick

    def removed(self, rep: ReplicaSpans, entries: Iterable[int]) -> None:
        """`rep` no longer holds these blocks."""
        self.tick += 1
        tick, broken, vouched, tips = self.tick, rep.broken, rep.vouched, rep.tips
        for e in entries:
            broken[(e >> 64) & _MASK] = tick
            if vouched:
                vouched.pop(e, None)
            if tips:
                tips.pop(e, None)
        if len(broken) > 4 * (len(vouched) + len(tips)) + 256:
            self._prune(rep)

    def _prune(self, rep: ReplicaSpans) -> None:
        """Keep only the removals newer than some vouch of their window: the rest can reject nothing."""
        keep: dict[int, int] = {}
        for e, t in chain(rep.vouched.items(), rep.tips.items()):
            window = (e >> 64) & _MASK
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
            key = entry(checkpoint, window, a + k - 1) if held else 0
            while held:
                low = held & -held
                rep = spans_of_slot[low.bit_length() - 1]
                t = rep.vouched.get(key)
                if t is not None and rep.broken.get(window, 0) < t:
                    whole |= low
                held ^= low
            rest = alive & ~whole
            alive = whole | (scan(a, a + k, rest) if rest else 0)
            a += k
        if alive and a < stop:
            alive = scan(a, stop, alive)
        return alive
