"""What one prefix lookup of the KV index established, for resuming it on a prompt that extends the same
prefix (a session's next turn)."""

from __future__ import annotations


class PrefixMemo:
    """What one `matched_blocks_memo` lookup established, for resuming the walk on a later prompt that
    extends the same prefix (a session's next turn).

    At removal clock `stamp`, replica `r` held the first `counts[r]` blocks of the looked-up prompt, and
    `anchors[m]` is that prompt's hash of block m-1. Blocks are only lost through removals, each of which
    advances the clock and stamps the replica, so while a replica's removal stamp is not newer than `stamp` it
    still holds those blocks; a later prompt whose block m-1 has the same chained hash has the same first m
    blocks (up to a 64-bit collision, the index's accepted risk).

    `KvIndex.expect_stored` adds the replicas a request was sent to, with the whole prompt, before they hold
    it. Such an entry counts once the replica holds the anchor block with no removal since `stamp`: an engine
    stores a block only while every block before it is in its cache (they belong to the same running request),
    so holding block m-1 with nothing lost since means holding all m."""

    __slots__ = ("anchors", "counts", "stamp")

    def __init__(self, stamp: int, counts: dict[str, int], anchors: dict[int, int]) -> None:
        self.stamp = stamp
        self.counts = counts
        self.anchors = anchors
