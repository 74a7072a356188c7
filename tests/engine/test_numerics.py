"""Observability must not change training: bitwise numerics, mixed precision, GradScaler, compile."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import gradloc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.helpers` under plain `pytest` too
from tests.helpers import (  # noqa: E402
    backward_step,
    culprit_keys,
    make_data,
    module_grads,
    norm_of,
    single_thread,  # noqa: E402,F401 (autouse fixture)
    tiny_gpt,
    train,
)

DET = gradloc.DetectorConfig(warmup=5)


def _state_tensors(opt: torch.optim.Optimizer) -> list[tuple[int, str, torch.Tensor]]:
    st = opt.state_dict()["state"]
    return [(k, name, v) for k in sorted(st) for name, v in sorted(st[k].items())]


def _run_bitwise(with_monitor: bool, localizer: gradloc.LocalizerConfig, spike_step: int):
    model = tiny_gpt(0, dropout=0.1)  # seeds the global RNG; dropout then consumes it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = make_data(12, 3)
    planted = data.plant(spike_step, 1, 2, 5)
    mon = gradloc.watch(model, opt, detector=DET, localizer=localizer) if with_monitor else None
    reports = train(model, opt, data, mon, clip=1.0)
    if mon is not None:
        mon.close()
    return model, opt, torch.get_rng_state(), reports, planted


@pytest.mark.parametrize("localizer", [
    gradloc.LocalizerConfig(),
    # no token can stand 1e12 × above the median: no candidates; bisection="on_failure" then probes
    gradloc.LocalizerConfig(candidate_outlier_factor=1e12, bisection="on_failure"),
], ids=["attribution", "bisection"])
def test_training_is_bitwise_identical_with_monitor_and_probes(localizer):
    spike = 8
    m0, o0, rng0, _, _ = _run_bitwise(False, localizer, spike)
    m1, o1, rng1, reports, planted = _run_bitwise(True, localizer, spike)

    # the planted culprit did produce an incident whose localization ran probes on the real model
    inc = reports[spike].incident
    assert inc is not None and "grad_spike" in inc.spike.kinds
    loc = inc.localization
    assert loc is not None and loc.probes >= 1
    assert planted in culprit_keys(loc)
    if localizer.candidate_outlier_factor == 1e12:
        assert loc.method == "bisection" and loc.probes > 3
    else:
        assert loc.method == "attribution" and loc.status == "located"

    for (n0, p0), (n1, p1) in zip(m0.named_parameters(), m1.named_parameters()):
        assert n0 == n1
        assert torch.equal(p0, p1), f"parameter {n0} differs after training with gradloc"
    s0, s1 = _state_tensors(o0), _state_tensors(o1)
    assert len(s0) == len(s1) > 0
    for (k0, name0, v0), (k1, name1, v1) in zip(s0, s1):
        assert (k0, name0) == (k1, name1)
        assert torch.equal(v0, v1), f"optimizer state {k0}.{name0} differs"
    assert torch.equal(rng0, rng1), "gradloc changed the global RNG stream"


def test_bf16_autocast_culprit_top1():
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(8, 2)
    planted = data.plant(6, 1, 3, 9)
    with gradloc.watch(model, opt, detector=DET) as mon:
        reports = train(model, opt, data, mon, autocast=True)
    for r in reports:
        tok = r.record.tokens
        assert tok is not None and tok.tokens == 2 * 4 * 16
        assert math.isfinite(tok.total_score) and tok.total_score > 0
        assert all(math.isfinite(t.score) for t in tok.top)
        assert math.isfinite(r.record.global_norm)
        assert sum(tok.micro_batch_shares) == pytest.approx(1.0, rel=1e-4)
    top = reports[6].record.tokens.top[0]
    assert (top.micro_batch, top.sample, top.position) == planted
    assert top.token_id == int(data.y[6, 1, 3, 9])
    inc = reports[6].incident
    assert inc is not None and inc.localization.status == "located"
    assert planted in culprit_keys(inc.localization)
    assert all(p.isfinite().all() for p in model.parameters())


# -- GradScaler -------------------------------------------------------------------------------------
def _scaler_runs(steps: int, spike: int):
    """The same training twice: plain fp32 and with a CPU GradScaler (scale 2**10)."""
    out = []
    for use_scaler in (False, True):
        model = tiny_gpt(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = make_data(steps, 2)
        data.plant(spike, 0, 1, 4)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if use_scaler else None
        mon = gradloc.watch(model, opt, detector=DET)
        reports, true_norms = [], []
        for s in range(steps):
            total = backward_step(model, data, s, mon, scaler=scaler)
            true = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            true_norms.append(float(true) / (scaler.get_scale() if scaler else 1.0))
            reports.append(mon.end_step(total, probe=data.probe(model, s), scaler=scaler))
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
        mon.close()
        out.append((reports, true_norms, scaler))
    return out


def test_grad_scaler_reports_unscaled_norms_and_scores():
    steps, spike = 8, 6
    (plain, plain_true, _), (scaled, scaled_true, scaler) = _scaler_runs(steps, spike)
    assert scaler.get_scale() == 2.0**10  # no inf, no growth within 2000 steps
    for a, b, ta, tb in zip(plain, scaled, plain_true, scaled_true):
        ra, rb = a.record, b.record
        assert ra.grad_scale is None and rb.grad_scale == 2.0**10
        assert not rb.skipped
        assert rb.global_norm == pytest.approx(tb, rel=1e-5)  # the unscaled norm of the scaled run
        assert rb.global_norm == pytest.approx(ra.global_norm, rel=1e-5)
        assert ra.global_norm == pytest.approx(ta, rel=1e-5)
        assert rb.tokens.total_score == pytest.approx(ra.tokens.total_score, rel=1e-4)
        assert rb.tokens.top[0].score == pytest.approx(ra.tokens.top[0].score, rel=1e-4)
        for la, lb in zip(ra.layers, rb.layers):
            assert la.layer == lb.layer
            assert lb.grad_norm == pytest.approx(la.grad_norm, rel=1e-4, abs=1e-9)
            assert lb.grad_max_abs == pytest.approx(la.grad_max_abs, rel=1e-4, abs=1e-9)
    # localization under a scaler: probes (unscaled) are compared with the scaled stored gradient
    la, lb = plain[spike].incident.localization, scaled[spike].incident.localization
    assert lb.status == "located" and lb.explained_share >= 0.9
    assert lb.explained_share == pytest.approx(la.explained_share, rel=1e-4)
    assert culprit_keys(lb) == culprit_keys(la) and (0, 1, 4) in culprit_keys(lb)


def test_grad_scaler_inf_gradient_is_a_skipped_step():
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(5, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    mon = gradloc.watch(model, opt, detector=gradloc.DetectorConfig(warmup=2))
    reports, params_before = [], None
    for s in range(5):
        total = backward_step(model, data, s, mon, scaler=scaler)
        if s == 3:
            model.blocks[0].fc.weight.grad[0, 0] = float("inf")
            params_before = [p.detach().clone() for p in model.parameters()]
        reports.append(mon.end_step(total, probe=data.probe(model, s), scaler=scaler))
        scaler.step(opt)
        scaler.update()
        if s == 3:  # GradScaler skipped the update
            assert all(torch.equal(a, p) for a, p in zip(params_before, model.parameters()))
        opt.zero_grad()
    mon.close()
    bad = reports[3]
    assert bad.record.skipped and bad.record.grad_scale == 2.0**10
    assert "skipped_step" in bad.spike.kinds
    assert bad.record.nonfinite >= 1
    assert any(s.layer == "blocks.0.fc" and s.nonfinite >= 1 for s in bad.record.layers)
    assert not any(r.record.skipped for i, r in enumerate(reports) if i != 3)
    assert reports[4].record.grad_scale == 2.0**9  # the scaler backed off after the inf
    assert "skipped_step" not in reports[4].spike.kinds


def test_grad_scaler_unscale_before_end_step():
    steps, spike = 7, 6
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(steps, 2)
    planted = data.plant(spike, 1, 0, 8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    mon = gradloc.watch(model, opt, detector=DET)
    ref_model = tiny_gpt(0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    for s in range(steps):
        total = backward_step(model, data, s, mon, scaler=scaler)
        scaler.unscale_(opt)  # e.g. to clip before end_step
        true = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        rep = mon.end_step(total, probe=data.probe(model, s), scaler=scaler)
        backward_step(ref_model, data, s)
        ref = float(torch.nn.utils.get_total_norm([p.grad for p in ref_model.parameters()]))
        assert rep.record.grad_scale == 2.0**10
        assert rep.record.global_norm == pytest.approx(true, rel=1e-5)
        assert rep.record.global_norm == pytest.approx(ref, rel=1e-5)
        for name, grads in module_grads(model).items():
            stats = {x.layer: x for x in rep.record.layers}[name]
            assert stats.grad_norm == pytest.approx(norm_of(grads), rel=1e-5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    mon.close()
    loc = rep.incident.localization  # stored gradient already unscaled: no second 1/scale
    assert loc.status == "located" and loc.explained_share == pytest.approx(1.0, abs=0.05)
    assert culprit_keys(loc) == {planted}
    assert rep.record.tokens.top[0].share > 0.9


# -- torch.compile ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_training_per_layer_stats_match_eager():
    steps = 4  # one sweep of the update ratios (lean: a quarter of the parameters a step)
    runs = []
    for compiled in (False, True):
        model = tiny_gpt(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = make_data(steps, 2)
        mon = gradloc.watch(model, opt, token_stats=False, detector=DET)
        fwd = torch.compile(model) if compiled else model
        recs, independent = [], []
        for s in range(steps):
            for i in range(2):
                with mon.micro_batch(data.y[s, i]):
                    try:
                        data.loss(fwd, s, i).backward()
                    except Exception as exc:  # noqa: BLE001 - a compiler failure is the environment's
                        if not compiled or not type(exc).__module__.startswith("torch."):
                            raise
                        pytest.skip(f"torch.compile does not work on this machine: {type(exc).__name__}: {exc}")
            independent.append({n: norm_of(g) for n, g in module_grads(model).items()})
            recs.append(mon.end_step(None).record)
            opt.step()
            opt.zero_grad()
        mon.close()
        runs.append((recs, independent, list(mon.history)))
    (eager, _, eager_hist), (comp, comp_ind, comp_hist) = runs
    for re, rc, ind in zip(eager, comp, comp_ind):
        assert rc.tokens is None
        assert [s.layer for s in rc.layers] == [s.layer for s in re.layers]
        assert rc.global_norm == pytest.approx(re.global_norm, rel=1e-4)
        for se, sc in zip(re.layers, rc.layers):
            assert sc.grad_norm == pytest.approx(ind[sc.layer], rel=1e-5)  # exact for the compiled run
            assert sc.grad_norm == pytest.approx(se.grad_norm, rel=1e-3, abs=1e-7)
            assert sc.param_norm == pytest.approx(se.param_norm, rel=1e-4)
            assert sc.numel == se.numel
    measured = set()
    for he, hc in zip(eager_hist, comp_hist):  # update ratios arrive through the optimizer hooks (lean: a quarter
        for se, sc in zip(he.layers, hc.layers):  # of the parameters a step, the same in both runs)
            assert (sc.update_ratio is None) == (se.update_ratio is None), sc.layer
            if sc.update_ratio is not None:
                measured.add(sc.layer)
                assert sc.update_ratio == pytest.approx(se.update_ratio, rel=1e-2)
    assert measured == {s.layer for s in eager_hist[0].layers}  # every layer within the run's steps
