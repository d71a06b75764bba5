"""What an engine replica needs to start: compiled from the topology by cluster/serve_app.py and handed
to each prefill/decode replica as its init argument (so a change rolls the replicas)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from engine.messages import Role


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: Role
    # "builtin:tiny-llama" or a model directory readable on every node.
    model_source: str
    served_name: str
    block_size: int
    dtype: str
    max_model_len: int
    # vLLM engine arguments (tensor_parallel_size, max_num_seqs, ...), passed through.
    engine_args: dict[str, Any] = {}
    # KV transfer: decode pools with no prefill pool run without a connector (a plain engine).
    kv_transfer: bool = True
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    # CPU engines (gpus == 0): core binding and KV cache size (whole GiB).
    device: Literal["cpu", "cuda"] = "cpu"
    cpu_threads_bind: str = "auto"
    cpu_kv_cache_gib: int = 1
    # Address the engine's NIXL side channel and KV-event publisher listen on: loopback for a one-machine
    # cluster; None = the node's IP (multi-node clusters, where other nodes must reach them).
    bind_host: str | None = "127.0.0.1"
    # Publish KV events over ZMQ for the router's KV index.
    kv_events: bool = True
    # Token streaming from decode: flush a batch at this many tokens or after this long.
    stream_batch_tokens: int = 16
    stream_batch_ms: float = 20.0
