"""RL fields through a GRPO-style loss: distributions on every step, values and a class on every culprit."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import gradloc
from gradloc.collector.batch import make_meta
from gradloc.collector.rl_fields import make_rl
from gradloc.records import RL_LOG_RATIO_BUCKETS
from tests.helpers import make_data, single_thread, tiny_gpt  # noqa: F401

DET = gradloc.DetectorConfig(warmup=5)
SPIKE, M, EPS = 6, 2, 0.2


def _token_logp(model, x, y):
    return torch.log_softmax(model(x).float(), -1).gather(-1, y[..., None]).squeeze(-1)  # (B, T, V) -> (B, T)


def _grpo_run(plant: str):
    """Steps of a PPO/GRPO-style loss −min(ρ·A, clip(ρ)·A) with ρ = π_train / π_old and the IS weight
    π_old / π_rollout; ``plant`` corrupts one token of the spike step: ``rollout`` (the engine's
    log-prob −8 where the trainer's is not: a huge IS weight, a mismatch), ``old`` (the policy that
    sampled it, as both engines scored it, −8 below the current one, with A < 0: a huge unclipped
    ratio, a stale token), ``advantage`` (the least likely token of a sample gets a 40× advantage)."""
    model = tiny_gpt(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = make_data(SPIKE + 1, M)
    g = torch.Generator().manual_seed(5)
    mon = gradloc.watch(model, opt, detector=DET, update_ratio="off", store=False)
    planted, reports = None, []
    for s in range(SPIKE + 1):
        with torch.no_grad():
            logp0 = [_token_logp(model, data.x[s, i], data.y[s, i]) for i in range(M)]
        old = [lp.clone() for lp in logp0]
        rollout = [lp + 0.01 * torch.randn(lp.shape, generator=g) for lp in logp0]  # engine ≈ trainer
        adv = [torch.randn(lp.shape[0], generator=g)[:, None].expand_as(lp).clone() for lp in logp0]  # per sequence
        if s == SPIKE:
            mb, b = 1, 2
            t = int(logp0[mb][b].argmin()) if plant == "advantage" else 5
            planted = (mb, b, t)
            if plant == "rollout":
                rollout[mb][b, t] -= 8.0
            elif plant == "old":
                old[mb][b, t] -= 8.0
                rollout[mb][b, t] -= 8.0  # the engine agrees with the old policy: stale, not mismatched
                adv[mb][b, :] = -1.0
            else:
                adv[mb][b, t] = 40.0

        def loss_for(i, mask=None, s=s, old=old, rollout=rollout, adv=adv, fields=False):
            logp = _token_logp(model, data.x[s, i], data.y[s, i])
            ratio = torch.exp(logp - old[i])
            is_w = torch.exp(old[i] - rollout[i])
            terms = -torch.minimum(ratio * adv[i], ratio.clamp(1 - EPS, 1 + EPS) * adv[i]) * is_w
            if mask is not None:
                terms = terms * mask
            if fields:
                clipped = ratio.clamp(1 - EPS, 1 + EPS) * adv[i] < ratio * adv[i]  # the min took the clipped term
                mon.rl_fields(logp=logp, rollout_logp=rollout[i], old_logp=old[i], advantages=adv[i],
                              ratio=ratio, clipped=clipped)
            return terms.sum() / (terms.numel() * M)

        total = torch.zeros(())
        for i in range(M):
            with mon.micro_batch(data.y[s, i]):
                loss = loss_for(i, fields=True)
                loss.backward()
            total += loss.detach()
        reports.append(mon.end_step(total, probe=loss_for))
        opt.step()
        opt.zero_grad()
    mon.close()
    return reports, planted


@pytest.mark.parametrize("plant,kind", [("rollout", "train_inference_mismatch"), ("old", "stale_off_policy"),
                                        ("advantage", "low_prob_high_advantage")])
def test_the_planted_rl_culprit_is_located_and_classified(plant, kind):
    reports, planted = _grpo_run(plant)
    rep = reports[SPIKE]
    assert rep.incident is not None, rep.spike
    loc = rep.incident.localization
    assert loc.status == "located" and loc.probes <= 3
    top = loc.culprits[0]
    assert (top.micro_batch, top.sample, top.position) == planted
    assert top.rl is not None and top.classification.kind == kind, top.classification
    assert rep.incident.classification.kind == kind
    names = {e.name for e in top.classification.evidence}
    assert {"log_ratio", "logp", "advantage", "ratio", "clipped"} <= names
    if plant == "rollout":
        assert top.rl.log_ratio == pytest.approx(8.0, abs=0.1)  # π_old − π_rollout
        assert top.rl.log_ratio_old == pytest.approx(0.0, abs=0.05)  # the policy itself did not move
        assert "at this token (ratio 2.9" in top.classification.reason
    if plant == "old":
        assert top.rl.log_ratio_old == pytest.approx(8.0, abs=0.1) and top.rl.clipped is False
        assert abs(top.rl.log_ratio) < 0.1  # trainer and engine agree on the old policy
    if plant == "advantage":
        assert top.rl.advantage == 40.0 and math.exp(top.rl.logp) < 0.05


def test_every_step_carries_the_distributions():
    reports, _ = _grpo_run("rollout")
    healthy = reports[2].record.rl
    assert healthy.tokens == M * 4 * 16
    assert len(healthy.log_ratio_counts) == len(RL_LOG_RATIO_BUCKETS) + 1
    assert sum(healthy.log_ratio_counts) == healthy.tokens
    assert healthy.max_abs_log_ratio < 0.1 and healthy.mismatch_fraction == 0.0  # engine ≈ trainer
    assert healthy.advantage_rms == pytest.approx(1.0, abs=0.5) and healthy.clip_fraction is not None
    spike = reports[SPIKE].record.rl
    assert spike.max_abs_log_ratio == pytest.approx(8.0, abs=0.1)
    assert spike.mismatch_fraction == pytest.approx(1 / spike.tokens)
    assert spike.log_ratio_counts[-1] == 1  # the planted token: above the last bucket bound (4)
    # KL(π_rollout ‖ π_trainer) per token, k3: engine ≈ trainer gives ~r²/2 with r ~ 0.01; the planted token
    # (r ≈ +8, the engine scored it 8 nats lower) alone gives exp(8) − 1 − 8 over the step's tokens
    assert 0 < healthy.kl_rollout < 1e-3
    assert (healthy.job_entropy_mean, healthy.job_kl_rollout) == (healthy.entropy_mean, healthy.kl_rollout)  # 1 rank
    assert spike.kl_rollout == pytest.approx((math.exp(8.0) - 9.0) / spike.tokens, rel=0.05)


def test_rl_fields_are_validated():
    meta = make_meta(0, torch.zeros(2, 5, dtype=torch.long), None, None, None)
    with pytest.raises(gradloc.BatchMetadataError, match="logp has shape"):
        make_rl(meta, {"logp": torch.zeros(2, 4)})
    with pytest.raises(gradloc.BatchMetadataError, match="unknown RL field"):
        make_rl(meta, {"reward": torch.zeros(2, 5)})
    r = make_rl(meta, {"advantages": torch.tensor([1.0, -2.0])})  # one per sample
    assert r.advantages.shape == (2, 5) and float(r.advantages[1, 3]) == -2.0
    packed = make_meta(0, torch.zeros(1, 7, dtype=torch.long), None, None, None, cu_seqlens=[0, 3, 7])
    r = make_rl(packed, {"advantages": torch.tensor([1.0, -2.0])})  # one per sequence
    assert r.advantages.tolist() == [[1.0, 1.0, 1.0, -2.0, -2.0, -2.0, -2.0]]


def test_rl_fields_outside_a_block_and_bad_fields_after_setup():
    model = tiny_gpt(0)
    data = make_data(2, 1)
    mon = gradloc.watch(model, store=False)
    with pytest.raises(gradloc.BatchMetadataError, match="inside a mon.micro_batch"):
        mon.rl_fields(logp=torch.zeros(4, 16))
    for s in range(2):
        with mon.micro_batch(data.y[s, 0]):
            loss = F.cross_entropy(model(data.x[s, 0]).flatten(0, 1), data.y[s, 0].flatten())
            if s == 0:
                with pytest.raises(gradloc.BatchMetadataError):  # setup: loud
                    mon.rl_fields(logp=torch.zeros(3))
            else:
                mon.rl_fields(logp=torch.zeros(3))  # after setup: counted and dropped, never raised
            loss.backward()
        rep = mon.end_step(loss.detach())
        model.zero_grad()
    mon.close()
    assert mon.counters["dropped_rl_fields"] == 1 and rep.record.rl is None
