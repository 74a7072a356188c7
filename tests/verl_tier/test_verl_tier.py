"""Bridge from the main test run to the real-verl tier.

The tier needs verl 0.9.1 and its own transformers/tensordict/ray stack (~1.9 GB), so it lives in
``.venv-verl`` (``scripts/setup_verl.sh``, run by ``scripts/setup.sh``). This test, collected in the main venv,
runs ``tests/verl_tier/inside`` with that environment's interpreter as a subprocess under a timeout and
fails with its output when it fails. It installs nothing: installs belong to set-up (network, minutes,
idempotent by stamp), not to a test. A missing ``.venv-verl`` fails the test with the command to run,
unless the run opted out with ``GRADLOC_SKIP_VERL=1`` (then it is skipped, and says so).
"""
from __future__ import annotations

import pytest

from tests.tier import run_tier
from tests.verl_tier._env import HAS_VERL

pytestmark = pytest.mark.verl


@pytest.mark.skipif(HAS_VERL, reason="inside .venv-verl the tier's tests are collected and run directly")
def test_real_verl_tier_passes_in_its_own_environment():
    # the tier takes 40–105 s here (two gloo launches, each importing verl)
    passed, _ = run_tier("verl", ".venv-verl", "tests/verl_tier/inside", setup="scripts/setup_verl.sh",
                         skip_var="GRADLOC_SKIP_VERL", timeout_s=540)
    assert passed >= 5, f"the tier ran {passed} tests; tests/verl_tier/inside defines 5"  # none went missing
