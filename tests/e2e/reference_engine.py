"""The baseline for output equivalence: the same model served by ONE plain vLLM engine (no KV connector,
no disaggregation, no Ray, no speculation), greedy. Run as a subprocess: JSON list of {prompt_token_ids,
max_tokens} on stdin, JSON list of generated token id lists on stdout. `--kv-cache-dtype D`: the engine's KV
cache dtype (default: the model's)."""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")


def main() -> None:
    from vllm import LLM, SamplingParams

    from engine.tiny_model import ensure_tiny_model

    requests = json.load(sys.stdin)
    args = sys.argv[1:]
    kv_cache_dtype = args[args.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in args else "auto"
    llm = LLM(
        model=str(ensure_tiny_model()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        block_size=32,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    outputs = []
    for r in requests:  # one at a time: the same batch shape as the cluster's sequential requests
        params = SamplingParams(
            temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=r.get("ignore_eos", False)
        )
        (out,) = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]}], params, use_tqdm=False)
        outputs.append(list(out.outputs[0].token_ids))
    print("REFERENCE_OUTPUT " + json.dumps(outputs), flush=True)


if __name__ == "__main__":
    main()
