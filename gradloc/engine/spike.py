"""A flagged step → :class:`~gradloc.records.Incident`: localize (probes), then the opt-in remedy.

One path for one process and for a job of W ranks (W = 1 is a job too, of one rank): the one
:class:`~gradloc.localizer.Localizer` with the one scope the job gives (``Job.scope``) — one process: its
own probes against its own gradient (``localizer/scope.SoloScope``); a job: ``parallel/scope.py``, where
every rank enters together (the spike is judged on the job's step) and takes the same path, and rank 0
emits the incident. The on_spike re-run of the step's micro-batches goes through the same scope.

Runs on the training thread inside ``Monitor.end_step``, on spike steps only. Never raises: a failed
localization becomes an ``unavailable`` localization with the error in its note (in a job: a
collective past its deadline, or a probe that raised on some rank, naming it).
"""
from __future__ import annotations

import logging
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import nn

from gradloc.collector.batch import MicroBatchMeta
from gradloc.collector.token_summary import StepScores
from gradloc.detector import LOCALIZE, norm_line
from gradloc.engine import on_spike
from gradloc.localizer import Localizer, ProbeFn, SpikeContext, StoredGradient, TokenView
from gradloc.localizer.classify import classify
from gradloc.localizer.localizer import LocalizeResult
from gradloc.localizer.remedy import apply_remedy
from gradloc.localizer.scope import ProbeFailed, Scope
from gradloc.parallel.comm import CollectiveTimeout
from gradloc.records import Incident, IncidentScope, Localization, Method, SpikeEvent, Status, StepRecord

if TYPE_CHECKING:
    from gradloc.parallel.job import Job

log = logging.getLogger("gradloc")
Rerun = Callable[[Scope, "SpikeInputs"], "SpikeInputs"]  # on_spike: the step's inputs with re-run scores
MAX_INCIDENT_LAYERS = 1024  # layers an incident lists (Incident.top_layers), largest norm first


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
    layer_z: Mapping[str, float] = field(default_factory=dict)  # the detector's per-layer z-scores at the step
    metas: tuple[MicroBatchMeta, ...] = ()  # the step's micro-batches (what its probes and re-runs run)

    @property
    def unattributed_share(self) -> float:
        """The share of ‖∇‖² the scores do not cover (1 without token statistics)."""
        if self.unattributed is not None:
            return self.unattributed
        return self.record.tokens.unattributed_share if self.record.tokens else 1.0


class SpikePath:
    def __init__(self, job: "Job", layer_stats: Any, token_layers: Sequence[str], localizer: Localizer,
                 pause_hooks: Callable[[bool], None], counters: Counter[str],
                 heads: dict[int, nn.Module] | None = None) -> None:
        self.job, self.layer_stats, self.token_layers = job, layer_stats, list(token_layers)
        self.params = list(layer_stats.params)
        self.localizer, self.cfg, self.pause_hooks, self.counters = localizer, job.config, pause_hooks, counters
        self.heads = dict(heads or {})  # token-layer index -> its one module (for the decomposition probe)
        self.alone = job.world is None  # one process, or a rank that left its job after a failed collective
        self.model = job.model  # the watched module: probes save and restore its buffers

    @property
    def scope(self) -> IncidentScope:
        return IncidentScope.RANK if self.alone else IncidentScope.JOB  # the incidents' scope

    def head_for(self, view: TokenView | None) -> nn.Module | None:
        """The module of the view's exact (loss-head) layer, when that layer is one module."""
        return self.heads.get(view.exact_layer) if view is not None and view.exact_layer is not None else None

    def incident(self, x: SpikeInputs, rerun: Rerun | None = None) -> Incident:
        """The step's incident; ``rerun`` (token_stats="on_spike"): re-runs the step's micro-batches through its
        probe scope and returns the inputs with their scores, before the localizer reads them."""
        result = None
        if LOCALIZE.intersection(x.spike.kinds):
            result = self._localize(x, rerun)
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
                                  self.params, grad_scale, x.has_scaler, unnamed=result.unnamed if result else 0)
            self.counters[f"remedy_{'applied' if remedy.applied else 'refused'}"] += 1
        rec = x.record
        top = tuple(replace(s, z=x.layer_z.get(s.layer)) for s in  # every layer, largest norm first
                    sorted(rec.layers, key=lambda s: -s.grad_norm if s.grad_norm == s.grad_norm else 0)[:MAX_INCIDENT_LAYERS])
        incident = Incident(incident_id=uuid.uuid4().hex, job=rec.job, rank=rec.rank, step=rec.step,
                            time_unix=rec.time_unix, spike=x.spike, localization=loc,
                            top_layers=top, remedy=remedy, classification=classification, scope=self.scope)
        return on_spike.with_reruns(incident, len(x.metas)) if rerun is not None and result is not None else incident

    def _localize(self, x: SpikeInputs, rerun: Rerun | None) -> LocalizeResult:
        rec = x.record
        where = "" if self.alone else f" on rank {self.job.config.rank}"
        try:
            stored = StoredGradient([p.grad for p in self.params], 1.0 if x.unscaled else 1.0 / x.scale,
                                    rec.global_norm)
            scope = self.job.scope(self.layer_stats, alone=self.alone, params=self.params, metas=x.metas,
                                   probe=x.probe, pause_hooks=self.pause_hooks, grads=stored.grads,
                                   inv_scale=stored.inv_scale, norm=stored.norm)
            if rerun is not None and scope is not None:
                x = rerun(scope, x)
            view = token_view(x.scores, self.token_layers, x.scale, x.unattributed_share, x.rl)
            s = x.spike
            det = self.cfg.detector.resolved()
            band = s.mean + det.z_threshold * s.std if s.mean is not None and s.std is not None else None
            ctx = SpikeContext(healthy_norm=s.mean, loss=x.job_loss if not self.alone else rec.loss,
                               healthy_loss=s.loss_mean, spike_line=norm_line(s, det), band_line=band,
                               outliers=outlier_samples(rec))
            hazard = self.job.data.probe_hazard
            res = self.localizer.localize(rec.step, view, stored, scope, ctx,
                                          keep_grad=self.cfg.remedy == "drop_culprits", head=self.head_for(view),
                                          has_probe=scope is not None and x.probe is not None and not hazard)
            if hazard and x.probe is not None:
                res = replace(res, localization=replace(res.localization, note=f"{hazard}; {res.localization.note}"))
            return res
        except CollectiveTimeout as exc:
            self.counters["collective_timeouts"] += 1
            note = f"localization failed: {exc}"
        except ProbeFailed as exc:  # every rank got here together: the job's collectives stay in lockstep
            self.counters["probe_errors"] += 1
            note = f"localization failed: {exc}"
        except Exception as exc:  # never raise into the training loop (in a job: the other ranks time out)
            self.counters["localize_errors"] += 1
            log.warning("gradloc: localization of step %d failed%s: %s", rec.step, where, exc, exc_info=True)
            note = f"localization failed{where}: {type(exc).__name__}: {exc}"
        return LocalizeResult(Localization(step=rec.step, method=Method.NONE, status=Status.UNAVAILABLE, probes=0,
                                           global_norm=rec.global_norm, note=note))


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
