"""The GPU smoke test's parts that run without a GPU: its topology is one pdserve accepts and compiles to one
GPU per engine with KV moved from CUDA memory, and on a machine without two GPUs it says so and exits 2
(scripts/gpu_smoke.sh is for GPU machines; on this CPU machine it has not run)."""

from __future__ import annotations

import subprocess
import sys

from bench.gpu_smoke import topology
from cluster.serve_app import engine_spec
from cluster.serve_config import compile_serve_config
from cluster.topology_file import parse_topology


def test_its_topology_puts_each_engine_on_a_gpu_of_its_own_moving_kv_from_cuda_memory() -> None:
    topo = parse_topology(topology(50051, 9400, 8265))
    assert topo.router.mode == "disaggregate"  # every request takes the P -> NIXL -> D path
    for role in ("prefill", "decode"):
        spec = engine_spec(topo, role)
        assert (spec.device, spec.kv_transfer) == ("cuda", True)
        assert spec.engine_args["gpu_memory_utilization"] == 0.3  # room for the reference engine beside
    (app,) = compile_serve_config(topo)["applications"]
    for deployment in app["deployments"]:
        if deployment["name"] in ("prefill", "decode"):
            (bundle,) = deployment["placement_group_bundles"]
            assert bundle["GPU"] == 1.0 and deployment["ray_actor_options"]["num_gpus"] == 1


def test_without_two_gpus_it_says_what_it_needs_and_exits_2() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu_smoke"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2
    assert "needs 2 NVIDIA GPUs, one per engine (found 0)" in run.stderr
