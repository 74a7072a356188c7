#!/usr/bin/env bash
# The real-verl test tier's environment: .venv-verl in the repo root (tests/verl_tier runs in it).
#
# Why a separate environment and not `pip install --no-deps verl` into .venv: the tier drives verl's
# own FSDP engine (FSDPEngineWithLMHead) on CPU, and `from verl import DataProto` alone imports ray,
# tensordict and hydra; the engine adds omegaconf, codetiming, peft and transformers internals. verl
# 0.9.1 requires transformers < 5.11 and tensordict <= 0.10, while .venv keeps transformers 5.2x for
# the other tests (docs/hf-trainer.md, TRL). A --no-deps install would have to hand-pick ~15 packages
# and still run verl against a transformers it does not support. So: its own venv, like .venv-vllm.
# Cost: 1.9 GB; from scratch 3.5 min wall (1.9 min CPU) on the shared 2-core machine at load 6-7, mostly
# unpacking torch (754 MB), ray, pyarrow and transformers; a no-op when the stamp matches
# (tests/verl_tier/README.md).
#
# Contents: verl==0.9.1 with its dependencies (ray, transformers 5.10, tensordict 0.10), torch pinned
# to the local CPU wheel through constraints.txt (an unpinned torch would pull multi-GB CUDA wheels),
# gradloc itself (editable, no extras), pytest and pytest-timeout.
# Idempotent by stamp (scripts/tier_venv.sh). Python: python3.11 from PATH, or $PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

TIER=verl
VENV=.venv-verl
VERL_SPEC="verl==0.9.1"
source scripts/tier_venv.sh
tier_begin scripts/setup_verl.sh

say "installing $VERL_SPEC, gradloc (editable) and ${EXTRA_TOOLS[*]}, torch pinned by constraints.txt"
pip_building_gradloc install --quiet --no-compile -c constraints.txt "$VERL_SPEC" -e . "${EXTRA_TOOLS[@]}" \
  || fail "pip install failed (see pip's output above); $VENV is left as is, re-run to retry"

# verl's wheel also installs a top-level `tests` package (its own unit tests) into site-packages. A regular
# package there wins over this repository's `tests`, a namespace package (no __init__.py), whatever the
# order of sys.path: `import tests.distributed` would then fail inside this environment. Nothing imports
# verl's tests, so they are removed.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -f "$site/tests/__init__.py" ]; then
  say "removing the top-level 'tests' package verl installs into $site (it shadows this repository's tests)"
  rm -rf "$site/tests"
fi

say "checking the environment imports"
versions=$("$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch, transformers, tensordict, verl, gradloc  # noqa: F401  (import check)
from verl import DataProto  # noqa: F401  (imports ray)
from verl.trainer.ppo import core_algos  # noqa: F401
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: F401
import tests.distributed.launch  # noqa: F401  (this repository's tests, not a site-packages one)
print(f"verl {md.version('verl')}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"tensordict {md.version('tensordict')}, ray {md.version('ray')}, gradloc {md.version('gradloc')}")
EOF
) || fail "the environment installed but importing verl/torch/transformers/gradloc fails (output above)"
say "$versions"

tier_done
