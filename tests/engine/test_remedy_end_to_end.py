"""The opt-in remedy: ∇ − ∇_C equals training with the culprits masked out; nothing else is remedied."""
from __future__ import annotations

import copy

import pytest
import torch

import gradloc
from tests.helpers import backward_step, make_data, single_thread, tiny_gpt  # noqa: F401

DET = gradloc.DetectorConfig(warmup=5)
SPIKE, STEPS = 6, 7


def _opt(model, kind: str):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _run(data, *, remedy=None, opt_kind="sgd", scaler_scale=None, mask_out=(), probe=True, steps=STEPS):
    """Train ``steps`` steps (dropout on, clip 1.0); returns (model, optimizer, reports, params after
    each step, the unscaled gradients the optimizer got at SPIKE). ``mask_out``: (micro-batch,
    sample, position) whose loss weight is zeroed at SPIKE in a run without gradloc — the reference
    a remedied step must match."""
    model = tiny_gpt(0, dropout=0.1)
    opt = _opt(model, opt_kind)
    d = copy.deepcopy(data)
    for mb, b, t in mask_out:
        d.w[SPIKE, mb, b, t] = 0.0
    scaler = torch.amp.GradScaler("cpu", init_scale=scaler_scale) if scaler_scale else None
    mon = gradloc.watch(model, opt, detector=DET, remedy=remedy) if remedy is not False else None
    reports, snapshots, grads = [], [], None
    for s in range(steps):
        total = backward_step(model, d, s, mon, scaler=scaler)
        if mon is not None:
            reports.append(mon.end_step(total, probe=d.probe(model, s) if probe else None, scaler=scaler))
        if scaler is not None:
            scaler.unscale_(opt)
        if s == SPIKE:
            grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    if mon is not None:
        mon.close()
    return model, opt, reports, snapshots, grads


def _norm(tensors) -> float:
    return float(torch.sqrt(sum(t.double().pow(2).sum() for t in tensors)))


def _planted():
    data = make_data(STEPS, 3)
    planted = data.plant(SPIKE, 1, 2, 5)
    return data, planted


@pytest.mark.parametrize("opt_kind,scaler_scale", [("sgd", None), ("adamw", None), ("sgd", 2.0**10)],
                         ids=["sgd", "adamw", "sgd-gradscaler"])
def test_drop_culprits_equals_the_step_with_the_culprits_masked_out(opt_kind, scaler_scale):
    """The optimizer gets ∇ − ∇_C, the gradient of the loss with the culprits masked out, to float32
    precision: the subtraction cancels a spike ~200× the rest, so the error bound is a few eps·‖∇‖
    (measured 1.4e-5 absolute, 2.9e-5 of ‖∇ − ∇_C‖). SGD's update is linear in it, so the parameters
    match to 1e-4; AdamW divides each element by its own RMS, so elements whose gradient is below
    that noise floor can move differently — there the gradients are the comparison, not parameters."""
    data, planted = _planted()
    _, _, reports, remedied, g_rem = _run(data, remedy="drop_culprits", opt_kind=opt_kind, scaler_scale=scaler_scale)
    inc = reports[SPIKE].incident
    loc, remedy = inc.localization, inc.remedy
    assert loc.status == "located" and planted in {(c.micro_batch, c.sample, c.position) for c in loc.culprits}
    assert remedy.action == "drop_culprits" and remedy.applied, remedy.reason
    assert remedy.norm_before == pytest.approx(reports[SPIKE].record.global_norm)
    assert remedy.norm_after == pytest.approx(loc.norm_without_culprits) and remedy.norm_after < 0.2 * remedy.norm_before
    assert all(r.incident is None or r.incident.remedy is None or not r.incident.remedy.applied
               for i, r in enumerate(reports) if i != SPIKE)
    culprits = [(c.micro_batch, c.sample, c.position) for c in loc.culprits]
    _, _, _, masked, g_mask = _run(data, remedy=False, opt_kind=opt_kind, scaler_scale=scaler_scale, mask_out=culprits)
    _, _, _, unremedied, g_full = _run(data, remedy=False, opt_kind=opt_kind, scaler_scale=scaler_scale)
    for a, b in zip(remedied[SPIKE - 1], masked[SPIKE - 1]):
        assert torch.equal(a, b)  # before the spike: bitwise the same training
    eps = torch.finfo(torch.float32).eps
    assert _norm(a - b for a, b in zip(g_rem, g_mask)) <= 8 * eps * _norm(g_full)
    assert _norm(g_rem) == pytest.approx(remedy.norm_after, rel=1e-4)
    if opt_kind == "sgd":
        for a, b in zip(remedied[SPIKE], masked[SPIKE]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # and the remedy did change the update: without it the parameters differ far beyond that tolerance
    assert max(float((c - b).abs().max()) for b, c in zip(masked[SPIKE], unremedied[SPIKE])) > 1e-4


def test_a_diffuse_spike_is_never_remedied():
    data = make_data(STEPS, 3)
    data.w[SPIKE] *= 60.0  # every token's loss weight: a spike with no culprit token
    _, _, reports, remedied, _ = _run(data, remedy="drop_culprits")
    inc = reports[SPIKE].incident
    assert inc is not None and inc.localization.status == "diffuse" and not inc.localization.culprits
    assert inc.localization.probes <= 3
    assert inc.remedy is not None and not inc.remedy.applied and "diffuse" in inc.remedy.reason
    _, _, _, plain, _ = _run(data, remedy=False)
    for a, b in zip(remedied[SPIKE], plain[SPIKE]):
        assert torch.equal(a, b)  # bitwise: nothing was touched


def test_skip_step_leaves_parameters_and_optimizer_state_as_before_the_step():
    data, _ = _planted()
    model, opt, reports, snaps, _ = _run(data, remedy="skip_step", opt_kind="adamw")
    inc = reports[SPIKE].incident
    assert inc.remedy.applied and inc.remedy.norm_after == 0.0
    for a, b in zip(snaps[SPIKE - 1], snaps[SPIKE]):
        assert torch.equal(a, b)
    steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
    assert steps == {STEPS - 1}  # AdamW's own step count skipped the spike step too


def test_skip_step_with_a_grad_scaler_is_refused_and_changes_nothing():
    data, _ = _planted()
    _, _, reports, snaps, _ = _run(data, remedy="skip_step", scaler_scale=2.0**10)
    rem = reports[SPIKE].incident.remedy
    assert not rem.applied and "GradScaler" in rem.reason
    _, _, _, plain, _ = _run(data, remedy=False, scaler_scale=2.0**10)
    for a, b in zip(snaps[SPIKE], plain[SPIKE]):
        assert torch.equal(a, b)


def test_drop_culprits_without_a_probe_closure_is_refused_at_the_first_step():
    data, _ = _planted()
    with pytest.raises(gradloc.ConfigError, match="probe closure"):
        _run(data, remedy="drop_culprits", probe=False, steps=1)


@pytest.mark.parametrize("kw,match", [
    (dict(remedy="drop_culprits", token_stats=False), "token_stats"),
    (dict(remedy="undo"), "remedy must be"),
])
def test_remedy_config_errors(kw, match):
    with pytest.raises(gradloc.ConfigError, match=match):
        gradloc.WatchConfig(**kw)
