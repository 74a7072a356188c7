"""Smoke test of the real-fault localization bench (``bench/faults.py``, ``python -m bench localization --faults``):
tiny sizes, one seed, two faults. It checks that the bench runs and reports its fields, and that an excursion (a
fault step branched off the healthy run) leaves the healthy run bit for bit as it was."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from bench.__main__ import main  # noqa: E402
from bench.faults import FaultsConfig, run_seed  # noqa: E402

FAULT_FIELDS = {"level", "injected", "detected", "located", "status", "levels", "sample_recall", "sample_precision",
                "token_recall", "token_precision", "iou_mean_located", "probes_median", "probes_max", "passes_max",
                "outlier_hits", "outlier_planted", "aftershocks"}
ROW_FIELDS = {"fault", "seed", "step", "level_planted", "planted", "detected", "kinds", "status", "level", "probes",
              "passes", "named", "named_planted", "tokens_planted", "tokens_named", "tokens_hit", "iou",
              "outlier_hits", "norm_ratio"}


def test_faults_bench_runs_and_reports_its_fields(capsys):
    assert main(["localization", "--faults", "--quick", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["faults"]) == {"random_ids", "planted_token"}
    for d in res["faults"].values():
        assert FAULT_FIELDS <= set(d)
        assert d["injected"] == 1
    assert len(res["rows"]) == 2 and all(ROW_FIELDS <= set(r) for r in res["rows"])
    h = res["healthy"]
    assert h["steps"] == 10 and h["judged_samples"] > 0
    for k in ("false_incidents_per_1000_steps", "false_outliers_per_1000_steps", "false_outliers_per_1000_samples"):
        assert h[k] is not None
    # the control: one token with a third of the step's loss weight is a spike, named at the token level
    pt = res["faults"]["planted_token"]
    assert pt["detected"] == 1 and pt["sample_recall"] == 1.0 and pt["probes_max"] <= 3


def test_an_excursion_leaves_the_healthy_run_unchanged():
    cfg = FaultsConfig.quick(faults=("truncated", "duplicated_sample"))
    with_faults = run_seed(cfg, 0)
    without = run_seed(replace(cfg, faults=()), 0)
    assert len(with_faults["rows"]) == 2
    assert with_faults["losses"] == without["losses"]
