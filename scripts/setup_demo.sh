#!/usr/bin/env bash
# The demo's set-up (the README's first command): a virtual environment in .venv with gradloc and its `demo`
# extra only (torch pinned to the local CPU build through constraints.txt, tiktoken for the demo's tokenizer).
# No Debian packages, no test tiers, no second environments: those are scripts/setup.sh's (the test command),
# which runs this script first. Safe to re-run: a no-op until pyproject.toml, constraints.txt or this script
# changes.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.gradloc-setup-demo
want=$(cat pyproject.toml constraints.txt scripts/setup_demo.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # --no-compile: byte-compiling every installed module (torch's thousands) was over half the install's CPU time
  # (measured: 74 s CPU with, 31 s without); Python compiles what the demo imports when it first imports it
  .venv/bin/python -m pip install --quiet --no-compile -c constraints.txt -e ".[demo]"
  echo "$want" > "$stamp"
fi
