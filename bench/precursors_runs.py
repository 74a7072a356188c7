"""The runs of ``python -m bench precursors``: small models trained until they fail (or, the controls, do not), with
gradloc attached and every step's precursor statistics, loss, global norm and incidents recorded.

A run's data is :mod:`bench.natural`'s (BPE over the standard library's docstrings and the licence texts). Its LR
either follows a ramp (exponential from ``lr`` to ``lr_end`` over the run: Wortsman et al.'s way to find where a
model stops being trainable) or :class:`bench.natural.RunConfig`'s warm-up and cosine; a GRPO run
(:mod:`bench.precursors_rl`) samples its own data. :func:`scenarios` pairs each instability with its control
(../shared/DESIGN.md §10).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bench.natural import Run, RunConfig, token_losses
from bench.precursors_rl import GrpoConfig, GrpoRun


@dataclass(frozen=True)
class RampConfig(RunConfig):
    """``lr`` at step 0 rising exponentially to ``lr_end`` at the last step (no warm-up, no decay); ``z_loss``: the
    coefficient of Wortsman et al.'s mean logsumexp² term added to the loss (0: none); ``balance``: a MoE's
    load-balancing loss coefficient (Switch Transformer's, as transformers computes it; 0: none), applied before step
    ``balance_until`` only (None: every step) — a balancing loss switched off mid-run; ``router_z_loss``: ST-MoE's
    router z-loss coefficient (Zoph et al. 2022: the mean over tokens of each router's logsumexp², summed over the
    layers, which keeps router logits from growing; 0: none)."""

    lr_end: float | None = None  # None: RunConfig's warm-up and cosine
    z_loss: float = 0.0
    balance: float = 0.0  # a MoE's load-balancing loss coefficient (0: none)
    balance_until: float | None = None  # the step the balancing loss stops at (None: never)
    router_z_loss: float = 0.0  # a MoE's router z-loss coefficient (0: none)

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.balance or self.router_z_loss) and self.family != "qwen3moe":
            raise ValueError(f"balance and router_z_loss need a MoE (family qwen3moe), not {self.family!r}")

    def lr_at(self, step: int) -> float:
        if self.lr_end is None:
            return super().lr_at(step)
        return self.lr * (self.lr_end / self.lr) ** (step / max(1, self.steps - 1))


@dataclass(frozen=True)
class Scenario:
    name: str
    role: str  # "instability" (it should fail) or "control" (it should not)
    run: RampConfig | GrpoConfig
    instability: str  # which instability the pair is about ("attention_logit_growth", ...)
    detail: str = ""


def _ramp(family: str, steps: int, lr_end: float, **kw: Any) -> RampConfig:
    return RampConfig(family=family, steps=steps, lr=1e-4, lr_end=lr_end, micro_batches=2, batch=4, seq=64,
                      weight_decay=0.0, **kw)


def scenarios(steps: int = 3000) -> tuple[Scenario, ...]:
    """The pairs: each instability beside its control(s), ``steps`` steps each."""
    return (
        Scenario("llama_ramp", "instability", _ramp("llama", steps, 0.1), "attention_logit_growth",
                 "HF Llama without qk-norm, LR 1e-4 -> 0.1 (exponential ramp)"),
        Scenario("qwen3_ramp", "control", _ramp("qwen3", steps, 0.03), "attention_logit_growth",
                 "HF Qwen3 (qk-norm), LR 1e-4 -> 0.03"),
        Scenario("moe_ramp", "instability", _ramp("qwen3moe", steps, 0.03), "router_collapse",
                 "HF Qwen3-MoE (8 experts, top-2) without a load-balancing loss, LR 1e-4 -> 0.03"),
        Scenario("moe_balanced", "control", _ramp("qwen3moe", steps, 0.03, balance=0.01), "router_collapse",
                 "the same with the load-balancing loss (0.01)"),
        Scenario("moe128_ramp", "instability", _ramp("qwen3moe", steps, 0.1, d_model=128), "router_collapse",
                 "HF Qwen3-MoE at hidden 128 (8 experts, top-2), no load-balancing loss, LR 1e-4 -> 0.1"),
        Scenario("moe128_cosine", "control",
                 RampConfig(family="qwen3moe", steps=steps, lr=3e-3, micro_batches=2, batch=4, seq=64, d_model=128),
                 "router_collapse", "the same MoE at LR 3e-3 (warm-up, cosine), weight decay 0.1"),
        Scenario("qwen3_untied", "instability", _ramp("qwen3", steps, 0.3, tied=False), "output_logit_divergence",
                 "HF Qwen3 (qk-norm) with its own output head, no z-loss, LR 1e-4 -> 0.3"),
        Scenario("qwen3_untied_zloss", "control", _ramp("qwen3", steps, 0.3, tied=False, z_loss=1e-4),
                 "output_logit_divergence", "the same with z-loss 1e-4 × logsumexp²"),
        Scenario("grpo_ramp", "instability", GrpoConfig(steps=steps, lr=1e-5, lr_end=1e-2), "policy_entropy_collapse",
                 "GRPO (groups of 8, word-start reward) on a Qwen3 from initialization, LR 1e-5 -> 1e-2"),
        Scenario("grpo_const", "control", GrpoConfig(steps=steps, lr=1e-4), "policy_entropy_collapse",
                 "the same at a constant LR 1e-4"),
        Scenario("llama_cosine", "control",
                 RampConfig(family="llama", steps=steps, lr=3e-3, micro_batches=2, batch=4, seq=64),
                 "attention_logit_growth", "the same Llama at LR 3e-3 (warm-up, cosine), weight decay 0.1"),
    )


class RampRun(Run):
    """:class:`bench.natural.Run` with the z-loss and load-balancing terms when configured."""

    def closure(self, batch):  # noqa: ANN001 - the base class's signature
        z, until = self.cfg.z_loss, self.cfg.balance_until
        balance = self.cfg.balance if until is None or self.step_no < until else 0.0
        router_z = self.cfg.router_z_loss
        if not (z or balance or router_z):
            return super().closure(batch)
        n, M = batch.weights.numel(), batch.windows.shape[0]

        def loss_for(i: int, mask: torch.Tensor | None = None) -> torch.Tensor:
            w = batch.weights[i] if mask is None else batch.weights[i] * mask
            logits = self.model(batch.inputs(i))  # (B, T, V)
            per_token = token_losses(logits, batch.targets(i))  # (B, T)
            if z:
                per_token = per_token + z * torch.logsumexp(logits.float(), dim=-1).square()  # (B, T)
            loss = (per_token * w).sum() / n
            aux = self.model.aux_loss
            if balance and aux is not None:
                loss = loss + balance * aux / M
            if router_z and self.model.router_logits:  # each layer's (B·T, E) router logits
                loss = loss + router_z * sum(torch.logsumexp(r.float(), dim=-1).square().mean()
                                             for r in self.model.router_logits) / M
            return loss

        return loss_for


def localized(step: int, incident: Any, describe: Any = None) -> dict[str, Any]:
    """An incident's localization in brief: status, level, probes, its top culprits (micro-batch, sample, position,
    sample id, share) and, where the run can say (``describe(sample_id)``: a GRPO run's advantage and rewards),
    what that sample was."""
    loc = incident.localization
    if loc is None:  # an incident not localized (e.g. a divergence)
        return dict(step=step, status="not localized", level=None, probes=0, explained=None, culprits=[])
    top = [(c.micro_batch, c.sample, c.position, c.sample_id, round(c.share, 3)) for c in loc.culprits[:3]]
    out: dict[str, Any] = dict(step=step, status=str(loc.status), level=str(loc.level), probes=loc.probes,
                               explained=None if loc.explained_share is None else round(loc.explained_share, 3),
                               culprits=top)
    if describe is not None and top and top[0][3] is not None:
        out["culprit_sample"] = describe(top[0][3])
    return out


def record_run(sc: Scenario, **watch: Any) -> dict[str, Any]:
    """Train ``sc`` with gradloc watching; every step's statistics as arrays (``series``: key -> (steps,) values,
    NaN where a step had none; key = "kind|layer|head"; ``records``: the monitor's step records, for a replay)."""
    torch.manual_seed(sc.run.seed)
    run = GrpoRun(sc.run, **watch) if isinstance(sc.run, GrpoConfig) else RampRun(sc.run, **watch)
    loss, norm, lr, spikes, incidents, findings, located, records = [], [], [], [], [], [], [], []
    series: dict[str, list[float]] = {}
    at: dict[str, list[tuple[int, int, int] | None]] = {}
    t0 = time.perf_counter()
    try:
        for s in range(sc.run.steps):
            rep = run.step()
            rec = rep.record
            records.append(rec)
            loss.append(float(rec.loss) if rec.loss is not None else math.nan)
            norm.append(rec.global_norm)
            lr.append(sc.run.lr_at(s))
            if rep.spike is not None and rep.spike.kinds:
                spikes.append((s, sorted(str(k) for k in rep.spike.kinds)))
            if rep.incident is not None:
                incidents.append((s, sorted(str(k) for k in rep.incident.spike.kinds)))
                located.append(localized(s, rep.incident, getattr(run, "describe", None)))
            findings.extend(getattr(rec, "precursor_findings", ()))
            values = [(f"{p.kind}|{p.layer}|{'' if p.head is None else p.head}", p.value, p.at) for p in rec.precursors]
            if rec.rl is not None:  # the RL statistics the drift detector judges (no layer)
                values += [(f"{k}||", v, None) for k, v in (("rl_entropy", rec.rl.entropy_mean),
                                                            ("rl_kl_rollout", rec.rl.kl_rollout)) if v is not None]
            for key, value, where in values:
                col = series.setdefault(key, [math.nan] * s)
                col.append(value)
                at.setdefault(key, [None] * s).append(where)
            for key, col in series.items():  # a series without a value this step
                if len(col) < s + 1:
                    col.append(math.nan)
                    at[key].append(None)
    finally:
        run.close()
    return dict(scenario=sc.name, role=sc.role, instability=sc.instability, detail=sc.detail,
                loss=np.asarray(loss), norm=np.asarray(norm), lr=np.asarray(lr), spikes=spikes, incidents=incidents,
                findings=findings, located=located, series={k: np.asarray(v) for k, v in series.items()}, at=at,
                records=records,
                seconds=time.perf_counter() - t0, params=run.params, judge_loss=getattr(run, "judge_loss", True),
                data_by_step=not isinstance(sc.run, GrpoConfig),  # its batches fixed by seed and step (GRPO: sampled)
                rewards=np.asarray(getattr(run, "rewards", [])))


def blow_up(loss: np.ndarray, window: int = 25, ratio: float = 1.3, after: int = 200) -> int | None:
    """The first step whose trailing ``window``-step mean loss exceeds ``ratio`` × the lowest such mean so far
    (after ``after`` steps: the first steps' loss falls fast); a non-finite loss counts. None: never."""
    best = math.inf
    for s in range(window, len(loss) + 1):
        chunk = loss[s - window:s]
        if not np.all(np.isfinite(chunk)):
            return s - 1
        m = float(chunk.mean())
        if s > after and m > ratio * best:
            return s - 1
        best = min(best, m)
    return None
