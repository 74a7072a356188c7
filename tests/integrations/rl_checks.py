"""What the RL integrations' tests (verl, OpenRLHF) check of a step with one corrupted rollout log-probability."""
from __future__ import annotations

import pytest


def assert_mismatch_located(hooks, spike: int):  # noqa: ANN001, ANN201 - an integration's hooks; (report, top culprit)
    """Step ``spike`` (one token's rollout log-prob 8 nats too low) is an incident, located in ≤ 3 probes, its top
    culprit classified ``train_inference_mismatch`` with the planted log ratio; every earlier step reported, no
    block error."""
    assert len(hooks.reports) == spike + 1 and hooks.blocks.errors == 0
    rep = hooks.reports[spike]
    assert rep.incident is not None, rep.spike
    loc = rep.incident.localization
    assert loc.status == "located" and loc.probes <= 3, loc
    top = loc.culprits[0]
    assert top.classification.kind == "train_inference_mismatch"
    assert top.rl.log_ratio == pytest.approx(8.0, abs=0.1) and top.rl.log_ratio_old == pytest.approx(0.0, abs=1e-4)
    return rep, top
