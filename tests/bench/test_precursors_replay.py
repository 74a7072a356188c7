"""``python -m bench precursors --save`` / ``--replay`` (bench/precursors_replay.py): a replay of a real run's
series under the live run's drift settings makes the live run's findings, step for step; other settings are scored
from the saved runs without training."""
from __future__ import annotations

import json

import pytest

from bench import precursors_replay as replaying
from bench.precursors import main
from bench.precursors_runs import record_run, scenarios
from gradloc.config import DriftConfig, PrecursorConfig

# a short Llama ramp (LR 1e-4 -> 0.1 over 300 steps) under a detector that speaks early: findings within the run
FAST = DriftConfig(warmup=60, reference=60, window=20, patience=5, z_threshold=3.0, page_steps=40, references=())


def _key(f) -> tuple:  # noqa: ANN001 - a PrecursorFinding
    d = [(x.step, x.micro_batch, x.sample, x.position) for x in f.drivers]
    return f.step, f.statistic, f.layer, f.head, str(f.trend), f.pages, f.since_step, round(f.z, 9), d


@pytest.fixture(scope="module")
def llama_run() -> dict:
    sc = next(s for s in scenarios(300) if s.name == "llama_ramp")
    return record_run(sc, precursors=PrecursorConfig(drift=FAST))


def test_a_replay_at_the_live_settings_makes_the_live_findings(llama_run: dict) -> None:
    live = llama_run["findings"]
    assert len(live) >= 2, [(f.step, f.statistic) for f in live]  # the run speaks: something to compare
    replayed = replaying.replay(llama_run, FAST)
    assert sorted(map(_key, replayed)) == sorted(map(_key, live))
    # other settings, other findings: the replay follows its settings
    assert replaying.replay(llama_run, DriftConfig(warmup=60, reference=60, window=20, z_threshold=1e6)) == []


def test_saved_runs_are_scored_again_under_other_settings(llama_run: dict, tmp_path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    replaying.save(llama_run, tmp_path)
    assert main(["--replay", str(tmp_path), "--json", "--drift", "warmup=60", "reference=60", "window=20",
                 "patience=5", "z_threshold=3", "page_steps=40", "references=none"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["replayed"] and res["drift"]["z_threshold"] == 3.0 and res["drift"]["warmup"] == 60
    (row,) = res["runs"]
    live = sorted((f.step, f.statistic, f.layer) for f in llama_run["findings"])
    assert sorted((f["step"], f["statistic"], f["layer"]) for f in row["findings"]) == live
    assert main(["--replay", str(tmp_path), "--json", "--drift", "z_threshold=1e6"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["findings"] == []
    assert main(["--replay", str(tmp_path), "--json", "--drift", "references=attn_entropy:700,rl_entropy:800"]) == 0
    assert json.loads(capsys.readouterr().out)["drift"]["references"] == {"attn_entropy": 700, "rl_entropy": 800}
    for bad in (["--replay", str(tmp_path), "--drift", "references=attn_entropy"],
                ["--replay", str(tmp_path), "--drift", "references=loss:900"],
                ["--replay", str(tmp_path), "--drift", "statistics=x"], ["--replay", str(tmp_path), "--drift", "z=1"],
                ["--replay", str(tmp_path), "--drift", "window=0"], ["--drift", "window=5"],
                ["--replay", str(tmp_path / "none")], ["--replay", str(tmp_path), "--set", "lr_end=1"]):
        with pytest.raises(SystemExit):
            main(bad)
