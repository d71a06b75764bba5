"""What an engine replica needs to start: compiled from the topology by cluster/serve_app.py and handed
to each prefill/decode replica in its environment (`PDSERVE_ENGINE_SPEC`).

Why the environment and not an init argument: Serve versions every deployment of a config-deployed
application by a hash of the application's `args`, so anything bound from `args` restarts every pool when
any of it changes. A deployment's `ray_actor_options` (its `runtime_env.env_vars` included) is versioned
per deployment: a changed spec rolls that pool's replicas, and only that pool's (see cluster/serve_config.py).
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

from engine.messages import Role


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: Role
    # "vllm": engine/host.py. "double": engine/double.py, a test double without vLLM (cluster tests only).
    engine: Literal["vllm", "double"] = "vllm"
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
    # KV readback (vLLM's bidirectional NIXL transfer): a decode engine keeps a finished request's blocks
    # pinned this many seconds for a prefill engine to pull (a session's next turn); 0 = off.
    kv_readback_ttl_s: int = 0
    # CPU engines (gpus == 0): core binding and KV cache size (whole GiB).
    device: Literal["cpu", "cuda"] = "cpu"
    # One entry for every replica, or one per replica: a replica takes the least used entry when it starts
    # (`Registry.claim_slot`), so engines on one machine get cores of their own.
    cpu_threads_bind: list[str] = msgspec.field(default_factory=lambda: ["auto"])
    cpu_kv_cache_gib: int = 1
    # Address the engine's NIXL side channel and KV-event publisher listen on: loopback for a one-machine
    # cluster; None = the node's IP (multi-node clusters, where other nodes must reach them).
    bind_host: str | None = "127.0.0.1"
    # Publish KV events over ZMQ for the router's KV index.
    kv_events: bool = True
    # Token streaming from decode: flush a batch at this many tokens or after this long.
    # An engine with requests in flight that produces no output for this long is hung: the replica reports
    # itself failed (routers stop using it, Serve's health check replaces it).
    hang_timeout_s: float = 30.0
    # OTLP collector for request traces (the topology's server.otlp_traces_endpoint; None: off).
    otlp_traces_endpoint: str | None = None


ENGINE_SPEC_ENV = "PDSERVE_ENGINE_SPEC"


def spec_env(spec: EngineSpec) -> dict[str, str]:
    """The replica environment that carries `spec` (JSON)."""
    return {ENGINE_SPEC_ENV: msgspec.json.encode(spec).decode()}


def spec_from_env() -> EngineSpec:
    """The spec this replica process was started with (set by Ray from the deployment's runtime_env)."""
    text = os.environ.get(ENGINE_SPEC_ENV)
    if text is None:
        raise RuntimeError(f"{ENGINE_SPEC_ENV} is not set: this process was not started as an engine replica")
    return msgspec.json.decode(text, type=EngineSpec)
