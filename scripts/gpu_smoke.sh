#!/usr/bin/env bash
# On a machine with NVIDIA GPUs: install pdserve's GPU extra into .venv-gpu, then run bench/gpu_smoke.py
# (1 prefill + 1 decode engine on the tiny model, a GPU each or half of one GPU each, P/D output against one
# vLLM engine, KV over NIXL from CUDA memory, TTFT/TPOT). Exit 0 only if every check held.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-gpu scripts/install.sh gpu
.venv-gpu/bin/python -m bench.gpu_smoke "$@"
