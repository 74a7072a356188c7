"""The decomposition probe against brute force, and whole-sample faults located below the tokens.

Brute force (as opacus tests each per-sample rule): c_t = ⟨∇ℓ_t, ∇⟩ from one probe per token t of
the micro-batch, against the decomposition's one probe and two forward passes. Then a real fault the
per-token squared scores cannot see: a sample whose tokens are one id repeated (every position's
gradient points the same way, none stands out), planted in a tiny GPT's training run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gradloc
from gradloc.collector.batch import MicroBatchMeta, RngState
from gradloc.localizer.decompose import decompose
from gradloc.localizer.probes import ProbeSession, dot, grad_norm
from tests.helpers import make_data, single_thread, tiny_gpt, train  # noqa: F401

B, T = 2, 8


def _setup(dtype: torch.dtype):
    model = tiny_gpt(0, seq=T).to(dtype)
    data = make_data(1, 2, batch=B, seq=T)
    data.x[0, 0, 1, 2:] = 5  # a repeated run in sample 1 of micro-batch 0: a coherent gradient
    data.y[0, 0, 1, 2:] = 5
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(2):
        data.loss(model, 0, i).backward()
    stored = [p.grad.detach().clone() for p in params]
    metas = [MicroBatchMeta(index=i, batch=B, seq=T, token_ids=None, loss_mask=None, sample_ids=None,
                            rng=RngState.capture()) for i in range(2)]
    session = ProbeSession(model, params, metas, data.probe(model, 0), lambda on: None)
    return model, params, stored, session


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-7), (torch.float32, 3e-3)])
def test_each_token_share_matches_one_probe_per_token(dtype: torch.dtype, tol: float) -> None:
    model, params, stored, session = _setup(dtype)
    before = [p.detach().clone() for p in params]
    total_sq = grad_norm(stored) ** 2
    with session:
        dec = decompose(session, 0, torch.ones(B, T, dtype=torch.bool), stored, 1.0, total_sq, model.head)
        brute = np.zeros(B * T)
        for t in range(B * T):
            mask = torch.zeros(B * T, dtype=torch.bool)
            mask[t] = True
            brute[t] = dot(session.grad(0, mask.reshape(B, T)), stored) / total_sq  # (B·T,) -> (B, T)
    assert all(torch.equal(p, q) for p, q in zip(params, before))  # θ ± ε∇ put back bitwise
    assert all(torch.equal(p.grad, g) for p, g in zip(params, stored))  # the session restored ∇
    scale = np.abs(brute).max()
    np.testing.assert_allclose(dec.c, brute, rtol=0, atol=tol * scale)
    assert dec.explained == pytest.approx(brute.sum(), rel=1e-6)  # the probe: exact
    assert dec.closure_error < 10 * tol
    per_sample = dec.c.reshape(B, T).sum(1)  # (B·T,) -> (B, T) -> Σ per sample
    assert per_sample[1] > 3 * per_sample[0]  # the repeated run's sample carries most of it


def _run(plant) -> gradloc.StepReport:
    spike = 30
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(spike + 1, 3)
    plant(data, spike)
    mon = gradloc.watch(model, opt, detector=gradloc.DetectorConfig(warmup=10, sensitivity="zclip"))  # every z > 2.5
    reports = train(model, opt, data, mon)
    mon.close()
    return reports[spike]


def test_a_repeated_token_sample_is_located_as_that_sample() -> None:
    def plant(data, s):
        data.x[s, 1, 2, :] = 7
        data.y[s, 1, 2, :] = 7

    rep = _run(plant)
    loc = rep.incident.localization
    assert "grad_spike" in rep.spike.kinds
    top_score = max(s.score_share for s in loc.samples)
    assert (loc.status, loc.level, loc.probes, loc.passes) == ("located", "sample", 2, 2)
    (span,) = loc.spans
    assert (span.micro_batch, span.sample, span.start, span.end) == (1, 2, 0, 16)
    assert loc.explained_share > 0.3 and loc.explained_share > 3 * top_score  # attribution under-rated it
    assert loc.samples[0].share == pytest.approx(loc.explained_share, rel=0.05)  # decomposition ≈ the probe
    assert loc.norm_without_culprits < rep.spike.global_norm


def test_a_repeated_run_in_the_tail_of_a_sample_is_located_as_that_span() -> None:
    def plant(data, s):
        data.x[s, 2, 0, 6:] = 9
        data.y[s, 2, 0, 6:] = 9

    loc = _run(plant).incident.localization
    assert (loc.status, loc.level) == ("located", "span")
    (span,) = loc.spans
    assert (span.micro_batch, span.sample) == (2, 0)
    assert 6 <= span.start and span.end <= 16 and span.end - span.start >= 7  # the run (6-15), not the random head
    assert span.share >= 0.8 * loc.samples[0].share  # the shortest window carrying 80% of the sample's share
    assert all(6 <= c.position for c in loc.culprits)


def test_a_bad_sample_duplicated_in_two_micro_batches_names_both_copies() -> None:
    """Each copy carries half of ‖∇‖², so neither passes alone (the other copy still spikes the
    step); the decompositions of the two micro-batches holding the per-sample outliers add up, and
    both copies are named at the sample level. The token phase is switched off
    (``candidate_outlier_factor``) to reach the levels below the tokens, as a coherent fault does."""
    from gradloc.demo.model import token_losses

    V, T, B, M = 128, 16, 4, 3
    torch.manual_seed(0)
    model = tiny_gpt(vocab=V)
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    mon = gradloc.watch(model, opt, embedded=False, update_ratio="off", max_overhead=None,
                        samples=gradloc.SampleConfig(warmup_samples=64, min_tokens=8, window=8),
                        localizer=gradloc.LocalizerConfig(candidate_outlier_factor=1e9))
    cycle = torch.arange(64) * 7 % V  # a sequence the model learns
    gen = torch.Generator().manual_seed(1)
    bad = 149
    for s in range(bad + 1):
        batches = [torch.stack([cycle.roll(-int(a))[: T + 1] for a in torch.randint(0, 64, (B,), generator=gen)])
                   for _ in range(M)]  # M × (B, T + 1)
        if s == bad:
            batches[0][1] = batches[2][3] = 5  # one repeated-id sample, in micro-batches 0 and 2

        def probe(i: int, mask: torch.Tensor) -> torch.Tensor:
            w = batches[i]
            return (token_losses(model(w[:, :-1]), w[:, 1:]) * mask).mean() / M

        loss = torch.zeros(())
        for w in batches:
            with mon.micro_batch(w[:, 1:]):
                part = token_losses(model(w[:, :-1]), w[:, 1:]).mean() / M
                part.backward()
            loss += part.detach()
        rep = mon.end_step(loss, probe=probe)
        opt.step()
        opt.zero_grad()
    mon.close()
    assert {(o.micro_batch, o.sample) for o in rep.record.samples.outliers} == {(0, 1), (2, 3)}
    loc = rep.incident.localization
    assert (loc.status, loc.level) == ("located", "sample") and loc.probes <= 3
    assert {(x.micro_batch, x.sample, x.start, x.end) for x in loc.spans} == {(0, 1, 0, T), (2, 3, 0, T)}
    assert loc.explained_share > 0.9
