"""Run a test tier that lives in its own virtual environment (the real-vLLM and real-verl tiers) from the
main test run: that environment's interpreter runs the tier's pytest as a subprocess under a timeout, and a
failure fails here with its output. Nothing is installed here: installs belong to set-up (network, minutes,
idempotent by stamp; scripts/setup.sh runs the tier's script), not to a test where an install failure would
read as a test failure. A missing environment fails with the command to run, unless the run opted out with
the tier's skip variable (then the test is skipped, and says so)."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tail(text: str, n: int = 6000) -> str:
    return text if len(text) <= n else "…" + text[-n:]


def run_tier(name: str, venv: str, tier: str, *, setup: str, skip_var: str, timeout_s: int,
             pytest_args: tuple[str, ...] = ()) -> tuple[int, str]:
    """Run ``tier`` (a tests folder) with ``venv``'s interpreter; once every test in it passed (none skipped, at
    least one run), returns how many passed and its output."""
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        if os.environ.get(skip_var) == "1":
            pytest.skip(f"{skip_var}=1: the {name} tier was opted out of")
        pytest.fail(f"{python} is missing: run `bash {setup}` (scripts/setup.sh runs it; {skip_var}=1 skips the tier)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("VIRTUAL_ENV", None)
    cmd = [str(python), "-m", "pytest", "-q", "--tb=short", *pytest_args, "-p", "no:cacheprovider", tier]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        pytest.fail(f"the {name} tier ran past {timeout_s} s: {' '.join(cmd)}\n{_tail(out)}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the {name} tier failed (exit {proc.returncode}): {' '.join(cmd)}\n{_tail(out)}"
    summary = re.search(r"(\d+) passed", out)
    assert summary and int(summary.group(1)) > 0, f"the {name} tier passed no test:\n{_tail(out)}"
    assert " failed" not in out and " skipped" not in out, f"the {name} tier skipped or failed tests:\n{_tail(out)}"
    print(f"\n{summary.group(0)} in {tier} ({venv})")
    return int(summary.group(1)), out


__all__ = ["run_tier"]
