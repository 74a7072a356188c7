"""``python -m bench precursors`` (bench/precursors.py): its scoring on constructed runs (failure, failing layer,
lead time, control rates, which statistics ship off), and one short real run through the monitor."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench.precursors import main
from bench.precursors_score import failure, failing_layer, score, summarize
from gradloc.config import DriftConfig
from gradloc.records import PrecursorFinding

CFG = DriftConfig(warmup=100)


def _finding(step: int, statistic: str, layer: str, pages: bool = False) -> PrecursorFinding:
    return PrecursorFinding(job="j", rank=0, step=step, time_unix=0.0, statistic=statistic, layer=layer,
                            trend="falling" if statistic == "attn_entropy" else "rising", value=1.0, baseline=2.0,
                            z=8.0, change=0.5, rate=1.0, since_step=step - 20, pages=pages)


def _run(role: str, findings: list, loss: np.ndarray, incidents=()) -> dict:
    n = len(loss)
    ent = {"attn_entropy|l0|": np.full(n, 2.0), "attn_entropy|l1|": np.linspace(2.0, 0.1, n)}
    return dict(scenario=f"{role}-run", role=role, instability="attention_logit_growth", detail="", loss=loss,
                incidents=list(incidents), findings=findings, series=ent, seconds=1.0)


def test_failure_is_the_first_late_incident_or_the_loss_blow_up():
    flat = np.full(1000, 3.0)
    assert failure(_run("instability", [], flat), 100) == (None, "")
    early = _run("instability", [], flat, incidents=[(50, ["grad_spike"]), (700, ["loss_spike"]), (800, ["divergence"])])
    assert failure(early, 100) == (800, "incident")  # before the warm-up and loss-only kinds do not count
    rising = flat.copy()
    rising[600:] = 3.0 * 1.5
    assert failure(_run("instability", [], rising), 100) == (620, "loss")  # 21 steps at 4.5: the mean passes 3.3
    nan = flat.copy()
    nan[400] = math.nan
    assert failure(_run("instability", [], nan), 100)[0] == 400


def test_scores_lead_time_layer_and_control_rates():
    loss = np.full(1000, 3.0)
    bad = _run("instability", [_finding(300, "residual_rms", "norm"), _finding(500, "attn_entropy", "l1"),
                               _finding(650, "attn_entropy", "l1", pages=True), _finding(900, "attn_max_logit", "l1")],
               loss, incidents=[(800, ["grad_spike"])])
    row = score(bad, CFG)
    assert row["failure"] == 800 and failing_layer(bad, 100, 800) == "l1" and row["failing_layer"] == "l1"
    assert row["reproduced"] and failing_layer(bad, 100, 150) is None  # by step 150 l1 had not halved yet
    first = row["first_by_statistic"]
    assert first["attn_entropy"]["lead"] == 300 and first["attn_entropy"]["names_failing_layer"]
    assert first["attn_entropy (page)"]["lead"] == 150 and "attn_max_logit" not in first  # after the failure
    assert not first["residual_rms"]["names_failing_layer"]
    assert row["announced"] and row["announced_naming_layer"]
    assert first["attn_entropy"]["failing_layer_lead"] == 300 and first["residual_rms"]["failing_layer_lead"] is None
    # another layer named first (two routers collapsing together): the failing layer's own lead is kept beside it
    two = score(_run("instability", [_finding(400, "attn_entropy", "l0"), _finding(600, "attn_entropy", "l1")],
                     loss, incidents=[(800, ["grad_spike"])]), CFG)
    ent = two["first_by_statistic"]["attn_entropy"]
    assert (ent["lead"], ent["layer"], ent["names_failing_layer"], ent["failing_layer_lead"]) == (400, "l0", False, 200)
    assert two["announced_naming_layer"] and summarize([two])["per_statistic"]["attn_entropy"]["leads"][
        "instability-run"] == dict(lead=400, layer_ok=False, failing_layer_lead=200)
    late = score(_run("instability", [_finding(400, "attn_entropy", "l0"), _finding(750, "attn_entropy", "l1")],
                      loss, incidents=[(800, ["grad_spike"])]), CFG)
    assert late["announced"] and not late["announced_naming_layer"]  # the failing layer only 50 steps ahead
    ctl = score(_run("control", [_finding(400, "residual_rms", "norm"), _finding(500, "residual_rms", "norm"),
                                 _finding(600, "attn_max_logit", "l0", pages=True)], loss), CFG)
    assert ctl["judged_steps"] == 900 and ctl["findings_per_1000"] == pytest.approx(3.33, abs=0.01)
    assert ctl["per_statistic"]["residual_rms"]["findings"] == 2 and ctl["pages"] == 1
    spiky = _run("instability", [], loss, incidents=[(800, ["grad_spike"])])
    spiky["series"] = {"attn_entropy|l0|": np.full(1000, 2.0)}  # it fails, but nothing collapsed
    other = score(spiky, CFG)
    assert other["failure"] == 800 and not other["reproduced"] and not other["announced"]
    failed = score(_run("control", [_finding(300, "attn_entropy", "l0")] * 3, loss, incidents=[(500, ["grad_spike"])]),
                   CFG)  # a control that fails itself: 3 findings in 400 judged steps, not a stable run
    assert failed["failure"] == 500 and failed["findings_per_1000"] == 7.5
    s = summarize([row, ctl, other, failed])
    assert s["unstable_controls"] == ["control-run"] and "attn_entropy" not in s["off_by_default"]
    assert s["not_reproduced"] == ["instability-run"] and s["instabilities"] == 1
    assert s["off_by_default"] == ["attn_max_logit", "residual_rms"]  # a page; 2.2 > 1 per 1,000 steps
    assert s["instabilities_announced"] == 1 and s["control_pages"] == 1


def test_healthy_runs_count_their_live_findings_after_the_warm_up():
    from types import SimpleNamespace

    from bench.drift_rates import pooled, run_rates

    recs = [SimpleNamespace(step=s, precursor_findings=()) for s in range(1500)]
    recs[1200] = SimpleNamespace(step=1200, precursor_findings=(_finding(1200, "residual_rms", "norm"),))
    recs[1400] = SimpleNamespace(step=1400, precursor_findings=(_finding(1400, "attn_entropy", "l1", pages=True),
                                                               _finding(1400, "attn_max_logit", "l1")))
    a = run_rates(recs, 1000)
    assert a["judged_steps"] == 500 and a["count"] == 3 and a["findings_per_1000"] == 6.0 and a["pages"] == 1
    assert a["at"] == [(1200, "residual_rms", "norm", False), (1400, "attn_entropy", "l1", True),
                       (1400, "attn_max_logit", "l1", False)]
    b = run_rates(recs[:800], 1000)  # all inside the warm-up: nothing judged, nothing found
    assert b["judged_steps"] == 0 and b["count"] == 0 and b["findings_per_1000"] == 0.0
    both = pooled([a, b, run_rates([SimpleNamespace(step=s, precursor_findings=()) for s in range(3000)], 1000)])
    assert both == dict(judged_steps=2500, findings=3, findings_per_1000=1.2, pages=1, runs_over_1_per_1000=1)


@pytest.mark.slow
def test_a_short_real_run_goes_through_the_monitor(capsys: pytest.CaptureFixture[str]):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    assert main(["--steps", "40", "--only", "llama_cosine", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    (row,) = res["runs"]
    assert row["scenario"] == "llama_cosine" and row["role"] == "control" and row["steps"] == 40
    assert row["findings"] == [] and row["findings_per_1000"] == 0.0  # 40 steps: all inside the warm-up
    assert res["drift"]["warmup"] == DriftConfig().warmup


def test_the_drift_cost_bench_times_the_detector(capsys: pytest.CaptureFixture[str]):
    from bench.drift_cost import main as cost

    assert cost(["--series", "4", "--steps", "400"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"4"} and out["4"] > 0


def test_an_output_logit_divergence_reproduces_by_the_heads_logsumexp():
    n = 1000
    run = _run("instability", [_finding(500, "logit_lse_sq", "head")], np.full(n, 3.0),
               incidents=[(800, ["grad_spike"])])
    run["instability"] = "output_logit_divergence"
    run["series"] = {"logit_lse_sq|head|": np.linspace(50.0, 60.0, n)}  # ×1.2: the head's logits did not diverge
    assert failing_layer(run, 100, 800) is None and not score(run, CFG)["reproduced"]
    run["series"] = {"logit_lse_sq|head|": np.geomspace(50.0, 500.0, n), "attn_entropy|l1|": np.linspace(2, 0.1, n)}
    row = score(run, CFG)  # the attention collapse is not this instability's: the head is the failing module
    assert row["failing_layer"] == "head" and row["first_by_statistic"]["logit_lse_sq"]["names_failing_layer"]


def test_runs_can_be_changed_from_the_command_line():
    from bench.precursors import with_overrides
    from bench.precursors_runs import scenarios

    moe = next(s for s in scenarios(100) if s.name == "moe_ramp")
    top1 = with_overrides(moe, ["experts=16", "top_k=1", "lr_end=0.1", "tied=false"])
    assert (top1.run.experts, top1.run.top_k, top1.run.lr_end, top1.run.tied) == (16, 1, 0.1, False)
    assert top1.name == "moe_ramp" and "set experts=16" in top1.detail and moe.run.experts == 8
    for bad in (["experts"], ["family=llama"], ["nope=1"], ["top_k=9"], ["experts=x"]):
        with pytest.raises(ValueError):
            with_overrides(moe, bad)


def test_a_balancing_loss_can_stop_mid_run():
    """``--set balance=0.01 balance_until=1000``: the aux loss is in the step's loss before step 1,000 only."""
    from types import SimpleNamespace

    import torch

    from bench.precursors import with_overrides
    from bench.precursors_runs import RampRun, scenarios

    moe = next(s for s in scenarios(100) if s.name == "moe_ramp")
    cfg = with_overrides(moe, ["balance=0.01", "balance_until=1000"]).run
    assert (cfg.balance, cfg.balance_until) == (0.01, 1000.0)
    logits = torch.zeros(1, 3, 5)  # uniform: each position's loss is log 5
    model = lambda ids: logits  # noqa: E731
    model.aux_loss = torch.tensor(2.0)
    batch = SimpleNamespace(weights=torch.ones(1, 1, 3), windows=torch.zeros(1, 1, 4, dtype=torch.long),
                            inputs=lambda i: None, targets=lambda i: torch.zeros(1, 3, dtype=torch.long))
    def at(step: int) -> float:
        run = RampRun.__new__(RampRun)  # the loss closure only (no model built, no monitor)
        run.cfg, run.step_no, run.model = cfg, step, model
        return float(run.closure(batch)(0))

    before, after = at(999), at(1000)
    assert before == pytest.approx(math.log(5) + 0.01 * 2.0) and after == pytest.approx(math.log(5))

    cfg = with_overrides(moe, ["router_z_loss=0.001"]).run  # ST-MoE's router z-loss: Σ over layers of mean lse²
    model.router_logits = (torch.zeros(3, 4), torch.full((3, 4), 2.0))  # each layer's lse: log 4, 2 + log 4
    assert at(5) == pytest.approx(math.log(5) + 0.001 * (math.log(4) ** 2 + (2 + math.log(4)) ** 2))
    with pytest.raises(ValueError, match="need a MoE"):
        with_overrides(next(s for s in scenarios(100) if s.name == "llama_ramp"), ["router_z_loss=0.001"])


def test_a_grpo_run_s_loss_is_not_judged_its_incidents_are():
    rising = np.concatenate([np.full(500, 0.1), np.full(500, -3.0)])  # a policy-gradient loss moves either way
    run = _run("instability", [], rising)
    assert failure(run, 100)[0] is not None  # as a language model's loss, this would be a failure
    run["judge_loss"] = False
    assert failure(run, 100) == (None, "")
    run["incidents"] = [(700, ["grad_spike"])]
    assert failure(run, 100) == (700, "incident")


@pytest.mark.slow
def test_grpo_steps_hand_the_monitor_the_policy_s_own_entropy_and_rewards():
    """The rewards and the entropy the monitor records are what the sampled responses and the policy give, computed
    here from the same samples (the sampling is seeded by the step: it can be replayed before the step runs)."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import torch

    from bench.precursors_rl import GrpoConfig, GrpoRun

    cfg = GrpoConfig(steps=3, prompts=2, group=4, prompt=4, response=4, lr=1e-2)
    run = GrpoRun(cfg)
    try:
        for step in range(3):
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            seq, rollout = run.sample(gen)
            with torch.no_grad():
                logp = torch.log_softmax(run.model(seq[:, :-1]).float(), dim=-1)[:, cfg.prompt - 1:]  # (N, R, V)
            entropy = float(-(logp.exp() * logp).sum(-1).mean())
            chosen = logp.gather(-1, seq[:, cfg.prompt:, None])[..., 0]  # (N, R)
            assert torch.allclose(chosen, rollout, atol=1e-5)  # the sampling log-probs are the policy's
            rec = run.step().record
            assert run.rewards[-1] == pytest.approx(float(run.word_start[seq[:, cfg.prompt:]].float().mean()))
            assert rec.rl is not None and rec.rl.entropy_mean == pytest.approx(entropy, rel=1e-4)
            assert 0.0 < rec.rl.entropy_mean <= math.log(run.corpus.vocab) + 1e-6
            assert rec.rl.kl_rollout == pytest.approx(0.0, abs=1e-6)
            reward = run.word_start[seq[:, cfg.prompt:]].float().mean(1)  # (N,)
            for r in range(len(reward)):  # what an incident's culprit sample was (bench/precursors_runs.localized)
                got, group = run.describe(f"g{step}-{r}"), reward.view(-1, cfg.group)[r // cfg.group]
                assert got["reward"] == pytest.approx(float(reward[r]), abs=1e-3)
                assert got["group_rewards"] == pytest.approx(group.tolist(), abs=1e-3)
                centred = float(reward[r] - group.mean())
                assert got["advantage"] == pytest.approx(0.0, abs=1e-3) if abs(centred) < 1e-6 else \
                    math.copysign(1.0, got["advantage"]) == math.copysign(1.0, centred)
                assert 1 <= got["abs_advantage_rank"] <= len(reward)
    finally:
        run.close()


def test_a_policy_entropy_collapse_is_the_policy_s_and_only_its_entropy_names_it():
    n = 1000
    run = _run("instability", [_finding(400, "rl_kl_rollout", ""), _finding(500, "rl_entropy", "")],
               np.full(n, 0.0), incidents=[(800, ["grad_spike"])])
    run.update(instability="policy_entropy_collapse", judge_loss=False,
               series={"rl_entropy||": np.geomspace(7.6, 1.0, n), "rl_kl_rollout||": np.zeros(n)})
    row = score(run, CFG)
    assert row["failing_layer"] == "" and row["reproduced"] and row["announced_naming_layer"]
    first = row["first_by_statistic"]
    assert first["rl_entropy"]["names_failing_layer"] and not first["rl_kl_rollout"]["names_failing_layer"]
    run["series"] = {"rl_entropy||": np.linspace(7.6, 5.0, n)}  # ×0.66: no collapse
    assert not score(run, CFG)["reproduced"]


def _located(step: int, sample_id: str | None) -> dict:
    culprits = [] if sample_id is None else [(0, 1, 5, sample_id, 0.9)]
    return dict(step=step, status="located", level="sample", probes=1, explained=0.9, culprits=culprits)


def test_an_incident_a_control_shares_on_the_same_sample_is_the_datas_not_the_failure():
    from bench.precursors_score import score_all, shared_incidents

    loss = np.full(1000, 3.0)
    bad = _run("instability", [_finding(600, "attn_entropy", "l1")], loss,
               incidents=[(500, ["grad_spike"]), (800, ["grad_spike"])])
    ctl = _run("control", [], loss, incidents=[(500, ["grad_spike"])])
    for r in (bad, ctl):
        r["data_by_step"] = True
    bad["located"], ctl["located"] = [_located(500, "s500-0-1"), _located(800, "s800-1-0")], [_located(500, "s500-0-1")]
    assert shared_incidents(bad, [ctl], 100) == [500]
    row, crow = score_all([bad, ctl], CFG)
    assert row["failure"] == 800 and row["shared_with_control"] == [500]
    assert row["first_by_statistic"]["attn_entropy"]["lead"] == 200  # counted to 800, not to the data's spike at 500
    assert crow["failure"] == 500 and crow["shared_with_control"] == []  # a control's own incidents always count
    alone = score(bad, CFG)  # without its control: the first incident is the failure, as before
    assert alone["failure"] == 500 and alone["shared_with_control"] == []

    ctl["located"] = [_located(500, "s500-2-3")]  # the same step, another sample: not the same data's spike
    assert shared_incidents(bad, [ctl], 100) == [] and score_all([bad, ctl], CFG)[0]["failure"] == 500
    ctl["located"] = []  # the control's incident not localized: the step alone says it
    assert shared_incidents(bad, [ctl], 100) == [500]
    ctl["incidents"] = [(501, ["grad_spike"]), (500, ["loss_spike"])]  # another step; a kind that is no failure
    assert shared_incidents(bad, [ctl], 100) == []
    ctl["incidents"] = [(500, ["grad_spike"])]
    ctl["data_by_step"] = False  # a GRPO control samples its own data: a step's batch is not the same
    assert shared_incidents(bad, [ctl], 100) == []
    other = dict(ctl, data_by_step=True, instability="router_collapse")  # another instability's control
    assert score_all([bad, other], CFG)[0]["failure"] == 500
