"""What kind of spike it is, with the numbers that decided it (criteria: docs/rl.md, "Classification").

Culprit tokens with RL fields are classed one by one, in this order (the first that holds):

1. ``train_inference_mismatch``: |log π_old − log π_rollout| ≥ τ at the token, or on average over
   its sequence (the geometric-mean ratio outside [e^−τ, e^τ]) — the trainer and the inference
   engine scoring the same weights differently (π_train stands in for π_old when on-policy);
2. ``stale_off_policy``: |log π_train − log π_old| ≥ τ_stale;
3. ``low_prob_high_advantage``: π_train ≤ p_low, |A| ≥ z × the step's RMS advantage, through an
   unclipped ratio;
4. ``unclassified``: none of these (the evidence still lists the token's values).

The incident takes the class carrying the largest share of its culprits. A diffuse spike, or one
whose culprits fit no class, is ``layer_concentrated`` when one layer carries ≥ ``layer_share`` of
‖∇‖² and its own z-score flagged it; otherwise ``diffuse`` (status diffuse) or ``unclassified``.
"""
from __future__ import annotations

import math
from dataclasses import replace

from gradloc.config import ClassifierConfig
from gradloc.records import (
    Classification,
    Evidence,
    Localization,
    SpikeEvent,
    StepRecord,
    TokenRL,
)

PRECEDENCE = ("train_inference_mismatch", "stale_off_policy", "low_prob_high_advantage", "unclassified")


def classify(loc: Localization, rec: StepRecord, spike: SpikeEvent,
             cfg: ClassifierConfig) -> tuple[Localization, Classification]:
    """The localization with each RL culprit classified, and the incident's class."""
    rms = rec.rl.advantage_rms if rec.rl is not None else None
    culprits = tuple(replace(c, classification=culprit_class(c.rl, rms, cfg)) if c.rl is not None else c
                     for c in loc.culprits)
    loc = replace(loc, culprits=culprits)
    return loc, incident_class(loc, rec, spike, cfg)


def culprit_class(r: TokenRL, advantage_rms: float | None, cfg: ClassifierConfig) -> Classification:
    ev = _evidence(r)
    lr, seq = r.log_ratio, r.sequence_log_ratio
    if lr is not None and abs(lr) >= cfg.mismatch_log_ratio:
        return Classification("train_inference_mismatch", f"log π_trainer − log π_rollout = {lr:+.3g} at this token "
                              f"(ratio {math.exp(lr):.3g}): the trainer and the inference engine disagree on it",
                              ev + (Evidence("threshold", cfg.mismatch_log_ratio),))
    if seq is not None and abs(seq) >= cfg.mismatch_log_ratio:
        return Classification("train_inference_mismatch", f"its sequence's mean log π_trainer − log π_rollout is {seq:+.3g} "
                              f"(geometric-mean ratio {math.exp(seq):.3g})",
                              ev + (Evidence("threshold", cfg.mismatch_log_ratio),))
    old = r.log_ratio_old
    if old is not None and abs(old) >= cfg.stale_log_ratio:
        return Classification("stale_off_policy", f"log π_train − log π_old = {old:+.3g} (ratio {math.exp(old):.3g}): "
                              "the policy moved far from the one the ratio is taken against",
                              ev + (Evidence("threshold", cfg.stale_log_ratio),))
    low = _low_prob_high_advantage(r, advantage_rms, cfg)
    if low is not None:
        return Classification("low_prob_high_advantage", low, ev + (Evidence("advantage_rms", advantage_rms or 0.0),))
    return Classification("unclassified", "no RL criterion holds for this token", ev)


def _low_prob_high_advantage(r: TokenRL, rms: float | None, cfg: ClassifierConfig) -> str | None:
    if r.logp is None or r.advantage is None or not rms:
        return None
    p = math.exp(r.logp)
    if p > cfg.low_prob or abs(r.advantage) < cfg.advantage_z * rms:
        return None
    clipped = r.clipped if r.clipped is not None else (r.ratio is not None and abs(r.ratio - 1) > cfg.clip_epsilon)
    if clipped:
        return None
    return (f"π_train = {p:.3g} with advantage {r.advantage:+.3g} ({abs(r.advantage) / rms:.1f}× the step's RMS) "
            "through an unclipped ratio")


def _evidence(r: TokenRL) -> tuple[Evidence, ...]:
    named = [("log_ratio", r.log_ratio), ("sequence_log_ratio", r.sequence_log_ratio),
             ("log_ratio_old", r.log_ratio_old), ("logp", r.logp), ("advantage", r.advantage), ("ratio", r.ratio),
             ("clipped", None if r.clipped is None else float(r.clipped)), ("entropy", r.entropy)]
    return tuple(Evidence(k, float(v)) for k, v in named if v is not None)


def incident_class(loc: Localization, rec: StepRecord, spike: SpikeEvent, cfg: ClassifierConfig) -> Classification:
    by_kind: dict[str, float] = {}
    for c in loc.culprits:
        if c.classification is not None:
            share = abs(c.share) if math.isfinite(c.share) else 0.0
            by_kind[c.classification.kind] = by_kind.get(c.classification.kind, 0.0) + share
    classed = {k: v for k, v in by_kind.items() if k != "unclassified"}
    if classed:
        kind = max(classed, key=lambda k: (classed[k], -PRECEDENCE.index(k)))
        ev = tuple(Evidence(f"share_{k}", v) for k, v in sorted(by_kind.items()))
        n = sum(1 for c in loc.culprits if c.classification is not None and c.classification.kind == kind)
        return Classification(kind, f"{n} of {len(loc.culprits)} culprit token(s), {classed[kind]:.0%} of ‖∇‖², "
                              f"are {kind.replace('_', ' ')}", ev)
    layer = _layer_concentrated(rec, spike, cfg)
    if layer is not None:
        return layer
    if loc.status == "diffuse":
        top = max((s.share or s.score_share for s in loc.samples), default=math.nan)
        return Classification("diffuse", "no small token set explains the spike", (Evidence("top_sample_share", top),))
    return Classification("unclassified", "no culprit carries RL fields that fit a class, and no layer dominates")


def _layer_concentrated(rec: StepRecord, spike: SpikeEvent, cfg: ClassifierConfig) -> Classification | None:
    sq = [(s.grad_norm ** 2, s.layer) for s in rec.layers if math.isfinite(s.grad_norm)]
    total = sum(v for v, _ in sq)
    if not sq or total <= 0:
        return None
    top, name = max(sq)
    share = top / total
    if share < cfg.layer_share or name not in spike.layers:
        return None
    return Classification("layer_concentrated", f"{name} carries {share:.0%} of ‖∇‖² and its own z-score flagged it",
                          (Evidence("top_layer_share", share), Evidence("flagged_layers", float(len(spike.layers)))))
