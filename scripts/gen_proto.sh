#!/usr/bin/env bash
# Regenerate the Python code of the wire schema: proto/**/*.proto -> gradloc/transport/_generated/.
# Run it after editing a .proto and commit both; tests/transport/test_generated_code.py fails when the
# committed generated files differ from what this script produces.
#
# Usage: scripts/gen_proto.sh [OUT_DIR]
#   OUT_DIR defaults to gradloc/transport/_generated (relative to the repository root; the drift
#   test passes an absolute temporary directory). PYTHON overrides the interpreter (.venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=${1:-gradloc/transport/_generated}
mkdir -p "$out"
mapfile -t protos < <(find proto -name '*.proto' | LC_ALL=C sort)
"$PY" -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "${protos[@]}"
# protoc writes cross-file imports after the .proto path (`from gradloc.v1 import gradloc_pb2`).
# Here that package lives under gradloc.transport._generated, so make them absolute imports of it
# (the .proto paths, and so the descriptor names every other language sees, stay gradloc/v1/...).
find "$out/gradloc" \( -name '*.py' -o -name '*.pyi' \) -print0 \
  | xargs -0 sed -i 's/^from gradloc\.v1 import /from gradloc.transport._generated.gradloc.v1 import /'
# Package markers, so the generated modules import as real packages.
find "$out/gradloc" -type d -exec sh -c ': > "$1/__init__.py"' _ {} \;
