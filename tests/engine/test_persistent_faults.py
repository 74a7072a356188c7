"""A fault that persists: GRPO on the RL demo's task where, from ``FAULT`` on, the rollout engine's
weights are synced every step except three embedding rows (input and output embedding of ``<eos>``,
``7`` and ``3``), which keep their values from before the warm start — a weight-sync bug. Every fault
step's rollouts carry stale log-probs; some steps spike (which ones depends on the run's sampling
path, so on the machine's floats: the tests hold over a few seeds, never over one seed's steps).

Ground truth: a loss position is stale when its scored token is one of the two ids (the engine's
output row is stale) or its context holds one of them (the engine's input row is stale); a step's
stale share is what those positions carry of its gradient, measured with plain autograd.
Its real-vLLM version is tests/vllm_tier/inside/test_persistent.py (real rollouts; the trainer's LM-head rows of
<eos> and one byte moved by an update the engine misses): every stale-dominated flagged step localized, rl_mismatch
raised, healthy steps quiet; precision as counted here is unmet there on 1-2 steps per run (healthy tokens of
< 1% of ‖∇‖² named when the localizer has no probe left to drop them).
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from gradloc.adapters.pytorch import watch
from gradloc.adapters.rl import Rollouts, join
from gradloc.config import DetectorConfig, WatchConfig
from gradloc.demo.arith import EOS, MAX_ANSWER, PAD, PROMPT_TOKENS, VOCAB, encode, problems
from gradloc.demo.model import GPTConfig, TinyGPT
from gradloc.demo.rl import RLDemoConfig, _policy_loss, policy_step
from gradloc.demo.rl_parts import grpo_advantages, make_parts, warm_start
from gradloc.demo.sampler import sample
from gradloc.detector import INCIDENT
from gradloc.records import OutlierKind
from tests.engine.fault_checks import assert_localized

FAULT, STEPS = 35, 50
STALE = (EOS, *encode("7"), *encode("3"))
STALE_ROWS = ("tok.weight", "head.weight")


@functools.lru_cache(maxsize=None)
def _run(seed: int, stale_from: int) -> list[dict]:
    """One GRPO run whose engine keeps the two rows as they were after ``stale_from`` warm-start steps;
    per step: its report, per (micro-batch, sample, position) whether it is stale, and from ``FAULT`` on
    the stale positions' share of the step's gradient (:func:`_stale_share`, before the optimizer step)."""
    cfg = RLDemoConfig(seed=seed)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = TinyGPT(_gpt(cfg))
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
            ids = torch.tensor(STALE)
            stale = (torch.isin(rollouts.input_ids, ids).cumsum(1) > 0) | torch.isin(rollouts.targets, ids)  # (S, L)
            share = _stale_share(cfg, model, rollouts, adv_tok, rows, stale) if step >= FAULT else None
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps.append(dict(report=report, share=share,
                              stale=lambda mb, s, p, rows=rows, st=stale: bool(st[rows[mb][s], p])))
    return steps


def _gpt(cfg: RLDemoConfig) -> GPTConfig:
    return GPTConfig(vocab=VOCAB, seq=PROMPT_TOKENS + MAX_ANSWER, d_model=cfg.d_model, n_layers=cfg.n_layers)


def _stale_share(cfg: RLDemoConfig, model: TinyGPT, rollouts: Rollouts, adv_tok: torch.Tensor,
                 rows: list[list[int]], stale: torch.Tensor) -> float:
    """Ground truth, independent of gradloc: ⟨∇_S, ∇⟩ / ‖∇‖², where ∇ is the gradient of the step's
    policy loss (policy_step's, before clipping) and ∇_S that of the same loss restricted to the stale
    positions ``stale`` (S, L), both by plain autograd on an unwatched copy of the model with the step's
    weights. Checked once by hand: ∇ equals the trained model's gradient exactly, and an all-stale
    mask gives 1."""
    ref = TinyGPT(_gpt(cfg))
    ref.load_state_dict(model.state_dict())
    params = list(ref.parameters())
    parts = make_parts(rollouts, adv_tok, rows, cfg.packed)  # padded: part i is rows[i], positions [0, T_i)
    n_tokens = int(rollouts.loss_mask.sum())

    def grad(masked: bool) -> torch.Tensor:
        olds: dict[int, torch.Tensor] = {}  # π_old: this pass's own log-probs, detached (policy_step's)
        loss = sum(_policy_loss(ref, part, olds, i, cfg.clip_epsilon, n_tokens,
                                stale[rows[i], : part.input_ids.shape[1]].float() if masked else None, None)
                   for i, part in enumerate(parts))  # (S, L) -> (B, T): part i's stale positions
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, allow_unused=False)])

    full, sub = grad(False), grad(True)
    return float(sub @ full / (full @ full))


# The runs: seeds 0-5 with the engine's rows from before the warm start (stale_from 0: the mismatch is large enough
# to be a sustained finding). Which steps spike depends on the run's sampling path, which float differences between
# CPUs change, so nothing below names a seed or a step: the assertions hold over whatever the runs flag. With two stale
# rows (<eos>, 7) the fault steps spiked on an AMD EPYC (seeds 1, 5, 6 of 0-7) and on one step of 12 seeds on an
# Intel Xeon (2026-11-29): too few to test anything there; the third row (3) makes the fault strong enough on both.
RUNS = [(seed, 0) for seed in range(6)]
LATE_RUNS: list[tuple[int, int]] = []  # (seed, stale_from > 0): a smaller mismatch; none run at present
MIN_FAULT_STEPS = 3  # stale-dominated flagged steps over RUNS + LATE_RUNS: runs may drift and pass
MIN_FOUND = 4  # of the RUNS, those whose sustained rl_mismatch finding must come during the fault
DOMINATED = 0.5  # a fault step: the stale positions carry at least this share of the flagged step's ‖∇‖²
TARGET = 0.9  # issue 32's precision target: asserted on every stale-dominated flagged step (measured 1.0 on all 5)


def _precision(step: dict) -> float:
    hits = [step["stale"](c.micro_batch, c.sample, c.position) for c in step["report"].incident.localization.culprits]
    return sum(hits) / len(hits)


def _flagged(seed: int, stale_from: int) -> list[dict]:
    return [s for s in _run(seed, stale_from)[FAULT:] if INCIDENT.intersection(s["report"].spike.kinds)]


def test_the_healthy_steps_open_nothing_and_the_mismatch_is_found_during_the_fault() -> None:
    """Every run: no incident and no rl_mismatch finding before the fault. Most runs (MIN_FOUND of RUNS): the
    sustained finding during it — a run whose mismatch share hovers at the margin may never hold it for
    ``rl_patience`` steps in a row (seeds 5 and 6 on an Intel Xeon with two stale rows)."""
    during = 0
    for seed, stale_from in RUNS:
        reports = [s["report"] for s in _run(seed, stale_from)]
        assert not [r.record.step for r in reports[:FAULT] if r.incident is not None], seed
        found = [r.record.step for r in reports if r.record.samples is not None and any(
            o.kind == OutlierKind.RL_MISMATCH for o in r.record.samples.outliers)]
        assert not found or found[0] >= FAULT, (seed, found)  # never before the fault
        during += bool(found)
    assert during >= MIN_FOUND, during


def test_every_stale_dominated_flagged_step_of_a_persistent_rl_fault_is_its_own_located_incident() -> None:
    """A fault step: a step in the fault that the detector flags (incident kinds) and whose gradient the
    stale positions dominate, ⟨∇_S, ∇⟩/‖∇‖² ≥ ``DOMINATED``, measured by plain autograd
    (:func:`_stale_share`), not by gradloc. Each one opens its own incident or a follow-up (never folded
    into an earlier episode), is located, and names stale positions only: precision (share of the
    named culprits that are stale) ≥ ``TARGET``, issue 32's 0.9. Measured with three stale rows (2026-11-29, Intel
    Xeon, torch 2.13.0+cpu), seed/step: stale share, precision, probes — 0/35: 0.985, 1.0, 1; 1/38: 0.94, 1.0, 1;
    1/47: 0.83, 1.0, 2 (a new cause following 38's incident); 3/35: 0.95, 1.0, 1. Measured with two stale rows
    (<eos>, 7; 2026-11-28, AMD EPYC), seed/stale_from/step: stale share, precision, probes — 1/0/37: 0.82, 1.0, 3;
    5/0/36: 0.77, 1.0, 1; 6/0/45: 0.92, 1.0, 1; 3/30/39: 0.92, 1.0, 1; 6/30/39: 0.87, 1.0, 2.
    Before the localizer measured the candidates it estimates below the naming floor
    (gradloc/localizer/prune.py), 1/0/37 and 6/30/39 were 0.5: each named a healthy token beside the
    stale one, carrying 0.096 and 0.001 of ‖∇‖² by autograd (0.127 and 0.090 as the score split
    reported them). Seed 1's healthy token is measured just under the 0.1 floor: a run whose floats
    put such a token over it names it, and fails here — a real contributor named, counted as a miss.
    With stale_from 30, seed 1's step 48 was flagged but is not a fault step (stale share 0.24: a GRPO
    spike of its own; measured before, not run here), as flagged steps may be, so only the stale-dominated ones are held to the localization bar. No spike
    fell inside an earlier one's episode in any of these runs: the follow-up path is covered by
    tests/detector and tests/agent."""
    rows, fault = [], []
    for seed, stale_from in RUNS + LATE_RUNS:
        for s in _flagged(seed, stale_from):
            r = s["report"]
            loc = r.incident.localization if r.incident is not None else None
            prec = _precision(s) if loc is not None and loc.culprits else None
            rows.append((seed, stale_from, r.record.step, round(s["share"], 3), prec, loc and loc.probes,
                         r.spike.follows))
            if s["share"] >= DOMINATED:
                fault.append(s)
    print("\n(seed, stale_from, step, stale share, precision, probes, follows):", *rows, sep="\n  ")
    met = [s for s in fault if s["report"].incident is not None and s["report"].incident.localization.culprits
           and _precision(s) >= TARGET]
    print(f"precision >= {TARGET} on {len(met)} of {len(fault)} stale-dominated flagged steps")
    assert len(fault) >= MIN_FAULT_STEPS, f"the scenario no longer tests anything: flagged steps {rows}"
    for s in fault:
        loc = assert_localized(s["report"], s["share"])
        assert _precision(s) >= TARGET, (s["report"].record.step, s["share"], loc.culprits)
