"""Per-sample outlier findings on a model pre-trained on natural text (``bench/samples.py``, a short run):
random-id garbage and shifted labels are flagged, healthy samples are not."""
from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from bench.natural import RunConfig  # noqa: E402
from bench.samples import SamplesConfig, run_samples  # noqa: E402


@pytest.mark.slow
def test_garbage_and_shifted_labels_are_flagged_and_healthy_samples_are_not():
    cfg = SamplesConfig(burn_in=300, eval_steps=200, fault_rate=0.5,
                        faults=("random_ids", "shifted_labels_5", "shifted_labels_1"),
                        run=RunConfig(seq=128, batch=8, micro_batches=2, d_model=128, n_layers=2, steps=500))
    out = run_samples(cfg)
    for kind in ("random_ids", "shifted_labels_5"):
        f = out["faults"][kind]
        assert f["injected"] >= 25 and f["detected"] >= 0.9 * f["injected"], (kind, f)
    assert out["healthy_samples"] >= 2500
    assert out["false_outliers"] <= out["healthy_samples"] / 1000, out["false_examples"]
