"""vLLM's KV cache events off the wire: one ZMQ message into a `KvEventBatch` (router/view/kv_events.py
subscribes and keeps the index in sync).

Wire format (vLLM 0.32, `vllm/distributed/kv_events.py`, `ZmqEventPublisher`):
- PUB socket, multipart `(topic, seq, payload)`: `seq` is an 8-byte big-endian counter starting at 0 when the
  publisher starts (so a lower sequence number means the engine restarted);
- payload: msgpack `[ts, [event, ...], data_parallel_rank]` (`EventBatch`, array-like);
- each event is a tagged msgspec struct. vLLM 0.32 encodes it as a map with a `"type"` key
  (`{"type": "BlockStored", "block_hashes": [...], ...}`); older releases (and DESIGN.md) encode it as an
  array `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  extra_keys, group_idx, ...]`, `["BlockRemoved", block_hashes, medium, group_idx, ...]`,
  `["AllBlocksCleared"]`. Both are accepted; fields added by newer releases are ignored.
- Block hashes are ints (default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) or raw bytes; bytes are normalised
  to the int vLLM itself would publish (low 64 bits of the big-endian value).
- Replay: a ROUTER socket; a client sends `(b"", start_seq as 8-byte big-endian)` and receives, for every
  buffered batch with `seq >= start_seq`, `(b"", topic, seq, payload)`, then an end marker
  `(b"", b"", seq=-1 (signed), b"")`. The buffer holds the last `buffer_steps` batches (default 10,000).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

_U64 = (1 << 64) - 1
END_SEQ = -1


class BlockStored(msgspec.Struct, frozen=True, kw_only=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None
    # True when some block's engine hash covers more than its tokens (multimodal features, cache salt,
    # prompt embeddings): the router's token-only hash cannot identify such blocks.
    has_extra_keys: bool = False


class BlockRemoved(msgspec.Struct, frozen=True, kw_only=True):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, kw_only=True):
    medium: str | None = None


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    ts: float
    events: list[KvEvent]
    dp_rank: int | None = None
    # Events of a type this decoder does not know (a newer vLLM); they are skipped.
    unknown_events: int = 0


class KvEventDecodeError(ValueError):
    """A message that is not a vLLM KV event batch."""


def engine_hash(value: int | bytes) -> int:
    """Normalise an engine block hash to an int, exactly as vLLM does when it publishes int hashes."""
    if isinstance(value, int):
        return value
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big") & _U64
    raise KvEventDecodeError(f"block hash must be int or bytes, got {type(value).__name__}")


def _hashes(values: Any) -> list[int]:
    if not isinstance(values, list):
        raise KvEventDecodeError("block_hashes must be a list")
    return [engine_hash(v) for v in values]


def _get(fields: Sequence[Any], i: int) -> Any:
    return fields[i] if i < len(fields) else None


# Field order of the array form (tag first), used to read both encodings through one code path.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _as_map(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise KvEventDecodeError("event map without a string 'type'")
        return kind, raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        return kind, {name: _get(raw, i + 1) for i, name in enumerate(names)}
    raise KvEventDecodeError(f"event must be a tagged map or array, got {type(raw).__name__}")


def _decode_event(raw: Any) -> KvEvent | None:
    kind, f = _as_map(raw)
    if kind == "BlockStored":
        token_ids = f.get("token_ids")
        block_size = f.get("block_size")
        if not isinstance(token_ids, list) or not isinstance(block_size, int):
            raise KvEventDecodeError("BlockStored needs token_ids (list) and block_size (int)")
        parent = f.get("parent_block_hash")
        extra = f.get("extra_keys")
        return BlockStored(
            block_hashes=_hashes(f.get("block_hashes")),
            parent_block_hash=None if parent is None else engine_hash(parent),
            token_ids=token_ids,
            block_size=block_size,
            lora_id=f.get("lora_id"),
            lora_name=f.get("lora_name"),
            medium=f.get("medium"),
            group_idx=f.get("group_idx"),
            has_extra_keys=isinstance(extra, list) and any(k is not None for k in extra),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(f.get("block_hashes")), medium=f.get("medium"), group_idx=f.get("group_idx")
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared(medium=f.get("medium"))
    return None


_payload_decoder = msgspec.msgpack.Decoder()


def decode_payload(payload: bytes, seq: int = 0) -> KvEventBatch:
    """Decode one msgpack event batch `[ts, [events...], dp_rank]`."""
    try:
        raw = _payload_decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise KvEventDecodeError(f"not msgpack: {e}") from e
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KvEventDecodeError("payload must be [ts, [events...], dp_rank]")
    events: list[KvEvent] = []
    unknown = 0
    for item in raw[1]:
        ev = _decode_event(item)
        if ev is None:
            unknown += 1
        else:
            events.append(ev)
    dp_rank = raw[2] if len(raw) > 2 else None
    return KvEventBatch(seq=seq, ts=float(raw[0]), events=events, dp_rank=dp_rank, unknown_events=unknown)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvEventDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_message(frames: Sequence[bytes]) -> KvEventBatch:
    """Decode one PUB message `(topic, seq, payload)`."""
    if len(frames) != 3:
        raise KvEventDecodeError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    return decode_payload(frames[2], decode_seq(frames[1]))
