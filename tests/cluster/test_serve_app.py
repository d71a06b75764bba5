"""What each engine replica is told to run: the EngineSpec compiled from the topology."""

from pathlib import Path

from cluster.serve_app import engine_spec
from cluster.topology_file import load_topology, parse_topology

LOCAL = Path(__file__).resolve().parents[2] / "deploy" / "local.yaml"


def test_local_cpu_pools_get_their_cores_kv_space_and_kv_roles() -> None:
    topo = load_topology(LOCAL)
    prefill, decode = engine_spec(topo, "prefill"), engine_spec(topo, "decode")
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert (prefill.cpu_threads_bind, decode.cpu_threads_bind) == (["0"], ["1"])
    assert prefill.cpu_kv_cache_gib == 1 and prefill.device == "cpu"
    assert prefill.kv_transfer and decode.kv_transfer
    # A one-machine cluster keeps engine side channels on loopback.
    assert prefill.bind_host == "127.0.0.1"
    assert prefill.block_size == topo.model.block_size and prefill.engine_args["enforce_eager"] is True


def test_no_prefill_pool_means_a_plain_decode_engine_without_a_kv_connector() -> None:
    spec = engine_spec(parse_topology("pools: {prefill: {replicas: 0}}"), "decode")
    assert spec.kv_transfer is False


def test_kv_readback_reaches_both_pools_and_only_with_a_prefill_pool() -> None:
    topo = parse_topology("pools: {kv_readback_ttl_s: 480}")
    assert [engine_spec(topo, role).kv_readback_ttl_s for role in ("prefill", "decode")] == [480, 480]
    assert engine_spec(parse_topology(""), "decode").kv_readback_ttl_s == 0  # off by default
    alone = parse_topology("pools: {kv_readback_ttl_s: 480, prefill: {replicas: 0}}")
    assert engine_spec(alone, "decode").kv_readback_ttl_s == 0


def test_engine_args_pass_through_and_unset_limits_keep_vllm_defaults() -> None:
    topo = parse_topology(
        "pools: {decode: {cpu: {threads_bind: '1'}, engine: {max_num_seqs: 8, extra: {seed: 7}}}}"
    )
    args = engine_spec(topo, "decode").engine_args
    assert args["max_num_seqs"] == 8 and args["seed"] == 7
    assert "max_num_batched_tokens" not in args


def test_a_remote_ray_cluster_binds_engine_side_channels_to_the_node_ip() -> None:
    topo = parse_topology("ray: {address: '10.0.0.1:6379'}")
    assert engine_spec(topo, "prefill").bind_host is None


def test_trust_remote_code_reaches_the_engines_only_when_the_topology_says_so() -> None:
    h200 = load_topology(LOCAL.with_name("h200-kimi-k2.yaml"))
    assert h200.model.trust_remote_code
    assert all(
        engine_spec(h200, role).engine_args["trust_remote_code"] is True for role in ("prefill", "decode")
    )
    assert "trust_remote_code" not in engine_spec(load_topology(LOCAL), "decode").engine_args


def test_kv_dtype_and_weight_quantization_reach_both_pools_alike() -> None:
    topo = parse_topology("model: {kv_cache_dtype: fp8, quantization: fp8}")
    for role in ("prefill", "decode"):
        args = engine_spec(topo, role).engine_args
        assert (args["kv_cache_dtype"], args["quantization"]) == ("fp8", "fp8")
    defaults = engine_spec(parse_topology(""), "decode").engine_args
    assert "kv_cache_dtype" not in defaults and "quantization" not in defaults  # vLLM's own


def test_ngram_speculation_runs_on_decode_only() -> None:
    topo = parse_topology("pools: {decode: {speculative: {method: ngram, num_speculative_tokens: 4}}}")
    assert engine_spec(topo, "decode").engine_args["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 4,
    }
    assert "speculative_config" not in engine_spec(topo, "prefill").engine_args


def test_a_drafter_with_kv_of_its_own_runs_on_prefill_too() -> None:
    """EAGLE and MTP keep drafter KV for the prompt: prefill computes it with the prompt's, and vLLM's NIXL
    handshake requires both sides to run the same drafter (the H200 example: EAGLE-3, an fp8 KV cache)."""
    h200 = load_topology(LOCAL.with_name("h200-kimi-k2.yaml"))
    expected = {"method": "eagle3", "num_speculative_tokens": 3, "model": "/models/Kimi-K2-Thinking-eagle3"}
    for role in ("prefill", "decode"):
        args = engine_spec(h200, role).engine_args
        assert args["speculative_config"] == expected and args["kv_cache_dtype"] == "fp8"
        assert args["quantization"] == "compressed-tensors"
