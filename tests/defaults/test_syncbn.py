"""DDP around a model with SyncBatchNorm (2 gloo ranks): said at attach, spikes reported without probes."""
from __future__ import annotations

from tests.defaults.syncbn_job import HEALTHY, PLANT, train
from tests.distributed.launch import run


def test_a_model_whose_modules_issue_collectives_is_watched_without_probes_and_says_so():
    ranks = run(train, 2, timeout_s=300)
    for r in ranks:
        assert "SyncBatchNorm" in r["hazard"] and r["broken"] == ""
        assert any("SyncBatchNorm" in line and "probes are off" in line for line in r["logs"]), r["logs"]
        (step, status, probes, note, culprits), = r["incidents"]
        assert (step, status, probes) == (HEALTHY, "unverified", 0), note
        assert note.startswith(r["hazard"]), note
        assert culprits[0] == (1, *PLANT), culprits  # ranked first by attribution, on the last rank
