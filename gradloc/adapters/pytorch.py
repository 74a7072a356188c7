"""PyTorch adapter: ``gradloc.watch(model, ...)`` -> :class:`Monitor`.

Usage per optimizer step::

    for i, mb in enumerate(micro_batches):
        with mon.micro_batch(mb.labels, loss_mask=mb.mask, sample_ids=mb.uids):
            loss_fn(model, mb).backward()
    report = mon.end_step(loss, probe=lambda i, mask: loss_fn(model, micro_batches[i], mask))
    clip_grad_norm_(model.parameters(), 1.0)  # after end_step: gradloc reports the pre-clip norm
    optimizer.step(); optimizer.zero_grad()
"""
from __future__ import annotations

import logging
import uuid
import weakref
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from gradloc.agent.embedded import default_sinks
from gradloc.collector.batch import MicroBatchMeta, make_meta
from gradloc.collector.layer_stats import LayerStatsCollector, module_layer_map
from gradloc.collector.step import Assembled, StepInputs, assemble, with_update_ratios
from gradloc.collector.token_hooks import MicroBatchScores, TokenHooks
from gradloc.collector.token_summary import StepScores, stack_step
from gradloc.config import WatchConfig
from gradloc.detector import INCIDENT, LOCALIZE, SpikeDetector
from gradloc.errors import AttachError, BatchMetadataError, UnsupportedModelError
from gradloc.exporters.jsonl import Sink
from gradloc.localizer import Localizer, ProbeFn, ProbeSession, SpikeContext, StoredGradient, TokenView
from gradloc.records import Incident, Localization, SpikeEvent, StepRecord

log = logging.getLogger("gradloc")
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, Monitor]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class StepReport:
    record: StepRecord  # update ratios arrive with the next step (see Monitor.history)
    spike: SpikeEvent
    incident: Incident | None


class Monitor:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 config: WatchConfig | None = None, decode: Callable[[list[int]], str] | Any = None,
                 sinks: Sequence[Sink] = ()) -> None:
        self.model, self.optimizer = _check_model(model, config or WatchConfig()), optimizer
        self.config = cfg = config or WatchConfig()
        self.layer_stats = LayerStatsCollector(model, cfg.layer_grouping)
        self.hooks = TokenHooks(model, module_layer_map(model, cfg.layer_grouping)) if cfg.token_stats else None
        if self.hooks is not None and not self.hooks.watched:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no module with a per-token rule (nn.Linear, nn.Embedding, "
                "nn.LayerNorm, nn.RMSNorm, *RMSNorm, HF Conv1D); pass WatchConfig(token_stats=False) for per-layer "
                "statistics only, or register a rule with gradloc.register_rule")
        covered = self.hooks.covered_modules if self.hooks else set()
        owner = [n.rsplit(".", 1)[0] if "." in n else "" for n in self.layer_stats.names]
        self._uncovered = torch.tensor([0.0 if o in covered else 1.0 for o in owner],
                                       device=self.layer_stats._device)
        self.detector = SpikeDetector(cfg.detector, self.layer_stats.layers)
        decode_fn = getattr(decode, "decode", decode)
        self.localizer = Localizer(cfg.localizer, decode_fn)
        self.sinks: list[Sink] = list(sinks) + default_sinks(cfg)
        self.history: deque[StepRecord] = deque(maxlen=1024)
        self.incidents: list[Incident] = []
        self.counters: Counter[str] = Counter()
        self.step = 0
        self._parts: list[tuple[MicroBatchMeta, MicroBatchScores | None]] = []
        self._pending: Assembled | None = None
        self._update: tuple[int, torch.Tensor] | None = None
        self._opt_handles: list[Any] = []
        self.attached = False

    # -- lifecycle ------------------------------------------------------------------------------
    def attach(self) -> "Monitor":
        if self.attached or self.model in _ATTACHED:
            raise AttachError("this model already has a gradloc monitor attached; detach() it first")
        if self.hooks:
            self.hooks.attach()
        if self.optimizer is not None and self.config.update_ratio:
            self._opt_handles = [self.optimizer.register_step_pre_hook(self._before_opt_step),
                                 self.optimizer.register_step_post_hook(self._after_opt_step)]
        _ATTACHED[self.model] = self
        self.attached = True
        return self

    def detach(self) -> None:
        """Remove every hook; the model and optimizer are left exactly as before ``attach``."""
        if not self.attached:
            raise AttachError("this monitor is not attached")
        if self.hooks:
            self.hooks.detach()
        for h in self._opt_handles:
            h.remove()
        self._opt_handles.clear()
        self.layer_stats.release_snapshot()
        _ATTACHED.pop(self.model, None)
        self.attached = False

    def close(self) -> None:
        """Emit the last record, flush and shut down sinks, detach. Safe to call twice."""
        self._emit_pending(self._take_update_host())
        for sink in self.sinks:
            self._safe(sink.force_flush)
            self._safe(sink.shutdown)
        if self.attached:
            self.detach()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- per micro-batch ------------------------------------------------------------------------
    @contextmanager
    def micro_batch(self, token_ids: torch.Tensor | None = None, *, loss_mask: torch.Tensor | None = None,
                    sample_ids: Sequence[object] | None = None,
                    shape: tuple[int, int] | None = None) -> Iterator[MicroBatchMeta]:
        """Forward and backward of one micro-batch. ``token_ids`` (B, T) are the ids each loss
        position scores (for a causal LM: the shifted labels); masks/ids are validated here."""
        meta = make_meta(len(self._parts), token_ids, loss_mask, sample_ids, shape)
        if self.hooks:
            self.hooks.begin(meta.index, meta.batch, meta.seq)
        try:
            yield meta
        except BaseException:
            if self.hooks:
                self.hooks.end()
            self.counters["failed_micro_batches"] += 1  # e.g. an OOM the user retries: not part of the step
            raise
        buf = self.hooks.end() if self.hooks else None
        self._parts.append((meta, buf))
        if buf is not None:
            self._check_wiring(buf)

    def _check_wiring(self, buf: MicroBatchScores) -> None:
        if buf.dropped_calls == 0 or buf.matched_calls > 0:
            return
        msg = (f"token_ids describe a ({buf.batch}, {buf.seq}) micro-batch, but no watched module saw "
               "activations of that shape: pass the ids of the batch this block runs")
        if self.config.strict and not self.history and self._pending is None:
            raise BatchMetadataError(msg)  # first step = setup: fail loudly
        self.counters["dropped_micro_batches"] += 1
        log.warning("gradloc: %s (micro-batch dropped from per-token stats)", msg)

    # -- per optimizer step ---------------------------------------------------------------------
    def end_step(self, loss: float | torch.Tensor | None = None, *, probe: ProbeFn | None = None,
                 scaler: Any = None) -> StepReport:
        """Call after the last backward of the step and before clipping / optimizer.step()."""
        parts, self._parts = self._parts, []
        scores = self._stack(parts)
        scale, unscaled = _scaler_state(scaler, self.optimizer)
        update = self._update[1] if self._update and self._pending and self._update[0] == self._pending.record.step else None
        self._update = None
        x = StepInputs(self.step, self.config.job, self.config.rank, len(parts), loss, scale, unscaled,
                       scores, tuple(self.hooks.layers) if self.hooks else (), self.config.top_k, update)
        assembled = assemble(self.layer_stats, self._uncovered, x)
        self._emit_pending(assembled.previous_update_sq)
        self._pending = assembled
        record = assembled.record
        spike = self.detector.observe(record)
        incident = None
        if INCIDENT.intersection(spike.kinds):
            incident = self._incident(record, spike, scores, probe, assembled.scale, unscaled)
        self.step += 1
        return StepReport(record, spike, incident)

    def _stack(self, parts: list[tuple[MicroBatchMeta, MicroBatchScores | None]]) -> StepScores | None:
        if not parts or self.hooks is None:
            return None
        return stack_step(parts, len(self.hooks.layers), self.layer_stats._device)

    def _incident(self, record: StepRecord, spike: SpikeEvent, scores: StepScores | None,
                  probe: ProbeFn | None, scale: float, unscaled: bool) -> Incident:
        loc = None
        if LOCALIZE.intersection(spike.kinds):
            try:
                loc = self._localize(record, spike, scores, probe, scale, unscaled)
            except Exception as exc:  # never raise into the training loop
                self.counters["localize_errors"] += 1
                log.warning("gradloc: localization of step %d failed: %s", record.step, exc, exc_info=True)
                loc = Localization(record.step, "none", "unavailable", 0, None, record.global_norm, None,
                                   None, (), (), note=f"localization failed: {type(exc).__name__}: {exc}")
        top = tuple(sorted(record.layers, key=lambda s: -s.grad_norm if s.grad_norm == s.grad_norm else 0)[:5])
        incident = Incident(uuid.uuid4().hex, record.job, record.rank, record.step, record.time_unix,
                            spike, loc, top_layers=top)
        self.incidents.append(incident)
        for sink in self.sinks:
            self._safe(sink.on_incident, incident)
        return incident

    def _localize(self, record: StepRecord, spike: SpikeEvent, scores: StepScores | None,
                  probe: ProbeFn | None, scale: float, unscaled: bool) -> Localization:
        view = _token_view(scores, self.hooks.layers if self.hooks else [], scale,
                           record.tokens.unattributed_share if record.tokens else 1.0)
        stored = StoredGradient(self.layer_stats.grads(), 1.0 if unscaled else 1.0 / scale, record.global_norm)
        opener = None
        if probe is not None and scores is not None:
            def opener() -> ProbeSession:
                return ProbeSession(self.model, self.layer_stats.params, scores.metas, probe, self.pause_token_hooks)
        ctx = SpikeContext(spike.mean, record.loss, spike.loss_mean, spike.std, self.config.detector.z_threshold)
        return self.localizer.localize(record.step, view, stored, opener, ctx)

    def pause_token_hooks(self, on: bool) -> None:
        """Pause (True) or resume (False) per-token capture, e.g. around extra forward/backward
        passes inside a micro-batch block that are not part of training (probes do this)."""
        if self.hooks:
            self.hooks.suspended = on

    # -- update-to-weight ratio (optimizer hooks) -------------------------------------------------
    def _before_opt_step(self, *_: Any) -> None:
        self._safe(self.layer_stats.take_snapshot)

    def _after_opt_step(self, *_: Any) -> None:
        try:
            upd = self.layer_stats.update_sq()
            if upd is not None and self._pending is not None:
                self._update = (self._pending.record.step, upd)
        except Exception:
            self.counters["update_ratio_errors"] += 1

    def _take_update_host(self) -> np.ndarray | None:
        if self._update is None or self._pending is None or self._update[0] != self._pending.record.step:
            return None
        host = self._update[1].double().cpu().numpy()
        self._update = None
        return host

    def _emit_pending(self, update_sq: np.ndarray | None) -> None:
        if self._pending is None:
            return
        rec = self._pending.record
        if update_sq is not None:
            rec = with_update_ratios(rec, self.layer_stats.layers, self._pending.param_sq, update_sq)
        self._pending = None
        self.history.append(rec)
        for sink in self.sinks:
            self._safe(sink.on_step, rec)

    def _safe(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            self.counters["sink_errors"] += 1
            log.warning("gradloc: %s failed", getattr(fn, "__qualname__", fn), exc_info=True)


def _check_model(model: nn.Module, cfg: WatchConfig) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"gradloc.watch expects a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModelError("the model has no trainable parameters")
    if cfg.token_stats and isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise UnsupportedModelError(
            "per-token hooks do not run inside a torch.compile graph: watch the model before compiling "
            "with WatchConfig(token_stats=False) for per-layer statistics, or watch model._orig_mod "
            "and run it uncompiled")
    return model


def _scaler_state(scaler: Any, optimizer: Any) -> tuple[torch.Tensor | None, bool]:
    """(scale tensor, already unscaled?) of an enabled torch.amp.GradScaler, else (None, False)."""
    if scaler is None or not scaler.is_enabled():
        return None, False
    scale = getattr(scaler, "_scale", None)
    if scale is None:
        scale = torch.tensor(float(scaler.get_scale()))
    unscaled = False
    if optimizer is not None:
        from torch.amp.grad_scaler import OptState

        state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
        unscaled = state.get("stage") is OptState.UNSCALED
    return scale, unscaled


def _token_view(scores: StepScores | None, layers: Sequence[str], scale: float,
                unattributed: float) -> TokenView | None:
    if scores is None:
        return None
    k = 1.0 / scale**2
    return TokenView(tuple(layers), scores.metas, scores.offsets,
                     scores.totals.double().cpu().numpy() * k, scores.per_layer.double().cpu().numpy() * k,
                     scores.eligible.cpu().numpy(), unattributed, scores.exact_layer)


def watch(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
          config: WatchConfig | None = None, decode: Any = None, sinks: Sequence[Sink] = (),
          **overrides: Any) -> Monitor:
    """Attach a monitor. ``overrides`` are WatchConfig fields (``job=``, ``incident_path=`` …)."""
    if overrides:
        from dataclasses import replace

        config = replace(config or WatchConfig(), **overrides)
    if model in _ATTACHED:
        raise AttachError("this model already has a gradloc monitor attached; detach() it first")
    mon = Monitor(model, optimizer, config, decode, sinks)
    try:
        return mon.attach()
    except BaseException:
        mon.close()
        raise
