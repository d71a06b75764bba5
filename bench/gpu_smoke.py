"""The GPU smoke test (scripts/gpu_smoke.sh runs it): pdserve on NVIDIA GPUs, one prefill and one decode
engine on the built-in tiny model, checked against one plain vLLM engine.

1. `pdserve up` on a topology written for the machine: each engine on its own GPU (two GPUs or more), or
   both on half of one GPU each (one GPU); KV moves prefill -> decode with NIXL from CUDA memory
   (`kv_buffer_device: cuda`, vLLM's NixlConnector).
2. Prompts of several lengths, greedy, every one through the prefill -> NIXL -> decode path
   (`router.mode: disaggregate`); TTFT and TPOT from each request's final message.
3. The engines' own counters (the router's GetClusterStatus): the decode engine took the prompts' KV from
   outside (NIXL), and how many bytes moved.
4. `pdserve down`, then the same prompts through one vLLM engine with no connector: the token ids must be
   equal.
5. Again with an fp8 KV cache in both pools and ngram speculative decoding on decode, against one vLLM engine
   with the fp8 cache and no speculation: equal tokens, drafts accepted, and half the bytes a token of the
   bf16 run over NIXL. Prints one summary; exit 0 only if every check held.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from cluster.cli import READY_LINE

PROMPT_TOKENS = (16, 100, 500, 1500)
MAX_TOKENS = 32
UP_TIMEOUT_S = 900


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


# The second run: the reduced KV dtype in both pools, speculation on decode.
KV_DTYPE = "fp8"
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4}


def topology(
    grpc_port: int, metrics_port: int, dashboard_port: int, gpus: int, *, reduced: bool = False
) -> dict[str, Any]:
    """The smoke test's cluster; `reduced`: with the fp8 KV cache and ngram speculation."""
    gpu_pool: dict[str, Any] = {
        "replicas": 1,
        # A GPU each where there are two; else half of the one GPU each (pdserve's GPU shares).
        "gpus_per_replica": 1 if gpus >= 2 else 0.5,
        "cpus_per_replica": 2,
        # Small: the tiny model needs little KV, and starting is faster with less memory to profile. Within
        # half of the GPU, so that both engines fit on one.
        "engine": {"gpu_memory_utilization": 0.3, "enforce_eager": True},
    }
    model: dict[str, Any] = {
        "source": "builtin:tiny-llama",
        "name": "tiny-llama",
        "block_size": 16,
        "dtype": "bfloat16",
        "max_model_len": 2048,
    }
    decode: dict[str, Any] = dict(gpu_pool)
    if reduced:
        model["kv_cache_dtype"] = KV_DTYPE
        decode["speculative"] = SPECULATIVE
    return {
        "model": model,
        "pools": {"prefill": gpu_pool, "decode": decode},
        "router": {"mode": "disaggregate"},
        "server": {"grpc_port": grpc_port, "metrics_port": metrics_port},
        "ray": {"dashboard_port": dashboard_port, "placement_timeout_s": UP_TIMEOUT_S},
    }


def prompts(tokenizer_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    words = tok.encode(" ".join(f"word{i}" for i in range(4000)), add_special_tokens=False)
    return [words[i * 7 : i * 7 + n] for i, n in enumerate(PROMPT_TOKENS)]


def run_pd(topo_file: Path, target: str, requests: list[list[int]]) -> dict[str, Any]:
    from pdserve_client.sdk import PdserveClient

    pdserve = str(Path(sys.executable).with_name("pdserve"))
    up = subprocess.Popen(
        [pdserve, "up", "-f", str(topo_file)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    ready = threading.Event()
    log: list[str] = []

    def read() -> None:
        assert up.stdout is not None
        for line in up.stdout:
            log.append(line)
            if line.startswith(READY_LINE):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not ready.wait(1.0):
            if up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("pdserve up did not come up:\n" + "".join(log[-80:]))
        results = []
        with PdserveClient(target, timeout=300) as client:
            for ids in requests:
                c = client.generate_text(
                    token_ids=ids, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                )
                n = c.usage.completion_tokens
                results.append(
                    {
                        "prompt_tokens": len(ids),
                        "token_ids": c.token_ids,
                        "prefill_replica": c.served_by.prefill_replica,
                        "ttft_ms": c.timings.ttft_ms,
                        "tpot_ms": (c.timings.e2e_ms - c.timings.ttft_ms) / max(1, n - 1),
                    }
                )
            replicas = client.cluster_status()
        decode = [r for r in replicas if r.role == "decode"]
        return {
            "results": results,
            "external_kv_tokens": sum(r.prompt_tokens_external_kv for r in decode),
            "nixl_bytes": sum(r.nixl_bytes_transferred for r in decode),
            "spec_draft_tokens": sum(r.spec_draft_tokens for r in decode),
            "spec_accepted_tokens": sum(r.spec_accepted_tokens for r in decode),
        }
    finally:
        subprocess.run([pdserve, "down"], capture_output=True, timeout=300)
        up.wait(timeout=300)


def run_reference(
    model_dir: Path, requests: list[list[int]], kv_cache_dtype: str = "auto"
) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        block_size=16,
        max_model_len=2048,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in requests], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> int:
    from engine.ports import free_ports
    from engine.tiny_model import ensure_tiny_model

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    gpus = gpu_count()
    if gpus < 1:
        print("gpu smoke: needs an NVIDIA GPU (found none: nvidia-smi -L lists no GPU)", file=sys.stderr)
        return 2
    model_dir = ensure_tiny_model()
    requests = prompts(model_dir)
    runs: dict[str, dict[str, Any]] = {}
    for name, reduced in (("bf16", False), ("fp8+ngram", True)):
        grpc_port, metrics_port, dashboard_port = free_ports(3)
        with tempfile.TemporaryDirectory() as tmp:
            topo_file = Path(tmp) / "gpu-smoke.yaml"
            topo = topology(grpc_port, metrics_port, dashboard_port, gpus, reduced=reduced)
            topo_file.write_text(yaml.safe_dump(topo))
            runs[name] = run_pd(topo_file, f"127.0.0.1:{grpc_port}", requests)
    # One engine at a time: each reference after the clusters are down.
    reference = run_reference(model_dir, requests)
    reference_fp8 = run_reference(model_dir, requests, KV_DTYPE)
    pd, reduced_run = runs["bf16"], runs["fp8+ngram"]
    bytes_per_token = {name: r["nixl_bytes"] / max(1, r["external_kv_tokens"]) for name, r in runs.items()}
    checks = {
        "every request prefilled on the prefill engine": all(r["prefill_replica"] for r in pd["results"]),
        "decode took the prompts' KV over NIXL": pd["external_kv_tokens"] > 0 and pd["nixl_bytes"] > 0,
        "P/D tokens equal one vLLM engine's (greedy)": [r["token_ids"] for r in pd["results"]] == reference,
        "fp8 KV + ngram P/D tokens equal one fp8 engine's without speculation": [
            r["token_ids"] for r in reduced_run["results"]
        ]
        == reference_fp8,
        "the decode engine accepted speculative drafts": reduced_run["spec_accepted_tokens"] > 0,
        "fp8 KV moves half the bytes a token of bf16": abs(
            bytes_per_token["fp8+ngram"] / max(1.0, bytes_per_token["bf16"]) - 0.5
        )
        < 0.01,
    }
    placed = "one GPU each" if gpus >= 2 else "half of the one GPU each"
    print(f"pdserve GPU smoke: 1 prefill + 1 decode engine ({placed}) of {gpus}, tiny-llama bf16")
    print(f"{'run':>10} {'prompt':>8} {'TTFT ms':>9} {'TPOT ms':>9} {'equal':>6}")
    for name, expected in (("bf16", reference), ("fp8+ngram", reference_fp8)):
        for r, ref in zip(runs[name]["results"], expected, strict=True):
            same = "yes" if r["token_ids"] == ref else "NO"
            print(f"{name:>10} {r['prompt_tokens']:>8} {r['ttft_ms']:>9.1f} {r['tpot_ms']:>9.2f} {same:>6}")
        ttft = statistics.median(r["ttft_ms"] for r in runs[name]["results"])
        tpot = statistics.median(r["tpot_ms"] for r in runs[name]["results"])
        print(
            f"{name}: median TTFT {ttft:.1f} ms, TPOT {tpot:.2f} ms; KV over NIXL: "
            f"{runs[name]['nixl_bytes']} bytes, {bytes_per_token[name]:.0f} a token"
        )
    drafted = reduced_run["spec_draft_tokens"]
    if drafted:
        print(
            f"ngram: {reduced_run['spec_accepted_tokens'] / drafted:.0%} of {drafted} drafted tokens accepted"
        )
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "gpus": gpus,
                    "runs": runs,
                    "reference": reference,
                    "reference_fp8": reference_fp8,
                    "checks": checks,
                }
            )
        )
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
