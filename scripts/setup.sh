#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with gradloc and the test
# tools, torch pinned to the local CPU build through constraints.txt. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

# Prometheus 2.42 (Debian bookworm) for the integration tests and for scraping the daemon locally.
# Only the binaries are used; the package's service is never started (tests run their own).
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo -n"; else SUDO=none; fi
  if [ "$SUDO" != none ] && command -v apt-get >/dev/null; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "setup: prometheus/promtool missing and no root/apt-get; the Prometheus tests will fail" >&2
  fi
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.gradloc-setup
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[demo,test]"
  echo "$want" > "$stamp"
fi
# The real-vLLM test tier's own environment (.venv-vllm, ~3.4 GB, ~3 min on a fresh machine; a no-op
# when up to date). GRADLOC_SKIP_VLLM=1 leaves it out (tests/vllm/test_tier.py then skips).
if [ "${GRADLOC_SKIP_VLLM:-0}" != 1 ]; then
  bash scripts/setup_vllm.sh
fi
