"""A fault that persists, on real vLLM rollouts: the engine is stale on two rows of the LM head.

The real-vLLM version of tests/engine/test_persistent_faults.py (issue 32: a weight-sync bug leaves the
engine with stale rows for two token ids; GRPO; several steps in a row spike, each with new culprits).

The CPU engine cannot take new weights (tests/vllm_tier/README.md: its linear layers are repacked at load
time), so the fault is built the other way round, which is the same bug seen from the trainer: the engine
keeps serving the weights it loaded; the trainer (``transformers`` Llama from the same safetensors) is
identical to it for the ``FAULT`` healthy steps, then takes one update that the sync misses on two rows: from
step ``FAULT`` on, the trainer's LM-head rows of ``STALE`` are moved by ``ROW_STEP`` along the trainer's own
accumulated policy gradient on those rows over the healthy steps (a normalised descent step on each row: where
GRPO was pushing them). Everything else stays in sync. Every step samples NEW rollouts (engine seed = step), so
every fault step has new culprits. Steps do not update the weights otherwise (as test_grpo.py).

Ground truth, independent of gradloc: only output rows are stale, so a loss position is stale when the token it
scores is one of ``STALE``; a step's stale share is ⟨∇_S, ∇⟩ / ‖∇‖² by plain autograd on an unwatched copy of
the trainer (∇_S: the same loss restricted to the stale positions).

Choosing the rows (measured, not assumed, with /tmp scripts on 2026-11-28; the engine's seeds 0-23): of the 25 ids
most sampled in completions, a head row moved alone by a normalised gradient step of 3 made later steps' gradient
dominated by its positions only for 'orm' (id 364: 1.7–3.7× the healthy mean norm, 70–94% of ‖∇‖² on 4 of 6 steps);
'):' (383) did so at 6 (1.7–1.8×, 73–80% on 3 of 6). EOS, the most frequent, did nothing at 3 or 6 (norm 0.5–0.9×,
share 0): the engine samples EOS where it is already likely, so its importance weight π_train / π_rollout stays
near 1; what moving its row changes is every other token's π_train, downwards (weights < 1: a quieter step).
So the rows are 'orm' and '):', BPE merges in 13% of completions each ('):' also ends a prompt; only completion
tokens are scored).

Two sizes of the missed update (ROW_STEPS), 8 fault steps each (steps 12–19), healthy steps 0–11 identical (global
norm 5.4–9.7, z after the 6-step warm-up −4.5 … −0.9, no incident, mismatch share 0). Flagged fault steps, measured
2026-11-28 (`PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -q tests/vllm_tier/inside`; the
summary prints them): step, z, global norm, stale share of ‖∇‖², incident (<N: a follow-up of step N's), precision,
probes, % of loss tokens with |log π_train − log π_rollout| > log 2 (the rl_mismatch line is 5%), the largest
stale-token log ratio:

- step 5 (target met): 12: z 53, 45.1, 0.983, incident, 1.0, 1, 6.4%, 2.95 · 13: z 86, 72.9, 0.993, <12, 1.0, 1,
  5.6% · 14: z 83, 75.1, 0.991, <12, 1.0, 1, 5.4% · 15: z 119, 111.5, 0.996, <12, 1.0, 1, 5.7%, 3.39. Steps 16–19
  are not flagged (z −0.1 … 6.3; stale share 0.50, 0.50, 0.75, 0.00). rl_mismatch is raised at step 14 (the 3rd
  step in a row above the line). The margin that decides the follow-ups is thin: 5.4–6.4% against the 5% line.
- step 4 (target NOT met, asserted as strict xfails): 12: z 22, 23.3, 0.926, incident, **0.5** (a healthy token
  named beside the stale one), 1, 4.5%, 2.37 · 13: z 39, 36.9, 0.976, **folded** into 12's episode, 3.6% · 14: z 37,
  38.2, 0.967, folded, 3.7% · 15: z 55, 56.2, 0.986, folded, 3.6%, 2.86. Fewer than 5% of the tokens are off by
  more than log 2, so the step's rollouts never cross the rl_mismatch line (streak 1 at most, at step 18: no
  finding), nothing marks the new culprits as bad data (gradloc/detector/detector.py ``new_cause`` needs a surprise
  outlier or a mismatch streak), and each larger spike with new culprits folds: 1.58×, 1.03× and 1.47× the
  episode's largest norm so far (the 2× escalation line moves up with every folded step). This is issue 32's
  step 31 on real rollouts. Precision and folding were read from the same run's reports.
"""
from __future__ import annotations

import math

import pytest
import torch

import gradloc
from gradloc.detector import INCIDENT
from gradloc.records import OutlierKind
from tests.vllm_tier.inside import engine
from tests.vllm_tier.inside.grpo import MICRO_BATCHES, grpo_step, micro_batches, policy_loss, sample_batch

pytestmark = pytest.mark.vllm

WARMUP = 6  # the detector's warm-up (default 25, shortened for time as test_grpo.py)
FAULT = 12  # healthy steps: the detector's warm-up, then 6 armed ones; ≥ the rl_mismatch baseline's 10
STEPS = FAULT + 8  # 8 fault steps, as the run
STALE = (364, 383)  # ' orm', '):'
ROW_STEPS = (5.0, 4.0)  # the missed update's size on each row (a row's norm is ~5.7): see the module docstring
DOMINATED = 0.5  # a fault step: the stale positions carry at least this share of the step's ‖∇‖²
TARGET = 0.9  # issue 32's precision target
MIN_FAULT_STEPS = 2


def _stale_rows(model, grad: torch.Tensor, row_step: float) -> None:
    """The missed update: the trainer's head rows of STALE moved by ``row_step`` along −grad (normalised per row)."""
    rows = list(STALE)
    with torch.no_grad():
        g = grad[rows]  # (2, D)
        model.lm_head.weight[rows] -= row_step * g / g.norm(dim=1, keepdim=True)


def _is_stale(mb) -> torch.Tensor:
    """(B, T) the micro-batch's loss positions that score a STALE id (the engine's output row is stale)."""
    return torch.isin(mb.targets, torch.tensor(STALE)) & mb.loss_mask


def _stale_share(ref, batch) -> float:
    """⟨∇_S, ∇⟩ / ‖∇‖² of the step's GRPO loss by plain autograd on ``ref`` (unwatched, the trainer's weights),
    ∇_S that of the same loss restricted to the stale positions (:func:`_is_stale`)."""
    ro = batch.rollouts
    size = len(ro.sample_ids) // MICRO_BATCHES
    mbs = micro_batches(ro, "padded")
    params = list(ref.parameters())

    def grad(masked: bool) -> torch.Tensor:
        loss = sum(policy_loss(ref, mb, batch.advantages[i * size:(i + 1) * size], ro.loss_mask.sum(), "padded",
                               _is_stale(mb).float() if masked else None) for i, mb in enumerate(mbs))
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    full, sub = grad(False), grad(True)
    return float(sub @ full / (full @ full))


_RUNS: dict[float, list[dict]] = {}


@pytest.fixture(scope="module")
def batches(llm, tokenizer) -> list:
    """STEPS rollout batches, engine seed = step: the engine's weights never change, so every run shares them."""
    return [sample_batch(llm, tokenizer, seed=step) for step in range(STEPS)]


@pytest.fixture
def fault_run(batches, model_dir, request) -> list[dict]:
    """The run with the missed update of size ``row_step`` (the test's parameter), made once per size."""
    row_step = request.node.callspec.params["row_step"]
    if row_step not in _RUNS:
        _RUNS[row_step] = _run(batches, model_dir, row_step)
    return _RUNS[row_step]


def _run(batches: list, model_dir, row_step: float) -> list[dict]:
    """STEPS GRPO steps under gradloc.watch; per step: its report, the stale mask and log π_train − log π_rollout
    of each micro-batch, and (fault steps) the stale share."""
    model = engine.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    ref = engine.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    mon = gradloc.watch(model, detector=gradloc.DetectorConfig(warmup=WARMUP), update_ratio="off", store=False)
    head_grad = torch.zeros_like(model.lm_head.weight)
    steps = []
    try:
        for step, batch in enumerate(batches):
            if step == FAULT:
                for m in (model, ref):
                    _stale_rows(m, head_grad, row_step)
            report, mbs, logps = grpo_step(model, mon, batch, "padded")
            if step < FAULT:
                head_grad += model.lm_head.weight.grad
            model.zero_grad(set_to_none=True)
            steps.append(dict(report=report, stale=[_is_stale(mb) for mb in mbs],
                              log_ratio=[lp - mb.rollout_logp for lp, mb in zip(logps, mbs)],  # (B, T), NaN off loss
                              share=_stale_share(ref, batch) if step >= FAULT else None))
    finally:
        mon.close()
    return steps


def _precision(step: dict) -> float:
    """The share of the incident's named culprit positions that are stale."""
    hits = [bool(step["stale"][c.micro_batch][c.sample, c.position])
            for c in step["report"].incident.localization.culprits]
    return sum(hits) / len(hits)


def _row(step: dict) -> dict:
    """One step's figures: flagged?, z, norm, stale share, incident / follow-up, precision, probes, log ratios."""
    r = step["report"]
    loc = r.incident.localization if r.incident is not None else None
    lr = torch.cat([x[m] for x, m in zip(step["log_ratio"], step["stale"])])
    allr = torch.cat([x[~x.isnan()] for x in step["log_ratio"]])
    return dict(step=r.record.step, flagged=not INCIDENT.isdisjoint(r.spike.kinds), kinds=[k.value for k in r.spike.kinds],
                z=r.spike.z and round(r.spike.z, 1), norm=round(r.spike.global_norm, 2),
                share=step["share"] and round(step["share"], 3),
                incident=r.incident is not None, follows=r.spike.follows, episode=r.spike.episode,
                precision=_precision(step) if loc is not None and loc.culprits else None,
                probes=loc.probes if loc is not None else None, status=loc.status if loc is not None else None,
                stale_lr_max=round(float(lr.max()), 2) if lr.numel() else None,
                mismatch=round(float((allr.abs() > math.log(2)).float().mean()), 3),
                streak=r.record.samples.rl_mismatch_streak if r.record.samples is not None else None)


def _flagged_fault_steps(run: list[dict]) -> list[dict]:
    """Fault steps the detector flags (incident kinds) whose gradient the stale positions dominate."""
    return [s for s in run[FAULT:] if not INCIDENT.isdisjoint(s["report"].spike.kinds) and s["share"] >= DOMINATED]


# Row step 4: the symptom on real rollouts. 3.6–4.5% of its loss tokens are off by more than log 2, under the
# rl_mismatch line (2 × baseline + rl_margin 5%): no mismatch streak, so nothing marks the new culprits as bad data
# and the new-cause rule folds them (gradloc/detector/detector.py, new_cause). See the module docstring.
UNMET = pytest.mark.xfail(strict=True, reason=(
    "issue 32 target unmet at row step 4: steps 13-15 (97-99% of ||grad||^2 stale, z 37-55) fold into step 12's "
    "episode: only 3.6-4.5% of loss tokens are off by > log 2, under the rl_mismatch line (5%), so no mismatch "
    "streak marks the new culprits; step 12 names a healthy token beside the stale one (precision 0.5); "
    "rl_mismatch is never raised (streak 1 at most)"))
SIZES = [pytest.param(5.0, id="step5"), pytest.param(4.0, id="step4")]
SIZES_UNMET_AT_4 = [pytest.param(5.0, id="step5"), pytest.param(4.0, id="step4", marks=UNMET)]


@pytest.mark.parametrize("row_step", SIZES)
def test_healthy_steps_open_nothing_and_the_fault_opens_a_located_incident(fault_run, row_step, measured):
    rows = [_row(s) for s in fault_run]
    measured[f"persistent fault, row step {row_step:g}: (step, z, norm, stale share, incident/follows, precision, "
             f"probes, mismatch %, max stale log ratio)"] = "; ".join(
        f"{r['step']} z{r['z']} n{r['norm']} s{r['share']} {'I' if r['incident'] else '-'}"
        f"{'' if r['follows'] is None else '<' + str(r['follows'])}{'' if r['precision'] is None else ' p' + str(r['precision'])}"
        f"{'' if r['probes'] is None else ' x' + str(r['probes'])} m{100 * r['mismatch']:.1f} l{r['stale_lr_max']}"
        for r in rows[FAULT:] if r["flagged"])
    for s in fault_run[:FAULT]:  # same weights as the engine: no mismatch, no incident
        r = s["report"]
        assert r.incident is None and INCIDENT.isdisjoint(r.spike.kinds), r.spike
        assert r.record.rl.mismatch_fraction == 0.0
    assert all(s["report"].spike.z is not None for s in fault_run[WARMUP:FAULT])  # the detector was armed
    opened = [s for s in fault_run[FAULT:] if s["report"].incident is not None]
    assert opened and opened[0]["report"].incident.localization.status == "located", [_row(s) for s in fault_run[FAULT:]]
    top = opened[0]["report"].incident.localization.culprits[0]
    assert opened[0]["stale"][top.micro_batch][top.sample, top.position]  # its top culprit scores a stale id


@pytest.mark.parametrize("row_step", SIZES_UNMET_AT_4)
def test_every_stale_dominated_flagged_fault_step_is_localized(fault_run, row_step):
    """Issue 32's target: every flagged fault step whose gradient the stale positions dominate (≥ DOMINATED, by
    autograd) is its own incident or a follow-up naming its own culprits, located, precision ≥ TARGET."""
    fault = _flagged_fault_steps(fault_run)
    print(*(_row(s) for s in fault_run[FAULT:]), sep="\n")
    assert len(fault) >= MIN_FAULT_STEPS, (
        f"the scenario no longer tests anything: {[_row(s) for s in fault_run[FAULT:]]}")
    for s in fault:
        r = s["report"]
        assert r.incident is not None, f"step {r.record.step} was folded into step {r.spike.episode}'s episode: {_row(s)}"
        if r.spike.follows is not None:  # a follow-up: a new cause inside an earlier incident's episode
            assert r.spike.follows < r.record.step and "new cause" in r.spike.detail, r.spike
        loc = r.incident.localization
        assert loc.status == "located" and loc.culprits, _row(s)
        assert _precision(s) >= TARGET, (_row(s), loc.culprits)


@pytest.mark.parametrize("row_step", SIZES_UNMET_AT_4)
def test_the_sustained_mismatch_finding_is_raised_during_the_fault(fault_run, row_step):
    found = [s["report"].record.step for s in fault_run if s["report"].record.samples is not None and any(
        o.kind == OutlierKind.RL_MISMATCH for o in s["report"].record.samples.outliers)]
    assert found and found[0] >= FAULT, ([_row(s) for s in fault_run[FAULT:]], found)
