"""A replica as it lists itself in the registry (engine.messages.ReplicaInfo), for tests of the router and the
registry that need one without an engine."""

from __future__ import annotations

from typing import Any

from engine.messages import ReplicaInfo


def replica_info(replica_id: str, role: str = "decode", **fields: Any) -> ReplicaInfo:
    """No KV events, a loopback NIXL side channel, block size 32; `fields` override (ready, failed, stats)."""
    base: dict[str, Any] = {
        "node_id": "n",
        "kv_events_endpoint": None,
        "kv_events_replay_endpoint": None,
        "nixl_host": "127.0.0.1",
        "nixl_port": 1,
        "block_size": 32,
    }
    return ReplicaInfo(replica_id=replica_id, role=role, **{**base, **fields})  # type: ignore[arg-type]
