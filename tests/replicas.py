"""A replica as it lists itself in the registry (engine.messages.ReplicaInfo), for tests of the router and the
registry that need one without an engine; an engine replica's spec for the built-in tiny model; and an engine
replica object built without Serve."""

from __future__ import annotations

from typing import Any, TypeVar

from engine.messages import ReplicaInfo
from engine.spec import EngineSpec


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


def tiny_spec(role: str = "decode", **fields: Any) -> EngineSpec:
    """An engine replica's spec for the built-in tiny model (the test double unless `engine` says otherwise);
    `fields` override (block_size, engine, hang_timeout_s, kv_readback_ttl_s, ...)."""
    base: dict[str, Any] = {
        "engine": "double",
        "model_source": "builtin:tiny-llama",
        "served_name": "tiny-llama",
        "block_size": 32,
        "dtype": "float32",
        "max_model_len": 2048,
    }
    return EngineSpec(role=role, **{**base, **fields})  # type: ignore[arg-type]


R = TypeVar("R")


def unserved(cls: type[R]) -> R:
    """An instance of an engine replica class without its constructor (Serve's needs a running replica
    context) and without Serve's graceful drain: `__del__` is a coroutine only Serve awaits, and garbage
    collection would otherwise call it and warn that it was never awaited."""
    bare = type(cls.__name__, (cls,), {"__del__": lambda self: None})
    return object.__new__(bare)  # type: ignore[no-any-return]
