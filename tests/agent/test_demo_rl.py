"""The RL demo through the real CLI: `gradloc-agent demo --rl --json`, both RL plants, padded and packed.

Short runs (40 steps, the plant at step 35, after the detector's 25-step warm-up) keep the module
fast; the default 200-step run is the one the README shows.
"""
from __future__ import annotations

import json
import math
import resource
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gradloc.agent.cli import main
from gradloc.demo.arith import CHARS
from gradloc.demo.rl import RLDemoConfig
from gradloc.errors import ConfigError

SHORT = ("--steps", "40", "--inject-step", "35")
CLASS = {"mismatch": "train_inference_mismatch", "advantage": "low_prob_high_advantage"}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_json(tmp_path, *args: str) -> tuple[dict, float]:
    """The demo's JSON and the CPU time it used (robust to other load on the machine, unlike wall time)."""
    start = _cpu_seconds()
    out = subprocess.run([sys.executable, "-m", "gradloc.agent.cli", "demo", "--rl", "--json",
                          "--db", str(tmp_path / "incidents.db"), *args],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout), _cpu_seconds() - start


@pytest.mark.parametrize("inject,layout,seed", [("mismatch", "padded", 0), ("mismatch", "packed", 1),
                                                ("advantage", "padded", 3), ("advantage", "packed", 4)])
def test_rl_demo_locates_and_classifies_the_plant(tmp_path, inject: str, layout: str, seed: int) -> None:
    flags = ["--packed"] if layout == "packed" else []
    doc, cpu = _run_json(tmp_path, "--inject", inject, "--seed", str(seed), *SHORT, *flags)
    assert cpu < 60, f"a 40-step RL demo used {cpu:.1f} CPU-seconds"  # measured ~5-9 CPU-s
    assert set(doc) == {"planted", "incidents"}
    (planted,) = doc["planted"]
    assert set(planted) == {"rank", "micro_batch", "sample", "position", "token_id", "kind"} and planted["kind"] == inject
    at_plant = [inc for inc in doc["incidents"] if inc["step"] == 35]
    assert len(at_plant) == 1, doc["incidents"]
    inc = at_plant[0]
    assert inc["status"] == "located" and 1 <= inc["probes"] <= 3
    top = inc["culprits"][0]
    assert (top["micro_batch"], top["sample"], top["position"], top["token_id"]) == (
        planted["micro_batch"], planted["sample"], planted["position"], planted["token_id"])
    assert top["text"] == CHARS[planted["token_id"]] and top["text"].strip()
    assert top["share"] > 0.8 and inc["explained_share"] > 0.8  # measured 0.95-1.02 over seeds 0-7
    assert top["classification"]["kind"] == CLASS[inject] and inc["classification"]["kind"] == CLASS[inject]
    rl = top["rl"]
    assert {"logp", "rollout_logp", "old_logp", "advantage", "ratio", "clipped", "log_ratio"} <= set(rl)
    assert rl["ratio"] == pytest.approx(1.0, abs=1e-4) and rl["clipped"] is False  # one update per batch
    if inject == "mismatch":
        assert rl["log_ratio"] == pytest.approx(8.0, abs=1e-3)  # π_old − π_rollout: the planted 8 nats
    else:
        assert rl["advantage"] == 50.0 and math.exp(rl["logp"]) <= 0.05
        assert abs(rl["log_ratio"]) < 1e-3  # trainer and sampler agree on the token
    info = top["sample_info"]
    assert info["request_id"].startswith("s35-p") and info["prompt_tokens"] == 5
    assert info["response_start"] <= top["position"] < info["response_start"] + info["response_tokens"]


def test_rl_demo_without_a_plant_reports_none(tmp_path) -> None:
    doc, _ = _run_json(tmp_path, "--inject", "none", "--steps", "30", "--inject-step", "26",
                       "--micro-batches", "1", "--job", "rl-x")
    assert doc["planted"] == []
    assert all(inc["step"] < 30 for inc in doc["incidents"])


def test_rl_demo_human_output_shows_the_rollout_and_class(tmp_path) -> None:
    res = CliRunner().invoke(main, ["demo", "--rl", "--seed", "2", *SHORT, "--db", str(tmp_path / "i.db")])
    assert res.exit_code == 0, res.output
    assert "planted (mismatch) at step 35" in res.output and "planted culprit: found (1/1" in res.output
    assert "class: train_inference_mismatch" in res.output
    assert "rollout: request 's35-p" in res.output and "log π_trainer−π_rollout +8" in res.output
    assert "=[[" in res.output  # the culprit bracketed right after its prompt's "="


def test_rl_config_is_validated() -> None:
    RLDemoConfig()  # the defaults are valid
    for bad in (dict(inject="label"), dict(steps=10, inject_step=50), dict(inject_step=20), dict(n=1),
                dict(micro_batches=9), dict(micro_batches=0), dict(threads=0), dict(mismatch=0.0),
                dict(sft_steps=-1)):
        with pytest.raises(ConfigError):
            RLDemoConfig(**bad)


@pytest.mark.parametrize("args,needle", [(["--rl", "--inject", "label"], "inject must be one of"),
                                         (["--packed"], "--packed needs --rl"),
                                         (["--inject", "mismatch"], "inject must be one of"),
                                         (["--rl", "--micro-batches", "9"], "micro_batches")])
def test_rl_demo_rejects_bad_flags_with_a_clear_message(args: list[str], needle: str) -> None:
    res = CliRunner().invoke(main, ["demo", *args])
    assert res.exit_code == 2 and needle in res.output, res.output
