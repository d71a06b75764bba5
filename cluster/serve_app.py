"""The Serve application that a topology compiles to (import path `cluster.serve_app:build_app`).

Deployments: `prefill` (omitted when the topology has no prefill replicas), `decode`, and `registry`, which
binds the engine pools so that Serve deploys them and keeps the replica registry. The registry is the
application's ingress, unless the application serves its router (`router`, cluster/router_replica.py:
every deployed cluster; tests may run their own), which then binds the registry. Placement, replica counts and
scaling come from the Serve config that cluster/serve_config.py compiles from the same topology; this
module only says what each replica runs.

The application's `args` are only its shape (`{"roles": ["decode", "prefill"]}`, and `"router": true`):
Serve gives every deployment of a config-deployed application one version, a hash of `args`, so whatever
`args` carried would restart every pool when it changed. Each pool's EngineSpec reaches its replicas through
the deployment's own `ray_actor_options` instead (engine/spec.py), which Serve versions per deployment.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from cluster.registry import Registry
from cluster.router_replica import ROUTER, RouterReplica
from cluster.topology import Pool, Topology
from decode.decode_replica import DecodeReplica
from engine.replica import EngineReplica
from engine.spec import EngineSpec
from prefill.prefill_replica import PrefillReplica

# The serving deployments' environment, which a worker reads when it starts:
# - Ray starts its workers at niceness 15, below its own daemons and anything else on the node. pdserve's
#   replicas are the serving path (the router's event loop; the engine host and its engine-core process, which
#   inherits the niceness) and the registry whose heartbeats keep replicas routable: at 15 they lose every
#   contended core to the engines they coordinate.
# - Serve exports each replica's and each handle's request metrics every 100 ms by default: ten wake-ups a
#   second in every actor, idle or not. pdserve's requests do not pass Serve's handles (only control calls
#   do), so once a second loses nothing.
SERVING_ENV = {"RAY_worker_niceness": "0", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}
# The registry's options are its code's (a deployment config gives it none): no CPU, normal priority.
REGISTRY_ACTOR_OPTIONS = {"num_cpus": 0, "runtime_env": {"env_vars": SERVING_ENV}}


def engine_spec(topo: Topology, role: str) -> EngineSpec:
    pool: Pool = getattr(topo.pools, role)
    engine = pool.engine
    args: dict[str, Any] = {
        "tensor_parallel_size": engine.tensor_parallel_size,
        "pipeline_parallel_size": engine.pipeline_parallel_size,
        "data_parallel_size": engine.data_parallel_size,
        "enable_expert_parallel": engine.enable_expert_parallel,
        "enforce_eager": engine.enforce_eager,
    }
    if topo.model.trust_remote_code:  # e.g. Kimi's tokenizer and config ship as code in the checkpoint
        args["trust_remote_code"] = True
    # Unset limits keep vLLM's own defaults for the device.
    if engine.max_num_seqs is not None:
        args["max_num_seqs"] = engine.max_num_seqs
    if engine.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = engine.max_num_batched_tokens
    if pool.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = pool.gpu_memory_utilization
    if pool.engine_gpus > 1:
        # One Ray worker per GPU bundle of the replica's placement group (vLLM finds the group from the
        # replica actor, which Serve places in it). Left to itself vLLM would pick multiprocessing, which
        # sees no GPU in an actor that holds none, and refuses a world larger than one node's GPUs.
        args["distributed_executor_backend"] = "ray"
    args.update(_quantization_args(topo, role))
    args.update(engine.extra)
    return EngineSpec(
        role="prefill" if role == "prefill" else "decode",
        engine=topo.model.engine,
        model_source=topo.model.source,
        served_name=topo.model.name,
        block_size=topo.model.block_size,
        dtype=topo.model.dtype,
        max_model_len=topo.model.max_model_len,
        engine_args=args,
        kv_transfer=topo.pools.prefill.replicas > 0,
        kv_load_failure_policy=engine.kv_load_failure_policy,
        kv_readback_ttl_s=topo.pools.kv_readback_ttl_s if topo.pools.prefill.replicas > 0 else 0,
        device="cuda" if pool.uses_gpus else "cpu",
        cpu_threads_bind=_threads_binds(pool.cpu_engine.threads_bind) if not pool.uses_gpus else ["auto"],
        cpu_kv_cache_gib=pool.cpu_engine.kv_cache_gib if not pool.uses_gpus else 1,
        bind_host="127.0.0.1" if topo.ray.address is None else None,
        hang_timeout_s=pool.hang_timeout_s,
        otlp_traces_endpoint=topo.server.otlp_traces_endpoint,
    )


def _quantization_args(topo: Topology, role: str) -> dict[str, Any]:
    """Weights, KV dtype and speculation: the same for both pools, but for the drafter, which decode runs and
    prefill runs too only where it keeps KV of its own (its KV moves with the prompt's)."""
    model = topo.model
    args: dict[str, Any] = {}
    if model.quantization is not None:
        args["quantization"] = model.quantization
    if model.kv_cache_dtype != "auto":
        args["kv_cache_dtype"] = model.kv_cache_dtype
    spec = topo.pools.decode.speculative
    if spec is not None and (role == "decode" or spec.drafter_kv):
        args["speculative_config"] = spec.vllm_config()
    return args


def _threads_binds(bind: str | list[str]) -> list[str]:
    return [bind] if isinstance(bind, str) else list(bind)


def app_args(topo: Topology, *, serve_router: bool = False) -> dict[str, Any]:
    """The application's `args`: what changes only with a restart of the whole application. `serve_router`:
    the router runs as a deployment of the application (rather than in a test's own process)."""
    args: dict[str, Any] = {"roles": [role for role, pool in topo.pools.items() if pool.replicas > 0]}
    if serve_router:
        args["router"] = True
    return args


def build_app(args: dict[str, Any]) -> Application:
    servers: dict[str, type[EngineReplica]] = {"prefill": PrefillReplica, "decode": DecodeReplica}
    pools = [serve.deployment(name=role)(servers[role]).bind() for role in args["roles"]]
    registry_deployment = serve.deployment(name="registry", ray_actor_options=REGISTRY_ACTOR_OPTIONS)
    registry = registry_deployment(Registry).bind(*pools)
    if not args.get("router"):
        return registry
    return serve.deployment(name=ROUTER)(RouterReplica).bind(registry)
