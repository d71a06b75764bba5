"""The topology file: its schema, its defaults, and the errors it gives (field path + reason)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from cluster.topology import (
    CPUS_PER_GPU_WORKER,
    NodeGroup,
    Pool,
    Topology,
    TopologyError,
    selector_matches,
    tool_call_parser,
)
from cluster.topology_checks import validate
from cluster.topology_file import load_topology, parse_topology
from router.config import RouterConfig

BROKEN = sorted((Path(__file__).parent / "broken").glob("*.yaml"))

H200_POOLS = """
model: {block_size: 64, dtype: bfloat16}
pools:
  prefill:
    replicas: 2
    gpus_per_replica: 8
    node_labels: {role: prefill}
    engine: {tensor_parallel_size: 8}
  decode:
    replicas: 2
    gpus_per_replica: 16
    nodes_per_replica: 2
    node_labels: {role: decode}
    engine: {tensor_parallel_size: 16, enable_expert_parallel: true}
"""
H200_NODES = """
nodes:
  - {name: prefill, labels: {role: prefill}, gpus: 8, cpus: 192, count: 2}
  - {name: decode, labels: {role: decode}, gpus: 8, cpus: 192, count: 4}
"""


def expectation(path: Path, key: str) -> str:
    match = re.search(rf"^# expect-{key}:(.*)$", path.read_text(), re.MULTILINE)
    assert match, f"{path.name} lacks an '# expect-{key}:' line"
    return match[1].strip()


@pytest.mark.parametrize("path", BROKEN, ids=[p.stem for p in BROKEN])
def test_broken_config_names_the_field_and_reason(path: Path) -> None:
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert info.value.path == expectation(path, "path")
    assert info.value.reason == expectation(path, "reason")
    assert str(info.value).startswith(f"{path}: ")


def test_there_are_broken_configs_for_each_kind_of_mistake() -> None:
    assert {p.stem for p in BROKEN} >= {
        "unknown_key",
        "wrong_type",
        "tp_mismatch",
        "gpus_per_replica_mismatch",
        "replica_larger_than_node",
        "port_clash",
    }


def test_defaults_are_the_local_cpu_cluster() -> None:
    topo = Topology()
    validate(topo)
    assert topo.model.source == "builtin:tiny-llama"
    assert topo.model.block_size % 32 == 0
    for _, pool in topo.pools.items():
        assert pool.replicas == 1
        assert not pool.uses_gpus
    # Two engines on one machine get distinct cores.
    assert topo.pools.prefill.cpu_engine.threads_bind != topo.pools.decode.cpu_engine.threads_bind
    assert (topo.server.grpc_host, topo.server.grpc_port) == ("127.0.0.1", 50051)
    assert topo.ray.address is None


def test_the_router_section_is_the_routers_own_config() -> None:
    assert Topology().router == RouterConfig()
    cfg = parse_topology(
        "router: {mode: disaggregate, prefill_weight: 20, prefill_overflow_queue_s: null}"
    ).router
    assert (cfg.mode, cfg.prefill_weight, cfg.prefill_overflow_queue_s) == ("disaggregate", 20.0, None)


def test_empty_document_gives_the_defaults() -> None:
    assert parse_topology("") == Topology()
    assert parse_topology({}) == Topology()


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "null\n"])
def test_an_empty_file_is_refused(text: str, tmp_path: Path) -> None:
    """An empty file is a mistake far more often than a wish for every default; `{}` says that."""
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value) == f"{path}: the file is empty (`{{}}` means every default; see deploy/local.yaml)"
    path.write_text("{}\n")
    assert load_topology(path) == Topology()


@pytest.mark.parametrize(
    ("text", "path", "reason"),
    [
        (
            "model: {dtype: bf16}",
            "model.dtype",
            "invalid value 'bf16' (allowed: float32, bfloat16, float16, auto)",
        ),
        (
            "pools: {decode: {engine: {kv_load_failure_policy: retry}}}",
            "pools.decode.engine.kv_load_failure_policy",
            "invalid value 'retry' (allowed: recompute, fail)",
        ),
        (
            "router: {policy: random}",
            "router.policy",
            "invalid value 'random' (allowed: pdserve, round_robin, least_loaded, session_hash)",
        ),
    ],
)
def test_a_value_outside_a_fixed_set_lists_the_allowed_values(text: str, path: str, reason: str) -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(text)
    assert (info.value.path, info.value.reason) == (path, reason)


def test_error_string_names_source_path_and_reason() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(
            "pools:\n  prefill: {gpus_per_replica: 8, engine: {tensor_parallel_size: 8}}\n"
            "  decode: {gpus_per_replica: 4, engine: {tensor_parallel_size: 4}}\nmodel: {block_size: 64}\n",
            source="deploy/x.yaml",
        )
    assert str(info.value) == (
        "deploy/x.yaml: pools.decode.engine.tensor_parallel_size: must be a multiple of "
        "pools.prefill.engine.tensor_parallel_size (8), got 4"
    )


def test_unknown_key_without_close_match_lists_allowed_keys() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology("router: {zzz: 1}")
    assert info.value.path == "router.zzz"
    assert info.value.reason.startswith(
        "unknown key (allowed: mode, policy, local_prefill_max_tokens, prefill_overflow"
    )


def test_unknown_key_inside_a_list_item() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology("nodes: [{name: a, cpus: 4, gpu: 8}]")
    assert info.value.path == "nodes[0].gpu"
    assert info.value.reason == "unknown key (did you mean 'gpus'?)"


def test_unknown_top_level_key() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology("pool: {}")
    assert (info.value.path, info.value.reason) == ("pool", "unknown key (did you mean 'pools'?)")


def test_document_must_be_a_mapping() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology("- a\n- b\n", source="t.yaml")
    assert (info.value.path, info.value.reason) == ("", "Expected `object`, got `array`")
    assert str(info.value) == "t.yaml: Expected `object`, got `array`"


def test_missing_file_is_a_topology_error(tmp_path: Path) -> None:
    with pytest.raises(TopologyError) as info:
        load_topology(tmp_path / "nope.yaml")
    assert info.value.reason.startswith("cannot read topology file")


def test_structs_reject_positional_arguments_and_mutation() -> None:
    with pytest.raises(TypeError):
        Pool(1)  # type: ignore[misc]
    pool = Pool()
    with pytest.raises(AttributeError):
        pool.replicas = 3  # type: ignore[misc]


def test_topology_round_trips_through_builtins() -> None:
    # The Serve application receives msgspec.to_builtins(topology); the replicas must get the same back.
    topo = parse_topology(H200_POOLS + H200_NODES)
    assert msgspec.convert(msgspec.to_builtins(topo), Topology) == topo


def test_prefill_may_be_off() -> None:
    topo = parse_topology("pools: {prefill: {replicas: 0}}")
    assert topo.pools.prefill.replicas == 0


def test_gpus_per_node_defaults_to_an_even_split() -> None:
    topo = parse_topology(H200_POOLS)
    assert topo.pools.decode.node_gpus == 8
    assert topo.pools.prefill.node_gpus == 8


def test_uneven_split_over_nodes_is_rejected() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(
            "model: {block_size: 64}\npools:\n  prefill: {replicas: 0}\n"
            "  decode: {gpus_per_replica: 12, nodes_per_replica: 5, engine: {tensor_parallel_size: 12}}"
        )
    assert info.value.path == "pools.decode.nodes_per_replica"
    assert info.value.reason == "gpus_per_replica (12) does not split evenly over 5 nodes"


def test_heterogeneous_tp_is_accepted_when_decode_is_a_multiple() -> None:
    topo = parse_topology(H200_POOLS + H200_NODES)
    assert topo.pools.decode.engine.tensor_parallel_size == 16


def test_decode_tp_rule_does_not_apply_without_prefill() -> None:
    parse_topology(
        "model: {block_size: 64}\npools:\n  prefill: {replicas: 0, gpus_per_replica: 8,"
        " engine: {tensor_parallel_size: 8}}\n"
        "  decode: {gpus_per_replica: 4, engine: {tensor_parallel_size: 4}}"
    )


def test_block_size_must_be_a_multiple_of_16() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology("model: {block_size: 24}")
    assert (info.value.path, info.value.reason) == ("model.block_size", "must be a multiple of 16, got 24")


@pytest.mark.parametrize("field", ["tool_call_parser", "reasoning_parser"])
def test_an_unknown_parser_is_refused_with_vllms_names(field: str) -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(f"model: {{{field}: no_such_parser}}")
    assert info.value.path == f"model.{field}"
    assert "unknown parser 'no_such_parser'" in info.value.reason and "kimi_k2" in info.value.reason
    with pytest.raises(TopologyError) as info:
        parse_topology("model: {tool_call_parser: hermez}")
    assert info.value.reason == "unknown parser 'hermez'; did you mean 'hermes'?"


def test_the_built_in_model_parses_hermes_tool_calls_and_others_what_the_topology_says() -> None:
    assert tool_call_parser(parse_topology("{model: {name: m}}").model) == "hermes"
    topo = parse_topology("model: {tool_call_parser: kimi_k2, reasoning_parser: kimi_k2}")
    assert (tool_call_parser(topo.model), topo.model.reasoning_parser) == ("kimi_k2", "kimi_k2")
    assert (
        tool_call_parser(msgspec.structs.replace(topo.model, source="/models/x", tool_call_parser=None))
        is None
    )


def test_gpu_pools_accept_block_size_16() -> None:
    topo = parse_topology(H200_POOLS.replace("block_size: 64", "block_size: 16"))
    assert topo.model.block_size == 16


def test_threads_bind_forms() -> None:
    for good in ("auto", "0", "0-3", "0,2,4-7"):
        parse_topology(f"pools: {{decode: {{cpu: {{threads_bind: '{good}'}}}}}}")
    with pytest.raises(TopologyError) as info:
        parse_topology("pools: {decode: {cpu: {threads_bind: 'cores 0'}}}")
    assert info.value.path == "pools.decode.cpu.threads_bind"


def test_ray_address_forms() -> None:
    for good in ("10.0.0.1:6379", "head.internal:6379", "auto"):
        assert parse_topology(f"ray: {{address: '{good}'}}").ray.address == good
    with pytest.raises(TopologyError) as info:
        parse_topology("ray: {address: 'ray://head'}")
    assert info.value.path == "ray.address"


def test_engine_extra_passes_other_args_through() -> None:
    topo = parse_topology("pools: {decode: {engine: {extra: {enable_prefix_caching: true, seed: 3}}}}")
    assert topo.pools.decode.engine.extra == {"enable_prefix_caching": True, "seed": 3}


def test_label_selectors_accept_ray_operators() -> None:
    topo = parse_topology("pools: {decode: {node_labels: {role: 'in(decode,both)', spot: '!true'}}}")
    assert topo.pools.decode.node_labels == {"role": "in(decode,both)", "spot": "!true"}


def test_selector_matches_ray_semantics() -> None:
    labels = {"role": "decode", "accelerator": "h200"}
    assert selector_matches({}, labels)
    assert selector_matches({"role": "decode"}, labels)
    assert not selector_matches({"role": "prefill"}, labels)
    assert selector_matches({"role": "in(prefill, decode)"}, labels)
    assert not selector_matches({"role": "!in(prefill,decode)"}, labels)
    assert selector_matches({"spot": "!true"}, labels)  # an absent label differs from any value
    assert not selector_matches({"accelerator": "!h200"}, labels)
    assert not selector_matches({"zone": "a"}, labels)


def test_gpu_replica_bundles_are_one_per_gpu_with_the_actor_in_bundle_0() -> None:
    pool = parse_topology(H200_POOLS).pools.decode
    bundles = pool.bundles()
    assert len(bundles) == 16
    assert all(b["GPU"] == 1 for b in bundles)
    assert bundles[0]["CPU"] == CPUS_PER_GPU_WORKER + pool.cpus_per_replica
    assert all(b["CPU"] == CPUS_PER_GPU_WORKER for b in bundles[1:])
    assert pool.distributed_executor_backend == "ray"
    # Grouped per node, the bundles are exactly what the node shapes say.
    shapes = pool.node_shapes()
    assert len(shapes) == 2
    assert sum(s["GPU"] for s in shapes) == sum(b["GPU"] for b in bundles)
    assert sum(s["CPU"] for s in shapes) == sum(b["CPU"] for b in bundles)


ONE_GPU_SHARED = """
model: {block_size: 16}
pools:
  prefill: {gpus_per_replica: 0.5}
  decode: {gpus_per_replica: 0.5}
"""


def test_replicas_may_share_one_gpu_each_within_its_share_of_memory() -> None:
    topo = parse_topology(ONE_GPU_SHARED + "nodes: [{name: gpu, gpus: 1, cpus: 8}]")
    pool = topo.pools.decode
    assert pool.shares_gpu and pool.engine_gpus == 1 and pool.distributed_executor_backend is None
    assert pool.bundles() == [{"GPU": 0.5, "CPU": CPUS_PER_GPU_WORKER + pool.cpus_per_replica}]
    assert pool.node_shapes() == pool.bundles()
    assert pool.gpu_memory_utilization == 0.45  # vLLM's 0.9, of the share
    # Whole GPUs keep vLLM's own default.
    assert parse_topology(H200_POOLS).pools.decode.gpu_memory_utilization is None


def test_two_half_gpu_replicas_fit_one_gpu_and_a_third_does_not() -> None:
    parse_topology(ONE_GPU_SHARED + "nodes: [{name: gpu, gpus: 1, cpus: 8}]")
    with pytest.raises(TopologyError) as info:
        parse_topology(
            ONE_GPU_SHARED.replace("decode: {", "decode: {replicas: 2, ")
            + "nodes: [{name: gpu, gpus: 1, cpus: 8}]"
        )
    assert info.value.path == "pools.prefill.replicas"


def test_cpu_replica_is_one_bundle() -> None:
    pool = Topology().pools.decode
    assert pool.bundles() == [{"CPU": pool.cpus_per_replica}]
    assert pool.distributed_executor_backend is None


def test_inventory_that_fits_exactly() -> None:
    topo = parse_topology(H200_POOLS + H200_NODES)
    assert topo.nodes == [
        NodeGroup(name="prefill", labels={"role": "prefill"}, gpus=8, cpus=192, count=2),
        NodeGroup(name="decode", labels={"role": "decode"}, gpus=8, cpus=192, count=4),
    ]


def test_inventory_counts_cpus_of_the_replica_actor() -> None:
    # 8 GPU bundles take 8 CPUs, plus 8 for the actor: 16 > 12 CPUs of the node.
    text = H200_POOLS.replace(
        "replicas: 2\n    gpus_per_replica: 8",
        "replicas: 2\n    gpus_per_replica: 8\n    cpus_per_replica: 8",
    ) + H200_NODES.replace("gpus: 8, cpus: 192, count: 2", "gpus: 8, cpus: 12, count: 2")
    with pytest.raises(TopologyError) as info:
        parse_topology(text)
    assert info.value.path == "pools.prefill.cpus_per_replica"
    assert info.value.reason == (
        "a replica needs 16 CPUs on its first node, larger than any node labelled {role: prefill}"
        " (12 CPUs at most)"
    )


def test_two_small_replicas_share_a_node_in_the_inventory() -> None:
    text = """
model: {block_size: 64}
pools:
  prefill: {replicas: 2, gpus_per_replica: 4, engine: {tensor_parallel_size: 4}}
  decode: {replicas: 2, gpus_per_replica: 4, engine: {tensor_parallel_size: 4}}
nodes: [{name: gpu, gpus: 8, cpus: 64, count: 2}]
"""
    parse_topology(text)
    with pytest.raises(TopologyError) as info:
        parse_topology(text.replace("prefill: {replicas: 2", "prefill: {replicas: 3"))
    assert info.value.path == "pools.prefill.replicas"
    assert info.value.reason == (
        "3 replicas do not fit the nodes labelled {}: only 2 fit after placing 2 decode"
    )


def test_node_group_names_are_unique() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology("nodes: [{name: a, cpus: 8}, {name: a, cpus: 8}]")
    assert (info.value.path, info.value.reason) == ("nodes[1].name", "'a' names two node groups")


def test_inventory_labels_are_plain_values() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology("nodes: [{name: a, cpus: 8, labels: {role: '!decode'}}]")
    assert info.value.path == "nodes[0].labels.role"


def test_threads_bind_may_give_each_replica_its_own_cores() -> None:
    topo = parse_topology("pools: {decode: {replicas: 2, cpu: {threads_bind: ['1', '0']}}}")
    assert topo.pools.decode.cpu_engine.threads_bind == ["1", "0"]
    with pytest.raises(TopologyError) as info:
        parse_topology("pools: {decode: {replicas: 2, cpu: {threads_bind: ['1', 'x']}}}")
    assert info.value.path == "pools.decode.cpu.threads_bind[1]"
    with pytest.raises(TopologyError) as info:
        parse_topology("pools: {decode: {cpu: {threads_bind: []}}}")
    assert info.value.path == "pools.decode.cpu.threads_bind"


def test_an_engine_extra_key_vllm_does_not_have_is_refused_with_a_suggestion() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology("pools: {decode: {engine: {extra: {max_logprob: 5}}}}")
    assert info.value.path == "pools.decode.engine.extra.max_logprob"
    assert info.value.reason == "not a vLLM engine argument (did you mean 'max_logprobs'?)"
    assert parse_topology("pools: {decode: {engine: {extra: {max_logprobs: 5}}}}")  # a real one passes


def test_impossible_batch_limits_are_refused_by_vllms_own_scheduler_check() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology("pools: {decode: {engine: {max_num_seqs: 100000, max_num_batched_tokens: 8}}}")
    assert info.value.path == "pools.decode.engine.max_num_batched_tokens"
    assert "must be greater than or equal to max_num_seqs (100000)" in info.value.reason


def gpu_topology(model: str = "", decode: str = "") -> str:
    """H200_POOLS with extra model keys and decode pool keys (YAML flow entries)."""
    text = H200_POOLS.replace(
        "model: {block_size: 64, dtype: bfloat16", f"model: {{block_size: 64, dtype: bfloat16{model}"
    )
    return text.replace("    node_labels: {role: decode}\n", f"    node_labels: {{role: decode}}\n{decode}")


def test_kv_dtype_quantization_and_speculation_take_vllms_names_on_gpus() -> None:
    topo = parse_topology(
        gpu_topology(
            ", kv_cache_dtype: fp8_e4m3, quantization: compressed-tensors",
            "    speculative: {method: eagle3, num_speculative_tokens: 3, model: /models/drafter}\n",
        )
    )
    assert topo.model.kv_cache_dtype == "fp8_e4m3" and topo.model.quantization == "compressed-tensors"
    assert topo.pools.decode.speculative is not None and topo.pools.decode.speculative.drafter_kv


@pytest.mark.parametrize(
    ("model", "decode", "path", "reason"),
    [
        (
            ", kv_cache_dtype: fp9",
            "",
            "model.kv_cache_dtype",
            "unknown KV cache dtype 'fp9'; did you mean 'fp8'?",
        ),
        (
            ", quantization: fp7",
            "",
            "model.quantization",
            "unknown quantization method 'fp7'; did you mean 'fp8'?",
        ),
        (
            "",
            "    speculative: {method: eagel, num_speculative_tokens: 3, model: /m}\n",
            "pools.decode.speculative.method",
            "unknown speculative method 'eagel'; did you mean 'eagle'?",
        ),
        (
            "",
            "    speculative: {method: eagle3, num_speculative_tokens: 3}\n",
            "pools.decode.speculative.model",
            "method 'eagle3' drafts with a model: give its directory",
        ),
        (
            "",
            "    speculative: {method: ngram, num_speculative_tokens: 3, model: /m}\n",
            "pools.decode.speculative.model",
            "method 'ngram' takes no drafter model",
        ),
        (
            "",
            "    speculative: {method: ngram, num_speculative_tokens: 0}\n",
            "pools.decode.speculative.num_speculative_tokens",
            "Expected `int` >= 1",
        ),
    ],
)
def test_speculation_and_kv_dtype_vllm_would_refuse_are_refused_by_field(
    model: str, decode: str, path: str, reason: str
) -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(gpu_topology(model, decode))
    assert (info.value.path, info.value.reason) == (path, reason)


def test_cpu_engines_take_the_one_byte_kv_dtypes_and_ngram() -> None:
    topo = parse_topology(
        "model: {kv_cache_dtype: fp8}\n"
        "pools: {decode: {speculative: {method: ngram, num_speculative_tokens: 4}}}"
    )
    spec = topo.pools.decode.speculative
    assert topo.model.kv_cache_dtype == "fp8" and spec is not None and not spec.drafter_kv
