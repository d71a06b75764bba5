#!/usr/bin/env bash
# Generates the Python gRPC stubs for pdserve's public API (proto/pdserve/v1/pdserve.proto) into pdserve_client/api/.
#   scripts/gen_protos.sh           regenerate pdserve_client/api/pdserve_pb2{.py,.pyi,_grpc.py}
#   scripts/gen_protos.sh --check   regenerate into a temp dir; exit 1 if pdserve_client/api is stale
# The stubs are committed so that importing router needs no code generation at run time.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
PROTO_DIR="proto/pdserve/v1"
OUT_DIR="pdserve_client/api"
GENERATED=(pdserve_pb2.py pdserve_pb2.pyi pdserve_pb2_grpc.py)

generate() {
  local out="$1"
  "$PYTHON" -m grpc_tools.protoc -I "$PROTO_DIR" \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    "$PROTO_DIR/pdserve.proto"
  # protoc writes `import pdserve_pb2 as ...`, which only works with pdserve_client/api on sys.path;
  # a relative import makes `from pdserve_client.api import pdserve_pb2_grpc` work.
  sed -i 's/^import pdserve_pb2 as /from . import pdserve_pb2 as /' "$out/pdserve_pb2_grpc.py"
}

case "${1:-}" in
  "")
    generate "$OUT_DIR"
    echo "generated ${GENERATED[*]} in $OUT_DIR"
    ;;
  --check)
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    generate "$tmp"
    stale=()
    for f in "${GENERATED[@]}"; do
      cmp -s "$tmp/$f" "$OUT_DIR/$f" || stale+=("$OUT_DIR/$f")
    done
    if ((${#stale[@]})); then
      echo "stale gRPC stubs: ${stale[*]} differ from $PROTO_DIR/pdserve.proto;" \
        "run scripts/gen_protos.sh and commit the result" >&2
      exit 1
    fi
    echo "gRPC stubs in $OUT_DIR are up to date"
    ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac
