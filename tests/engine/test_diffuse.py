"""A spike with no culprit token: an answer within the probe budget, and no token named."""
from __future__ import annotations

import torch

import gradloc
from tests.helpers import make_data, single_thread, tiny_gpt, train  # noqa: F401

DET = gradloc.DetectorConfig(warmup=5)
SPIKE = 6


def _diffuse_run(localizer: gradloc.LocalizerConfig, boost_sample: tuple[int, int] | None = None):
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(SPIKE + 1, 3)
    data.w[SPIKE] *= 60.0  # every token's loss weight scaled up: a spike no token set explains
    if boost_sample is not None:
        mb, b = boost_sample
        data.w[SPIKE, mb, b] *= 20.0  # one whole sample carries it, no single token stands out
    mon = gradloc.watch(model, opt, detector=DET, localizer=localizer)
    reports = train(model, opt, data, mon)
    mon.close()
    return reports[SPIKE]


def test_a_uniform_spike_is_diffuse_in_three_probes_with_the_samples_measured():
    rep = _diffuse_run(gradloc.LocalizerConfig())
    assert "grad_spike" in rep.spike.kinds
    loc = rep.incident.localization
    assert loc.status == "diffuse" and loc.method == "attribution"
    assert loc.culprits == () and loc.spans == ()  # no unverified token is ever named
    assert loc.probes == 3 and loc.explained_share is None and loc.level == ""
    assert loc.passes == 6  # three decomposition probes: each micro-batch's every sample measured at once
    measured = [s for s in loc.samples if s.share is not None]
    assert len(measured) == len(loc.samples) == 5
    assert all(0 < s.share < 0.3 for s in measured)  # 12 samples carry it about evenly
    assert "spread evenly over 12 samples" in loc.note


def test_one_sample_carrying_the_spike_is_located_as_that_whole_sample():
    """Every token of one sample ×20 on top of a uniform ×60: each of them stands ≥ 20× above the
    median, so they verify together as one span covering the sample, in one probe."""
    rep = _diffuse_run(gradloc.LocalizerConfig(), boost_sample=(2, 1))
    loc = rep.incident.localization
    assert loc.status == "located" and loc.probes == 1 and loc.explained_share > 0.9
    assert {(c.micro_batch, c.sample) for c in loc.culprits} == {(2, 1)}
    (span,) = loc.spans
    assert (span.micro_batch, span.sample, span.start, span.end) == (2, 1, 0, 16)
    top = loc.samples[0]
    assert (top.micro_batch, top.sample) == (2, 1) and top.score_share > 0.9


def test_bisection_on_failure_is_the_old_many_probe_answer():
    rep = _diffuse_run(gradloc.LocalizerConfig(bisection="on_failure"))
    loc = rep.incident.localization
    assert loc.method == "bisection" and loc.probes > 3
    assert loc.status == "diffuse" and loc.culprits == ()  # hot tokens that do not explain it are not named
