"""An async subscriber that keeps a `KvIndex` in sync with one engine's KV events (their wire format:
router/view/kv_event_wire.py): sequence numbers checked, lost batches fetched from the publisher's replay
socket, a restarted engine's replica cleared.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from router.view.kv_event_wire import (
    END_SEQ,
    KvEvent,
    KvEventBatch,
    KvEventDecodeError,
    decode_message,
    decode_payload,
    decode_seq,
)

logger = logging.getLogger(__name__)


class SeqVerdict(enum.Enum):
    APPLY = "apply"  # next in sequence
    DUPLICATE = "duplicate"  # already applied (seen through replay)
    GAP = "gap"  # batches between the last applied one and this one were lost
    RESTART = "restart"  # the sequence went backwards: the publisher (engine) restarted


class SequenceTracker:
    """Pure bookkeeping of one publisher's sequence numbers.

    After a replay, live messages that the replay already delivered arrive again on the SUB socket; they lie
    in the window (sequence that triggered the replay, last replayed sequence] and are duplicates, not a
    restart. Any other sequence number at or below the last applied one means the publisher restarted from 0.
    """

    def __init__(self) -> None:
        self.last = -1  # last applied sequence number; -1 before the first batch
        self._dup_lo = 0
        self._dup_hi = -1

    def classify(self, seq: int) -> SeqVerdict:
        if self._dup_lo < seq <= self._dup_hi:
            return SeqVerdict.DUPLICATE
        if seq > self._dup_hi:
            self._dup_hi = -1  # past the replayed window: it can no longer produce duplicates
        if seq == self.last + 1:
            return SeqVerdict.APPLY
        if seq > self.last + 1:
            return SeqVerdict.GAP
        return SeqVerdict.RESTART

    def applied(self, seq: int) -> None:
        self.last = seq

    def replayed(self, trigger_seq: int) -> None:
        """A replay triggered by live `trigger_seq` brought `last` up to date."""
        self._dup_lo, self._dup_hi = trigger_seq, self.last

    def reset(self) -> None:
        self.last = -1
        self._dup_hi = -1


class SubscriberStats(msgspec.Struct, kw_only=True):
    batches: int = 0
    events: int = 0
    duplicates: int = 0
    gaps: int = 0
    replayed_batches: int = 0
    # Gaps the publisher's replay buffer could not fill (or no replay socket): the replica was cleared.
    unrecoverable_gaps: int = 0
    restarts: int = 0
    decode_errors: int = 0
    unknown_events: int = 0


class EventSink(Protocol):
    """Where one engine's decoded events go (`router.view.kv_index.KvIndex`)."""

    def apply(self, replica_id: str, event: KvEvent) -> None: ...

    def clear_replica(self, replica_id: str) -> None: ...


class KvEventSubscriber:
    """Subscribes to one engine's KV event publisher and applies its events to `index` under `replica_id`.

    A subscriber that starts after its engine first reads what the publisher's replay buffer holds. Lost
    batches (a sequence gap) are fetched from the publisher's replay socket; when they cannot be (no
    replay endpoint, timeout, or the replay buffer no longer holds them) the replica is cleared, because an
    index that missed removals would promise cache hits the engine cannot give (the safe error is to
    under-predict). A sequence that goes backwards is an engine restart: the replica is cleared and the new
    stream is followed from its start (replaying what the new publisher already sent).

    `run()` loops until cancelled; cancelling closes the sockets. The index is only touched from this
    coroutine's event loop, so no locking is needed when every subscriber and the router share one loop.
    """

    def __init__(
        self,
        replica_id: str,
        endpoint: str,
        replay_endpoint: str | None,
        index: EventSink,
        *,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.stats = SubscriberStats()
        self._ctx = context or zmq.asyncio.Context.instance()
        self._seq = SequenceTracker()
        self._sub: zmq.asyncio.Socket | None = None
        self._connected = asyncio.Event()

    async def wait_connected(self) -> None:
        """Returns once the SUB socket is connected (a PUB drops what it sends before that)."""
        await self._connected.wait()

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        self._sub = sub
        self._connected.set()
        try:
            if self.replay_endpoint:
                await self._catch_up()
            while True:
                frames = await sub.recv_multipart()
                await self._on_message(frames)
        finally:
            sub.close(linger=0)
            self._sub = None

    async def _on_message(self, frames: list[bytes]) -> None:
        try:
            batch = decode_message(frames)
        except KvEventDecodeError as e:
            self.stats.decode_errors += 1
            logger.warning("replica %s: undecodable KV event message: %s", self.replica_id, e)
            return
        verdict = self._seq.classify(batch.seq)
        if verdict is SeqVerdict.DUPLICATE:
            self.stats.duplicates += 1
            return
        if verdict is SeqVerdict.RESTART:
            self.stats.restarts += 1
            logger.info(
                "replica %s: KV event sequence reset (%d -> %d): engine restarted",
                self.replica_id,
                self._seq.last,
                batch.seq,
            )
            self.index.clear_replica(self.replica_id)
            self._seq.reset()
            verdict = self._seq.classify(batch.seq)
        if verdict is SeqVerdict.GAP:
            self.stats.gaps += 1
            await self._recover(batch.seq)
            if self._seq.last >= batch.seq:
                return  # the replay delivered this batch too
        self._apply(batch)

    async def _catch_up(self) -> None:
        """What the engine published before this subscriber started (a router that starts after its engines,
        or replaces one that died): every batch the publisher's replay buffer still holds. Live batches that
        the replay also delivered are then duplicates; any lost between the two are a gap, fetched then."""
        replayed = await self._fetch_replay(0)
        if not replayed:
            return  # nothing published yet (or no answer: the first live batch's gap asks again)
        if replayed[0].seq != 0:
            # The engine has run longer than its buffer: blocks stored before it are not known here (the
            # safe error: a cache hit under-predicted, never promised).
            self.stats.unrecoverable_gaps += 1
            logger.info(
                "replica %s: KV events before %d are no longer buffered; following from there",
                self.replica_id,
                replayed[0].seq,
            )
        self._seq.last = replayed[0].seq - 1
        for batch in replayed:
            if batch.seq == self._seq.last + 1:
                self.stats.replayed_batches += 1
                self._apply(batch)
        self._seq.replayed(-1)

    async def _recover(self, trigger_seq: int) -> None:
        """Fetch batches last+1 .. trigger_seq from the replay socket and apply them."""
        start = self._seq.last + 1
        replayed = await self._fetch_replay(start) if self.replay_endpoint else None
        if replayed is None or not replayed or replayed[0].seq != start:
            # The missing range is gone for good: forget what this replica holds rather than trust it.
            self.stats.unrecoverable_gaps += 1
            logger.warning(
                "replica %s: KV events %d..%d lost and not replayable; clearing the replica",
                self.replica_id,
                start,
                trigger_seq - 1,
            )
            self.index.clear_replica(self.replica_id)
            if not replayed:
                self._seq.last = trigger_seq - 1
                return
            self._seq.last = replayed[0].seq - 1
        for batch in replayed:
            if batch.seq == self._seq.last + 1:
                self.stats.replayed_batches += 1
                self._apply(batch)
        self._seq.replayed(trigger_seq)

    async def _fetch_replay(self, start: int) -> list[KvEventBatch] | None:
        """All buffered batches from `start` on, or None on timeout/error."""
        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        out: list[KvEventBatch] = []
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    # (b"", topic, seq, payload); the end marker has seq == -1
                    if len(frames) != 4:
                        raise KvEventDecodeError(f"replay reply with {len(frames)} frames")
                    seq = decode_seq(frames[2])
                    if seq == END_SEQ:
                        return out
                    out.append(decode_payload(frames[3], seq))
        except (TimeoutError, KvEventDecodeError, zmq.ZMQError) as e:
            logger.warning("replica %s: KV event replay from %d failed: %r", self.replica_id, start, e)
            return None
        finally:
            sock.close(linger=0)

    def _apply(self, batch: KvEventBatch) -> None:
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.unknown_events += batch.unknown_events
        for ev in batch.events:
            self.index.apply(self.replica_id, ev)
        self._seq.applied(batch.seq)
