#!/usr/bin/env bash
# The test suite's set-up (the README's second command; .ci/run): a virtual environment in .venv with
# gradloc, every extra and the test tools, torch pinned to the local CPU build through constraints.txt, the
# Debian binaries the integration tests drive, and the vLLM and verl tiers' own environments. The demo needs
# none of this beyond scripts/setup_demo.sh, which runs first. Safe to re-run: each part checks what is already
# there and does nothing when it is.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the integration tests use. Only the binaries are used; no service is started.
#   prometheus: Prometheus 2.42 and promtool (real scrapes, rule checks)
#   chromium: the incident page's browser test (driven by Playwright; /usr/lib/chromium/chromium)
#   postgresql: PostgreSQL 15's initdb/pg_ctl/postgres (/usr/lib/postgresql/15/bin): the PostgreSQL store tier
#     starts a server of its own per test session (tests/postgres.py); the package's own cluster is left as
#     the package leaves it
apt_packages=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || apt_packages+=(prometheus)
[ -x /usr/lib/chromium/chromium ] || apt_packages+=(chromium)
[ -x /usr/lib/postgresql/15/bin/initdb ] && [ -x /usr/lib/postgresql/15/bin/pg_ctl ] || apt_packages+=(postgresql)
if [ ${#apt_packages[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo -n"; else SUDO=none; fi
  if [ "$SUDO" != none ] && command -v apt-get >/dev/null; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
  else
    echo "setup: ${apt_packages[*]} missing and no root/apt-get; the tests that need them will fail" >&2
  fi
fi

# .venv with gradloc and the demo extra (the demo command's whole set-up); the rest adds to it
bash scripts/setup_demo.sh
stamp=.venv/.gradloc-setup
want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # datasets/fsspec pinned here only (not in constraints.txt, which the verl and vLLM tiers share): lightning's
  # fsspec[http] requirement sent pip's resolver backtracking through every datasets release on a fresh venv
  # (over 12 min); the versions the tests were verified with resolve at once
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[demo,test,hf,bench,bench-peers,titan,postgres]" \
    "datasets==4.7.0" "fsspec==2026.2.0"
  # backpack-for-pytorch (bench-peers) requires torchvision, but uses it only in an examples module.
  # PyPI's torchvision build does not load against the CPU torch served here ("operator
  # torchvision::nms does not exist"), and transformers then fails to import any model: remove it
  # when it cannot be imported.
  if .venv/bin/python -m pip show -q torchvision 2>/dev/null && ! .venv/bin/python -c "import torchvision" 2>/dev/null; then
    .venv/bin/python -m pip uninstall --quiet -y torchvision
  fi
  # DeepSpeed (the deepspeed extra; tests/distributed/test_deepspeed_*): an sdist whose setup.py imports
  # torch, so it builds against the venv's pinned torch (no build isolation: an isolated build would
  # pull an unpinned CUDA torch) with no compiled ops (DS_BUILD_OPS=0; the one op it needs on CPU, the
  # shm comm op, is JIT-built into .torch_extensions/ by the step below, once).
  if ! .venv/bin/python -c "import deepspeed" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet setuptools wheel
    DS_BUILD_OPS=0 .venv/bin/python -m pip install --quiet --no-build-isolation -c constraints.txt -e ".[deepspeed]"
  fi
  # megatron-core 0.19.2 (tests/collector/rules/test_megatron_rule.py, tests/distributed/test_megatron.py;
  # DESIGN.md §8): it declares Python >= 3.12 although a cp311 wheel exists, and imports triton at load
  # without declaring it, so: what it imports first (numpy, packaging, triton; torch stays pinned), then the
  # package alone (--no-deps --ignore-requires-python). Its tensor-parallel layers import on CPU without any
  # shim (the check below); one all-gather needs one to run there (tests/distributed/megatron_job.py).
  if ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('megatron-core') == '0.19.2'" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet -c constraints.txt numpy packaging triton
    .venv/bin/python -m pip install --quiet -c constraints.txt --no-deps --ignore-requires-python megatron-core==0.19.2
    NO_VCS_VERSION=1 .venv/bin/python -W ignore -c "import megatron.core.tensor_parallel"
  fi
  echo "$want" > "$stamp"
fi

# The vLLM and verl tiers' own environments (.venv-vllm ~3.4 GB, .venv-verl ~1.9 GB; no-ops when up to date; see
# scripts/setup_vllm.sh, setup_verl.sh) install side by side with the rest of this script — downloads and unpacking
# more than CPU: one after the other, a fresh machine's set-up took 716 s (5 min .venv, 3.6 verl, 3.4 vLLM), side by
# side 325 s. They start after the last build of this checkout into .venv (the tiers' own builds of it take turns:
# flock). Each one's output is printed when it ends; a failed tier fails the set-up. GRADLOC_SKIP_VERL=1 /
# GRADLOC_SKIP_VLLM=1 leave one out (its tests then skip).
tier_logs=$(mktemp -d)
tier_jobs=()
trap 'for j in "${tier_jobs[@]}"; do kill "${j#*:}" 2>/dev/null || true; done; rm -rf "$tier_logs"' EXIT
start_tier() {  # $1: the tier's name, $2: its set-up script
  bash "$2" > "$tier_logs/$1.log" 2>&1 &
  tier_jobs+=("$1:$!")
}
if [ "${GRADLOC_SKIP_VERL:-0}" != 1 ]; then start_tier verl scripts/setup_verl.sh; fi
if [ "${GRADLOC_SKIP_VLLM:-0}" != 1 ]; then start_tier vllm scripts/setup_vllm.sh; fi

# DeepSpeed JIT-builds a CPU shm comm op the first time an engine starts (1.5-3 min on 2 cores). Build
# it once here, inside the workspace (TORCH_EXTENSIONS_DIR=.torch_extensions, gitignored), where the
# tests look for it (tests/distributed/ds_common.py), so no test's deadline pays for the build.
if [ ! -f .torch_extensions/deepspeed_shm_comm/deepspeed_shm_comm.so ] && .venv/bin/python -c "import deepspeed" 2>/dev/null; then
  TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions" .venv/bin/python -c \
    "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None" >/dev/null
fi

# --- RL framework integrations (gradloc/integrations: OpenRLHF, verl) ---------------------------------
# OpenRLHF 0.11.2 for tests/integrations/distributed/test_openrlhf_zero.py (its Experience, PolicyLoss, Actor and
# DeepspeedStrategy around a real ZeRO-2 engine), installed into .venv with --no-deps: a full install
# cannot work here (flash-attn builds from source) and would replace .venv's transformers 5.2x by 5.15 and
# its deepspeed by 0.19.6. What the test imports needs only torch, transformers, deepspeed, sympy (already
# in .venv), peft and pylatexenc (added, also --no-deps: their own dependencies are all in .venv) and
# flash_attn (a stub in the test). About 10 MB, 3 s; nothing else in .venv changes (checked: pip list).
# Its wheel also installs a top-level `tests` package into site-packages. A regular package there wins
# over this repository's `tests` (a namespace package, no __init__.py) whatever sys.path says, and every
# `from tests.… import …` of the suite would then fail: it is removed (nothing imports OpenRLHF's tests).
if ! .venv/bin/python -m pip show -q openrlhf peft pylatexenc >/dev/null 2>&1; then
  .venv/bin/python -m pip install --quiet --no-deps openrlhf==0.11.2 peft==0.21.2 pylatexenc==2.11
fi
site_packages=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -f "$site_packages/tests/__init__.py" ]; then
  rm -rf "$site_packages/tests"
fi
# the tiers started above
failed=0
for j in "${tier_jobs[@]}"; do
  if wait "${j#*:}"; then
    cat "$tier_logs/${j%%:*}.log"
  else
    echo "setup: the ${j%%:*} tier's set-up failed:" >&2
    cat "$tier_logs/${j%%:*}.log" >&2
    failed=1
  fi
done
tier_jobs=()
exit $failed
