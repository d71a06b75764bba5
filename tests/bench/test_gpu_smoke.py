"""The GPU smoke test's parts that run without a GPU: its topology is one pdserve accepts and compiles to one
GPU per engine (two GPUs or more) or half of one GPU each (one GPU), KV moved from CUDA memory; on a machine
without a GPU it says so and exits 2 (scripts/gpu_smoke.sh is for GPU machines; on this CPU machine it has not
run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.gpu_smoke import topology
from cluster.serve_app import engine_spec
from cluster.serve_config import compile_serve_config
from cluster.topology_file import parse_topology


@pytest.mark.parametrize(("gpus", "per_engine"), [(1, 0.5), (2, 1.0), (8, 1.0)])
def test_its_topology_places_both_engines_on_the_gpus_there_are_moving_kv_from_cuda_memory(
    gpus: int, per_engine: float
) -> None:
    topo = parse_topology(topology(50051, 9400, 8265, gpus))
    assert topo.router.mode == "disaggregate"  # every request takes the P -> NIXL -> D path
    for role in ("prefill", "decode"):
        spec = engine_spec(topo, role)
        assert (spec.device, spec.kv_transfer) == ("cuda", True)
        # Both engines together within one GPU's memory, and the reference engine after them.
        assert spec.engine_args["gpu_memory_utilization"] == 0.3
    (app,) = compile_serve_config(topo)["applications"]
    for deployment in app["deployments"]:
        if deployment["name"] in ("prefill", "decode"):
            (bundle,) = deployment["placement_group_bundles"]
            assert bundle["GPU"] == per_engine == deployment["ray_actor_options"]["num_gpus"]


def test_without_a_gpu_it_says_what_it_needs_and_exits_2() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu_smoke"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2
    assert "needs an NVIDIA GPU (found none" in run.stderr


def test_its_second_run_has_an_fp8_kv_cache_in_both_pools_and_speculation_on_decode_only() -> None:
    topo = parse_topology(topology(50051, 9400, 8265, 2, reduced=True))
    prefill, decode = (engine_spec(topo, role).engine_args for role in ("prefill", "decode"))
    assert prefill["kv_cache_dtype"] == decode["kv_cache_dtype"] == "fp8"
    assert decode["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert "speculative_config" not in prefill
    assert (
        "kv_cache_dtype"
        not in engine_spec(parse_topology(topology(50051, 9400, 8265, 2)), "decode").engine_args
    )
