"""KV event decoding against vLLM's own encoder, and the subscriber against a real vLLM ZmqEventPublisher."""

import asyncio
from collections.abc import Callable

import msgspec
import pytest
import zmq
from ports import free_port
from vllm.distributed import kv_events as vllm_ev

from router.block_hash import hash_blocks
from router.view.kv_event_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventDecodeError,
    decode_message,
    decode_payload,
    decode_seq,
)
from router.view.kv_events import KvEventSubscriber, SequenceTracker, SeqVerdict
from router.view.kv_index import KvIndex

BS = 16
_enc = msgspec.msgpack.Encoder()


def _stored(hashes: list[int | bytes], parent: int | bytes | None, tokens: list[int], **kw: object):  # type: ignore[no-untyped-def]
    return vllm_ev.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        **kw,
    )


def _batch(*events: object) -> vllm_ev.KVEventBatch:
    return vllm_ev.KVEventBatch(ts=12.5, events=list(events), data_parallel_rank=0)


def test_decodes_vllm_encoded_batch() -> None:
    toks = list(range(32))
    payload = _enc.encode(
        _batch(
            _stored([101, 102], None, toks, group_idx=0, session_id="s1"),
            vllm_ev.BlockRemoved(block_hashes=[101], medium="GPU"),
            vllm_ev.AllBlocksCleared(),
        )
    )
    b = decode_payload(payload, seq=7)
    assert (b.seq, b.ts, b.dp_rank, b.unknown_events) == (7, 12.5, 0, 0)
    assert b.events == [
        BlockStored(
            block_hashes=[101, 102],
            parent_block_hash=None,
            token_ids=toks,
            block_size=BS,
            medium="GPU",
            group_idx=0,
        ),
        BlockRemoved(block_hashes=[101], medium="GPU"),
        AllBlocksCleared(),
    ]


def test_bytes_hashes_normalise_like_vllm_int_hashes() -> None:
    raw = bytes(range(32))  # a sha256-sized engine hash
    b = decode_payload(_enc.encode(_batch(_stored([raw], raw, list(range(16))))))
    ev = b.events[0]
    assert isinstance(ev, BlockStored)
    expected = int.from_bytes(raw, "big") & (
        (1 << 64) - 1
    )  # what VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES publishes
    assert ev.block_hashes == [expected] and ev.parent_block_hash == expected


def test_extra_keys_mark_blocks_the_router_cannot_identify() -> None:
    plain = decode_payload(_enc.encode(_batch(_stored([1], None, list(range(16)), extra_keys=[None]))))
    salted = decode_payload(_enc.encode(_batch(_stored([1], None, list(range(16)), extra_keys=[("salt",)]))))
    assert not plain.events[0].has_extra_keys  # type: ignore[union-attr]
    assert salted.events[0].has_extra_keys  # type: ignore[union-attr]


def test_array_form_with_extra_trailing_fields_and_unknown_events() -> None:
    # The array encoding of older vLLM releases (and DESIGN.md), with fields a newer release might append.
    payload = _enc.encode(
        [
            1.0,
            [
                ["BlockStored", [5], 4, list(range(16)), BS, None, "GPU", None, None, 0, "future", 1],
                ["BlockRemoved", [b"\x00" * 7 + b"\x05"], "GPU", 0, "future"],
                ["AllBlocksCleared"],
                {"type": "SomethingNew", "x": 1},
            ],
        ]
    )
    b = decode_payload(payload)
    assert b.dp_rank is None and b.unknown_events == 1
    assert b.events == [
        BlockStored(
            block_hashes=[5],
            parent_block_hash=4,
            token_ids=list(range(16)),
            block_size=BS,
            medium="GPU",
            group_idx=0,
        ),
        BlockRemoved(block_hashes=[5], medium="GPU", group_idx=0),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize(
    "frames",
    [
        [b"kv", (0).to_bytes(8, "big"), b"\xc1"],  # not msgpack
        [b"kv", (0).to_bytes(8, "big"), _enc.encode({"a": 1})],  # not a batch
        [b"kv", (0).to_bytes(4, "big"), _enc.encode([0.0, []])],  # bad sequence frame
        [b"kv", _enc.encode([0.0, []])],  # missing frame
        [b"kv", (0).to_bytes(8, "big"), _enc.encode([0.0, [["BlockStored", "x"]]])],  # bad fields
    ],
)
def test_malformed_messages_raise(frames: list[bytes]) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_message(frames)


def test_sequence_tracker_verdicts() -> None:
    t = SequenceTracker()
    assert t.classify(0) is SeqVerdict.APPLY
    t.applied(0)
    assert t.classify(1) is SeqVerdict.APPLY
    assert t.classify(5) is SeqVerdict.GAP
    # A replay triggered by 5 delivered 1..8: live 6..8 arriving afterwards are duplicates, not a restart.
    t.applied(8)
    t.replayed(5)
    assert [t.classify(s) for s in (6, 7, 8)] == [SeqVerdict.DUPLICATE] * 3
    assert t.classify(9) is SeqVerdict.APPLY
    t.applied(9)
    assert t.classify(7) is SeqVerdict.RESTART  # past the window, going backwards = restart
    assert t.classify(0) is SeqVerdict.RESTART
    t.reset()
    assert t.classify(0) is SeqVerdict.APPLY


# ---- subscriber against vLLM's real publisher --------------------------------------------------------------


async def _wait_for(cond: Callable[[], bool], within_s: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def _publisher(port: int, replay_port: int, buffer_steps: int = 10_000) -> vllm_ev.ZmqEventPublisher:
    return vllm_ev.ZmqEventPublisher(
        data_parallel_rank=0,
        # vLLM's publisher binds wildcard (and ipc) endpoints and *connects* to host-specific ones.
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        buffer_steps=buffer_steps,
        topic="kv",
    )


async def _restarted_publisher(port: int, replay_port: int) -> vllm_ev.ZmqEventPublisher:
    """A new publisher on the old one's ports: the old sockets close asynchronously (publisher thread,
    ZMQ linger), so binding can fail for a moment, as it would for a restarting engine."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 10.0
    while True:
        try:
            return _publisher(port, replay_port)
        except zmq.ZMQError:
            if loop.time() > end:
                raise
            await asyncio.sleep(0.1)


async def _sent(pub: vllm_ev.ZmqEventPublisher) -> None:
    """Wait until the publisher thread has sent (and buffered) everything published so far."""
    await _wait_for(lambda: pub._event_queue.unfinished_tasks == 0)


def _prompt_event(seed: int, n_blocks: int = 2) -> tuple[vllm_ev.KVEventBatch, list[int]]:
    toks = [seed * 1000 + i for i in range(n_blocks * BS)]
    hashes = [seed * 100 + i for i in range(n_blocks)]
    return _batch(_stored(hashes, None, toks)), hash_blocks(toks, BS)  # type: ignore[arg-type]


async def _subscribed(
    index: KvIndex, port: int, replay_port: int | None
) -> tuple[KvEventSubscriber, asyncio.Task[None]]:
    """Replica r0's subscriber, running and connected (plus a moment for the SUB socket to establish)."""
    replay = None if replay_port is None else f"tcp://127.0.0.1:{replay_port}"
    sub = KvEventSubscriber("r0", f"tcp://127.0.0.1:{port}", replay, index, topic="kv", replay_timeout_s=10.0)
    task = asyncio.create_task(sub.run())
    await sub.wait_connected()
    await asyncio.sleep(0.3)
    return sub, task


async def test_a_late_subscriber_reads_what_the_engine_published_before_it_started() -> None:
    port, rport = free_port(), free_port()
    index = KvIndex(BS)
    pub = _publisher(port, rport)
    try:
        a, ha = _prompt_event(1)
        b, hb = _prompt_event(2)
        pub.publish(a)  # seq 0 and 1: published before anyone subscribes, so lost on the PUB socket
        pub.publish(b)
        await _sent(pub)
        sub, task = await _subscribed(index, port, rport)
        # Caught up at once from the replay buffer, with no live batch to show a gap.
        await _wait_for(lambda: index.matched_blocks(hb, ["r0"])["r0"] == 2)
        assert index.matched_blocks(ha, ["r0"])["r0"] == 2
        assert sub.stats.gaps == 0 and sub.stats.replayed_batches == 2 and sub._seq.last == 1
        c, hc = _prompt_event(3)
        pub.publish(c)  # seq 2 arrives live: applied, no gap
        await _wait_for(lambda: index.matched_blocks(hc, ["r0"])["r0"] == 2)
        assert sub.stats.gaps == 0 and sub.stats.duplicates == 0 and sub._seq.last == 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        pub.shutdown()


async def test_subscriber_replays_missed_batches_and_handles_restart() -> None:
    port, rport = free_port(), free_port()
    index = KvIndex(BS)
    pub = _publisher(port, rport)
    try:
        sub, task = await _subscribed(index, port, rport)
        received = sub._on_message

        async def losing_seq_1(frames: list[bytes]) -> None:  # the network loses one batch
            if decode_seq(frames[1]) != 1:
                await received(frames)

        sub._on_message = losing_seq_1  # type: ignore[method-assign]
        a, ha = _prompt_event(1)
        b, hb = _prompt_event(2)
        for event in (_prompt_event(7)[0], a, b):
            pub.publish(event)  # seq 0, 1 (lost), 2: the gap is fetched from the replay socket
        await _wait_for(lambda: index.matched_blocks(hb, ["r0"])["r0"] == 2)
        assert index.matched_blocks(ha, ["r0"])["r0"] == 2
        assert sub.stats.gaps == 1 and sub.stats.unrecoverable_gaps == 0 and sub._seq.last == 2
        sub._on_message = received  # type: ignore[method-assign]

        # Engine restart: a new publisher on the same ports starts again at seq 0.
        pub.shutdown()
        pub = await _restarted_publisher(port, rport)
        d, hd = _prompt_event(4)
        for _ in range(50):
            pub.publish(d)  # repeated until the reconnected SUB sees one; each is a new seq
            try:
                await _wait_for(lambda: sub.stats.restarts == 1, within_s=0.5)
                break
            except AssertionError:
                continue
        await _wait_for(lambda: index.matched_blocks(hd, ["r0"])["r0"] == 2)
        assert sub.stats.restarts == 1
        assert index.matched_blocks(ha, ["r0"])["r0"] == 0  # cleared with the restart
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        pub.shutdown()


async def test_subscriber_clears_replica_when_replay_buffer_lost_the_range() -> None:
    port, rport = free_port(), free_port()
    index = KvIndex(BS)
    pub = _publisher(port, rport, buffer_steps=1)
    try:
        for s in (1, 2, 3):
            pub.publish(_prompt_event(s)[0])  # seq 0..2, only seq 2 stays in the 1-deep buffer
        await _sent(pub)
        sub, task = await _subscribed(index, port, rport)
        # Caught up from seq 2 (0 and 1 are gone): what it knows it follows from there.
        h2 = _prompt_event(3)[1]
        await _wait_for(lambda: index.matched_blocks(h2, ["r0"])["r0"] == 2)
        assert index.matched_blocks(_prompt_event(1)[1], ["r0"])["r0"] == 0
        assert sub.stats.unrecoverable_gaps == 1 and sub._seq.last == 2
        ev, h = _prompt_event(9)
        pub.publish(ev)  # seq 3 live
        await _wait_for(lambda: index.matched_blocks(h, ["r0"])["r0"] == 2)
        assert sub._seq.last == 3 and sub.stats.gaps == 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        pub.shutdown()


async def test_subscriber_without_replay_endpoint_clears_on_gap() -> None:
    port, rport = free_port(), free_port()
    index = KvIndex(BS)
    index.apply_stored(
        "r0", [77], None, list(range(BS))
    )  # stale knowledge that a lost removal may contradict
    pub = _publisher(port, rport)
    try:
        pub.publish(_prompt_event(1)[0])
        await _sent(pub)
        sub, task = await _subscribed(index, port, None)
        ev, h = _prompt_event(5)
        pub.publish(ev)
        await _wait_for(lambda: index.matched_blocks(h, ["r0"])["r0"] == 2)
        assert sub.stats.unrecoverable_gaps == 1
        assert index.num_blocks("r0") == 2  # the stale block is gone
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        pub.shutdown()
