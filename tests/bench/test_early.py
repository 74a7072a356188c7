"""``bench/early.py``: the healthy runs' own spikes judged offline (issue 32's "from step 0" case), on a
synthetic trending norm whose spikes are known."""
from __future__ import annotations

import numpy as np

from bench import early
from gradloc.config import DetectorConfig
from tests.detector.test_step0 import record, trending


def test_level_is_the_median_of_the_neighbours_without_the_step():
    norms = np.array([1.0, 1.0, 9.0, 1.0, 1.0, 2.0])
    lv = early.levels(norms, window=2)
    assert lv[2] == 1.0  # the spike itself is left out of its own level
    assert lv[5] == 1.0  # at the end: the two before it (1, 1)
    assert lv[0] == 5.0  # at the start: the two after it (1, 9), the spike among them
    assert np.isclose(early.levels(np.array([1.0, 3.0]), window=1)[0], 3.0)


def test_warmup_spikes_are_reported_and_later_spikes_flagged_and_nothing_else_is_false():
    g, _ = trending(300, seed=1)
    g[[150, 220]] *= 4.0  # two real spikes after the warm-up
    recs = [record(i, float(x)) for i, x in enumerate(g)]
    out = early.judge(recs, [], DetectorConfig())
    assert out["warmup_spikes"] == [13, 21] and out["warmup_reported"] == [13, 21]
    assert out["real_spikes_after_warmup"] == [150, 220] and out["flagged"] == [150, 220]
    assert out["incidents_on_real_spikes"] == [150, 220] and out["strict_false"] == 0
    total = early.summarize([out, out], steps=600)
    assert total["flagged_share"] == 1.0 and total["warmup_reported"] == 4 and total["strict_false_per_1000"] == 0.0


def test_an_incident_on_no_real_spike_counts_as_strictly_false():
    g, _ = trending(300, seed=2)
    recs = [record(i, float(x)) for i, x in enumerate(g)]
    # a detector that calls every step past its warm-up a spike: its incidents sit on no real spike
    out = early.judge(recs, [], DetectorConfig(spike_ratio=1.01, z_threshold=0.01))
    assert out["incidents"] > 0 and out["strict_false"] == out["incidents"] - len(out["incidents_on_real_spikes"])
    assert out["strict_false"] > 0
