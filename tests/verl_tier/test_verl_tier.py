"""Bridge from the main test run to the real-verl tier.

The tier needs verl 0.9.1 and its own transformers/tensordict/ray stack (~1.9 GB), so it lives in
``.venv-verl`` (``scripts/setup_verl.sh``, run by ``scripts/setup.sh``). This test, collected in the main venv,
runs ``tests/verl_tier/inside`` with that environment's interpreter as a subprocess under a timeout and
fails with its output when it fails. It installs nothing: installs belong to set-up (network, minutes,
idempotent by stamp), not to a test. A missing ``.venv-verl`` fails the test with the command to run,
unless the run opted out with ``GRADLOC_SKIP_VERL=1`` (then it is skipped, and says so).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.verl_tier._env import HAS_VERL

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
TIER = "tests/verl_tier/inside"
TIMEOUT_S = 540  # the tier takes 40–105 s here (two gloo launches, each importing verl)


def _tail(text: str, n: int = 6000) -> str:
    return text if len(text) <= n else "…" + text[-n:]


@pytest.mark.skipif(HAS_VERL, reason="inside .venv-verl the tier's tests are collected and run directly")
def test_real_verl_tier_passes_in_its_own_environment():
    if not VENV_PYTHON.exists():
        if os.environ.get("GRADLOC_SKIP_VERL") == "1":
            pytest.skip("GRADLOC_SKIP_VERL=1: the real-verl tier was opted out of")
        pytest.fail(f"{VENV_PYTHON} is missing: run `bash scripts/setup_verl.sh` (scripts/setup.sh runs it; "
                    "GRADLOC_SKIP_VERL=1 skips the tier)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("VIRTUAL_ENV", None)
    cmd = [str(VENV_PYTHON), "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", TIER]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        pytest.fail(f"the verl tier ran past {TIMEOUT_S} s: {' '.join(cmd)}\n{_tail(out)}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the verl tier failed (exit {proc.returncode}): {' '.join(cmd)}\n{_tail(out)}"
    summary = re.search(r"(\d+) passed", out)
    assert summary and int(summary.group(1)) > 0, f"the verl tier passed no test:\n{_tail(out)}"
    assert " failed" not in out and " skipped" not in out, f"the verl tier skipped or failed tests:\n{_tail(out)}"
    sys.stdout.write(f"\n{summary.group(0)} in {TIER} ({VENV_PYTHON.parent.parent.name})\n")
