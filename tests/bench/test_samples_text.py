"""The real-text benchmark (``python -m bench samples --text``, bench/samples_text.py), a smoke run: every kind of
text is found offline and judged, faults are planted and counted, the report names each kind."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench.samples_text import KINDS, TextConfig, report, run_text  # noqa: E402


@pytest.mark.slow
def test_the_text_benchmark_judges_every_kind_and_counts_the_faults():
    out = run_text(TextConfig(burn_in=10, eval_steps=8, fault_rate=1.0))
    assert set(out["kinds"]) == set(KINDS) and all(v["judged"] > 0 for v in out["kinds"].values())
    assert sum(v["injected"] for v in out["faults"].values()) == 8 and out["judged"] == 8 * 32 - 8
    assert all(v["detected"] <= v["injected"] and v["first"] <= v["detected"] for v in out["faults"].values())
    assert "markup" in report(out) and out["false_outliers"] >= sum(v["false"] for v in out["kinds"].values())


def test_the_text_benchmark_takes_a_held_out_seed(monkeypatch):
    """``python -m bench samples --text --seed 1`` runs the benchmark with another initialisation and other text
    windows (the held-out run of docs/BENCHMARKS.md §4.1); without --seed it is seed 0."""
    import bench.samples
    import bench.samples_text as st

    seen = []
    monkeypatch.setattr(st, "run_text", lambda cfg, progress=None: seen.append(cfg) or {})
    monkeypatch.setattr(st, "report", lambda out: "")
    assert bench.samples.main(["--text", "--seed", "1"]) == 0 and bench.samples.main(["--text"]) == 0
    assert [c.seed for c in seen] == [1, 0] and seen[0].eval_steps == TextConfig().eval_steps
