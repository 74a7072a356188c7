"""A flagged step → :class:`~gradloc.records.Incident`: localize (probes), then the opt-in remedy.

Runs on the training thread inside ``Monitor.end_step``, on spike steps only. Never raises: a
failed localization becomes an ``unavailable`` localization with the error in its note.
"""
from __future__ import annotations

import logging
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from gradloc.collector.token_summary import StepScores
from gradloc.config import WatchConfig
from gradloc.detector import LOCALIZE
from gradloc.localizer import Localizer, ProbeFn, ProbeSession, SpikeContext, StoredGradient, TokenView
from gradloc.localizer.classify import classify
from gradloc.localizer.localizer import LocalizeResult
from gradloc.localizer.remedy import apply_remedy
from gradloc.records import Incident, IncidentScope, Localization, Method, SpikeEvent, Status, StepRecord

log = logging.getLogger("gradloc")


@dataclass(frozen=True)
class SpikeInputs:
    record: StepRecord
    spike: SpikeEvent
    scores: StepScores | None
    probe: ProbeFn | None
    scale: float  # GradScaler scale the stored gradients were produced with (1.0 without one)
    unscaled: bool  # the stored gradients are already unscaled
    has_scaler: bool
    rl: dict[str, torch.Tensor] | None = None  # the step's RL fields over its positions (device), if given
    job_loss: float | None = None  # a multi-rank job's mean loss (the detector's view); None: the record's
    unattributed: float | None = None  # the scores' unattributed share when not the record's (on_spike re-runs)

    @property
    def unattributed_share(self) -> float:
        """The share of ‖∇‖² the scores do not cover (1 without token statistics)."""
        if self.unattributed is not None:
            return self.unattributed
        return self.record.tokens.unattributed_share if self.record.tokens else 1.0


class SpikePath:
    scope = IncidentScope.RANK  # the incidents' scope (records.Incident.scope)

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter], token_layers: Sequence[str],
                 localizer: Localizer, cfg: WatchConfig, pause_hooks: Callable[[bool], None],
                 counters: Counter[str], heads: dict[int, nn.Module] | None = None) -> None:
        self.model, self.params, self.token_layers = model, list(params), list(token_layers)
        self.localizer, self.cfg, self.pause_hooks, self.counters = localizer, cfg, pause_hooks, counters
        self.heads = dict(heads or {})  # token-layer index -> its one module (for the decomposition probe)

    def head_for(self, view: TokenView | None) -> nn.Module | None:
        """The module of the view's exact (loss-head) layer, when that layer is one module."""
        return self.heads.get(view.exact_layer) if view is not None and view.exact_layer is not None else None

    def incident(self, x: SpikeInputs) -> Incident:
        result = None
        if LOCALIZE.intersection(x.spike.kinds):
            result = self._localize(x)
        loc = result.localization if result is not None else None
        classification = None
        if loc is not None:
            try:
                loc, classification = classify(loc, x.record, x.spike, self.cfg.localizer.classifier)
            except Exception:  # never raise into the training loop
                self.counters["classify_errors"] += 1
                log.warning("gradloc: classifying step %d failed", x.record.step, exc_info=True)
        remedy = None
        if self.cfg.remedy is not None:
            grad_scale = 1.0 if x.unscaled else x.scale
            remedy = apply_remedy(self.cfg.remedy, loc, result.culprit_grad if result else None,
                                  self.params, grad_scale, x.has_scaler)
            self.counters[f"remedy_{'applied' if remedy.applied else 'refused'}"] += 1
        rec = x.record
        top = tuple(sorted(rec.layers, key=lambda s: -s.grad_norm if s.grad_norm == s.grad_norm else 0)[:5])
        return Incident(uuid.uuid4().hex, rec.job, rec.rank, rec.step, rec.time_unix, x.spike, loc,
                        top_layers=top, remedy=remedy, classification=classification, scope=self.scope)

    def _localize(self, x: SpikeInputs) -> LocalizeResult:
        rec = x.record
        try:
            view = token_view(x.scores, self.token_layers, x.scale, x.unattributed_share, x.rl)
            stored = StoredGradient([p.grad for p in self.params], 1.0 if x.unscaled else 1.0 / x.scale,
                                    rec.global_norm)
            opener = None
            if x.probe is not None and x.scores is not None:
                scores, probe = x.scores, x.probe

                def opener() -> ProbeSession:
                    return ProbeSession(self.model, self.params, scores.metas, probe, self.pause_hooks)
            s = x.spike
            ctx = SpikeContext(s.mean, rec.loss, s.loss_mean, s.std, self.cfg.detector.z_threshold,
                               outliers=outlier_samples(rec))
            return self.localizer.localize(rec.step, view, stored, opener, ctx,
                                           keep_grad=self.cfg.remedy == "drop_culprits", head=self.head_for(view))
        except Exception as exc:  # never raise into the training loop
            self.counters["localize_errors"] += 1
            log.warning("gradloc: localization of step %d failed: %s", rec.step, exc, exc_info=True)
            return LocalizeResult(Localization(step=rec.step, method=Method.NONE, status=Status.UNAVAILABLE, probes=0,
                                               global_norm=rec.global_norm,
                                               note=f"localization failed: {type(exc).__name__}: {exc}"))


def heads_of(watched: Sequence[object]) -> dict[int, nn.Module]:
    """Token-layer index -> its module, for the layers that are exactly one module (``TokenHooks.watched``)."""
    by: dict[int, list[nn.Module]] = {}
    for w in watched:
        by.setdefault(w.layer, []).append(w.module)  # type: ignore[attr-defined]
    return {layer: ms[0] for layer, ms in by.items() if len(ms) == 1}


def token_view(scores: StepScores | None, layers: Sequence[str], scale: float,
               unattributed: float, rl: dict[str, torch.Tensor] | None = None) -> TokenView | None:
    """Host copy of a step's per-token scores, unscaled, and of its RL fields (fetched only when a
    spike is localized)."""
    if scores is None:
        return None
    k = 1.0 / scale**2

    def host(t: torch.Tensor | None):
        return None if t is None else t.double().cpu().numpy() * k

    rl_host = None if rl is None else {name: t.cpu().numpy() for name, t in rl.items() if name != "eligible"}
    return TokenView(tuple(layers), scores.metas, scores.offsets, host(scores.totals), host(scores.per_layer),
                     scores.eligible.cpu().numpy(), unattributed, scores.exact_layer, host(scores.exact), rl_host)


def scaler_state(scaler: object, optimizer: object) -> tuple[torch.Tensor | None, bool]:
    """(scale tensor, already unscaled?) of an enabled torch.amp.GradScaler, else (None, False)."""
    if scaler is None or not scaler.is_enabled():  # type: ignore[attr-defined]
        return None, False
    scale = getattr(scaler, "_scale", None)
    if scale is None:
        scale = torch.tensor(float(scaler.get_scale()))  # type: ignore[attr-defined]
    unscaled = False
    if optimizer is not None:
        from torch.amp.grad_scaler import OptState

        state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
        unscaled = state.get("stage") is OptState.UNSCALED
    return scale, unscaled


def outlier_samples(record: StepRecord) -> tuple[tuple[int, int], ...]:
    """(micro-batch, sample) of the step's per-sample surprise outliers (SpikeContext.outliers)."""
    found = record.samples.outliers if record.samples is not None else ()
    return tuple((o.micro_batch, o.sample) for o in found
                 if o.kind == "surprise" and o.micro_batch is not None and o.sample is not None)
