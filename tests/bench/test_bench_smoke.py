"""Smoke tests of the benchmarks: ``python -m bench <name> --quick --json`` as a subprocess.

Each prints exactly one JSON object on stdout; the quick runs take a few seconds on one thread.
The numbers of the full runs are in docs/BENCHMARKS.md.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str, timeout: float = 120) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout.strip()
    assert out.count("\n") == 0, f"expected exactly one JSON line on stdout, got:\n{out[:2000]}"
    return json.loads(out)


def test_overhead_quick_json():
    res = run_bench("overhead", "--quick", "--json", "--threads", "1")
    for key in ("per_layer_ratio", "per_token_ratio", "plain_step_ms", "per_layer_step_ms", "per_token_step_ms",
                "rounds", "tokens_per_step", "d_model", "n_layers", "torch_threads"):
        assert key in res, key
    # a tiny model on a possibly busy machine: only sanity, not the targets (see docs/BENCHMARKS.md)
    assert 0.5 < res["per_layer_ratio"] < 20
    assert 0.5 < res["per_token_ratio"] < 20
    assert res["plain_step_ms"] > 0 and res["rounds"] == 10 and res["torch_threads"] == 1
    assert res["updates_identical"], "monitoring changed the optimizer update"


def test_overhead_profile_quick_json():
    res = run_bench("overhead", "--quick", "--profile", "--json", "--threads", "1")
    fns = res["functions_ms_per_step"]
    assert set(fns) == {"per_layer", "per_token"}
    assert "Monitor.end_step (all of it)" in fns["per_layer"]
    assert any(k.startswith("LinearRule.score") for k in fns["per_token"])
    assert not any(k.startswith("LinearRule") for k in fns["per_layer"])  # no token hooks per-layer


def test_localization_quick_json():
    res = run_bench("localization", "--quick", "--json")
    for key in ("recall", "precision", "probes_max", "probes_median", "explained_share_min",
                "bisection_probes_median", "bisection_recall", "bisection_all_probes_median",
                "bisection_all_recall", "scenarios", "spikes"):
        assert key in res, key
    assert 0.0 <= res["recall"] <= 1.0 and 0.0 <= res["bisection_recall"] <= 1.0
    assert res["precision"] is None or 0.0 <= res["precision"] <= 1.0
    assert {r["scenario"] for r in res["scenarios"]} == {"single", "three_mb", "label", "advantage", "diffuse"}
    diffuse = res["per_scenario"]["diffuse"]
    assert diffuse["statuses"] == {"diffuse": 1} and diffuse["tokens_named"] == 0 and diffuse["probes_max"] <= 3
    assert all(r["grads_restored"] for r in res["scenarios"])
    assert res["spikes"] == len(res["scenarios"]), [r["kinds"] for r in res["scenarios"]]
    # what the quick run measured when this test was written: every planted culprit found in <= 3 probes
    assert res["recall"] == 1.0 and res["probes_max"] <= 3
    # the baseline needs a micro-batch scan plus 2 probes per split
    assert res["bisection_probes_median"] > res["probes_median"]
    assert res["bisection_all_recall"] >= res["bisection_recall"]


@pytest.mark.parametrize("name", ["overhead", "localization"])
def test_human_table(name):
    args = [name, "--quick"] + (["--threads", "1"] if name == "overhead" else [])
    proc = subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "gradloc" in proc.stdout or "per_token" in proc.stdout
