"""The engine: :class:`Monitor` runs gradloc's stages for one watched model, per micro-batch and per
optimizer step (``gradloc.watch`` in adapters/pytorch.py builds it). Its paths live beside it:
blocks.py (the step's micro-batches in flight), token_path.py (per-token scores), spike.py (localize → remedy),
samples.py (bad samples that never spike), update_hooks.py (update ratios), fanout.py (records out, held a step
for their update ratios), on_spike.py (hooks only on a flagged step), lifecycle.py (attach, detach, close).

Usage per optimizer step::

    for i, mb in enumerate(micro_batches):
        with mon.micro_batch(mb.labels, loss_mask=mb.mask, sample_ids=mb.uids):
            loss_fn(model, mb).backward()
    report = mon.end_step(loss, probe=lambda i, mask: loss_fn(model, micro_batches[i], mask))
    clip_grad_norm_(model.parameters(), 1.0)  # after end_step: gradloc reports the pre-clip norm
    optimizer.step(); optimizer.zero_grad()
"""
from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from gradloc.collector import groups, rl_fields
from gradloc.collector.batch import MicroBatchMeta, make_meta
from gradloc.collector.job import as_judged
from gradloc.collector.layer_stats import module_layer_map
from gradloc.collector.overhead import OverheadMeter
from gradloc.collector.precursors.hooks import make_precursors
from gradloc.collector.precursors.job import job_slots
from gradloc.collector.precursors.stats import precursor_stats
from gradloc.collector.scores_buffer import MicroBatchScores
from gradloc.collector.step import StepInputs, assemble
from gradloc.collector.token_hooks import TokenHooks
from gradloc.collector.update_ratio import UpdateRatioTracker, window_bytes
from gradloc.config import WatchConfig
from gradloc.detector import SpikeDetector, opens_incident
from gradloc.engine.blocks import StepBlocks
from gradloc.engine.fanout import Fanout
from gradloc.engine.lifecycle import Lifecycle
from gradloc.engine.drift import DriftWatch, JobShare
from gradloc.engine.samples import SampleWatch
from gradloc.engine.spike import SpikeInputs, SpikePath, heads_of, scaler_state
from gradloc.engine.token_path import TokenPath, check_rules
from gradloc.engine.update_hooks import UpdateHooks
from gradloc.errors import AttachError, ConfigError
from gradloc.localizer import Localizer, ProbeFn
from gradloc.parallel.comm import CollectiveTimeout
from gradloc.parallel.job import check_model, resolve
from gradloc.records import Incident, SampleInfo, SpikeEvent, StepRecord
from gradloc.sinks import Sink, default_sinks

log = logging.getLogger("gradloc")


@dataclass(frozen=True)
class StepReport:
    record: StepRecord  # update ratios arrive with the next step (see Monitor.history)
    spike: SpikeEvent
    incident: Incident | None


class Monitor(Lifecycle):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 config: WatchConfig | None = None, decode: Callable[[list[int]], str] | Any = None,
                 sinks: Sequence[Sink] = ()) -> None:
        given, model = model, check_model(model)  # a torch.compile wrapper: its module
        self.model, self.optimizer = model, optimizer
        self.job = job = resolve(model, config or WatchConfig())
        self.config = cfg = job.config
        self.comm = job.world  # a job: one gather per step, spikes together
        if job.data.probe_hazard and job.world is not None:
            log.warning("gradloc: %s", job.data.probe_hazard)
        watched = job.model  # DDP, DeepSpeed, a pipeline stage: the inner module (the same parameters)
        self.layer_stats = job.layer_stats()
        if not job.data.measures_updates:
            self.optimizer = None  # update ratios: not measured (DeepSpeed: docs/deepspeed.md)
        self.hooks = TokenHooks(watched, module_layer_map(watched, cfg.layer_grouping)) if cfg.token_stats else None
        if self.hooks is not None and cfg.samples.enabled:
            self.hooks.label_shifts = cfg.samples.label_shifts  # the head's neighbour reads (collector/head_read.py)
        check_rules(model, self.hooks, job)
        try:  # every rank together: layout, the job's layers, replica weights (one gather)
            job.attach_collectors(self.layer_stats, self.hooks)
        except CollectiveTimeout as exc:
            raise AttachError(f"gradloc: the ranks did not all attach within {cfg.collective_timeout_s:g} s "
                              f"(call gradloc.watch on every rank): {exc}") from exc
        covered = self.hooks.covered_modules if self.hooks else set()
        owners = [n.rsplit(".", 1)[0] if "." in n else "" for n in self.layer_stats.names]
        self.layer_stats.set_uncovered([o not in covered for o in owners])
        self._params_of: dict[str, list[int]] = {}  # module name -> indices of its direct parameters
        for i, o in enumerate(owners):
            self._params_of.setdefault(o, []).append(i)
        self.meter = OverheadMeter(cfg.max_overhead, cuda=self.layer_stats.device.type == "cuda")
        self.update_ratios = UpdateRatioTracker(self.layer_stats.params, self.layer_stats.group_of,
                                                self.layer_stats.n_layers, window_bytes(self.config, self.layer_stats),
                                                self.layer_stats.device, self.job.weights,
                                                self.layer_stats.numel if self.job.weights is not None else None)
        self.counters: Counter[str] = Counter()
        self.precursors = make_precursors(watched, cfg.precursors, self.counters, job.holds_head,
                                          compiled=type(given).__name__ == "OptimizedModule",
                                          on_spike=cfg.token_stats == "on_spike",
                                          tp=(job.layout.coord.get("tp", 0), job.layout.size("tp"))
                                          if job.layout is not None else (0, 1))
        self.tokens = TokenPath(self.hooks, cfg.token_stats, self.layer_stats, self._params_of, job,
                                self.counters)
        self._updates = UpdateHooks(self.update_ratios, self.meter, self.counters,
                                    lambda: self._fanout.held_step)
        self.detector = SpikeDetector(cfg.detector, self.layer_stats.layers)
        if self.comm is not None:
            self.detector.agree = self._any_rank
        self.spikes = SpikePath(job, self.layer_stats, self.hooks.layers if self.hooks else [],
                                Localizer(cfg.localizer, getattr(decode, "decode", decode)), self.pause_token_hooks,
                                self.counters, heads=heads_of(self.hooks.watched) if self.hooks else {})
        self._fanout = Fanout([*sinks, *default_sinks(cfg, embedded_store=self.comm is None or cfg.rank == 0)],
                              self.counters, cfg.history)
        self.history = self._fanout.history  # the last ``config.history`` step records sent
        self.samples = SampleWatch(cfg.samples, getattr(decode, "decode", decode), self.counters,
                                   holds_head=job.holds_head, judges=job.judges_samples)  # outlier findings
        self.drift = DriftWatch(cfg.precursors.drift, self.counters)  # precursor findings (detector/drift.py)
        self.job_slots = job_slots(self.comm, job.layout, self.counters)  # the job's precursor values
        self._replicas = job.layout is None or set(job.layout.sizes) == {"dp"}  # every rank the whole model
        self.incidents: list[Incident] = []
        self.step = 0  # the next step's number
        self._ended = 0  # end_step calls so far
        self._blocks = StepBlocks(self.tokens, self.hooks, self.meter, cfg, self.samples, self.counters,
                                  self.precursors)
        self._lifecycle_init()

    # -- per micro-batch ------------------------------------------------------------------------
    @contextmanager
    def micro_batch(self, token_ids: torch.Tensor | None = None, *, loss_mask: torch.Tensor | None = None,
                    sample_ids: Sequence[object] | None = None, shape: tuple[int, int] | None = None,
                    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None,
                    sample_infos: Sequence[SampleInfo] | None = None) -> Iterator[MicroBatchMeta]:
        """Forward and backward of one micro-batch. ``token_ids`` (B, T) are the ids each loss
        position scores (for a causal LM: the shifted labels); masks/ids are validated here.

        A packed micro-batch is one row (1, N) of sequences back to back: give their boundaries as
        ``cu_seqlens`` (S + 1 offsets from 0 to N) or as ``position_ids`` that restart at 0, and one
        sample id per sequence. Culprits are then reported per sequence. ``sample_infos`` (one
        ``gradloc.SampleInfo`` per sample: request, completion, prompt and response spans) ride
        along into incidents; ``gradloc.adapters.rl`` builds them from rollouts.
        """
        meta = make_meta(len(self._blocks.parts), token_ids, loss_mask, sample_ids, shape, cu_seqlens, position_ids,
                         sample_infos)
        self.open_block(meta)
        try:
            yield meta
        except BaseException:
            self.close_block(failed=True)
            raise
        self.close_block()

    def open_block(self, meta: MicroBatchMeta) -> None:
        """Start capturing micro-batch ``meta`` (``micro_batch`` does it; a pipeline step per chunk)."""
        self._blocks.begin(meta)

    @property
    def block_open(self) -> bool:
        return self._blocks.open is not None

    def close_block(self, failed: bool = False) -> None:
        self._blocks.end(failed, setup=self.config.strict and not self.history and self._fanout.held is None)

    @property
    def _parts(self) -> list[tuple[MicroBatchMeta, MicroBatchScores | None]]:
        """The step's micro-batches so far: (meta, its per-token scores or None)."""
        return self._blocks.parts

    def pipeline_step(self, schedule: Any, *, inputs: Any = None, target: Any = None, token_ids: Any = None,
                      loss_mask: Any = None, sample_ids: Sequence[object] | None = None, token_loss: Any = None,
                      sample_infos: Sequence[SampleInfo] | None = None, **step_kwargs: Any) -> list:
        """One step of a pipeline-parallel job (``watch(stage)``), in place of ``schedule.step`` on every stage:
        ``inputs`` (the first stage's batch), ``target`` (the last stage's), ``token_ids`` (the ids each loss
        position scores; default ``target``; give them on every stage), ``token_loss(output, target)``: the
        per-token loss terms (B, T) whose sum is the schedule's ``loss_fn`` (for probes); ``sample_ids`` and
        ``sample_infos``: one per row of the whole batch, split as the schedule splits it. Returns the last
        stage's per-micro-batch losses ([] elsewhere). See gradloc/parallel/pp.py."""
        return self.job.run_step(self, schedule, inputs=inputs, target=target, token_ids=token_ids,
                                 loss_mask=loss_mask, sample_ids=sample_ids, token_loss=token_loss,
                                 step_kwargs=step_kwargs, sample_infos=sample_infos)

    def note_event(self, name: str, n: int = 1) -> None:
        """Count a monitor event (something dropped or degraded without raising into training): the one way an
        integration adds to ``counters``, whose names gradloc/records/events.py declares (a closed label set)."""
        self.counters[name] += n

    def rl_fields(self, **fields: torch.Tensor | None) -> None:
        """Per-token RL fields of the current micro-batch, from tensors the loss already has; call
        inside its ``micro_batch`` block. Each is (B, T) like the block's token ids: ``logp``
        (log π_train of the sampled tokens), ``rollout_logp`` (the inference engine's), ``old_logp``,
        ``advantages`` (also (B,) or, packed, one per sequence), ``ratio``, ``clipped`` (bool),
        ``entropy``. They stay on the device; the step exports their distributions and every
        culprit carries its own values. A wrong field raises ``BatchMetadataError`` on the first
        step (setup) and is counted and dropped after that."""
        self._blocks.rl_fields(fields, setup=self._ended == 0)

    # -- per optimizer step ---------------------------------------------------------------------
    def end_step(self, loss: float | torch.Tensor | None = None, *, probe: ProbeFn | None = None,
                 scaler: Any = None, step: int | None = None) -> StepReport:
        """Call after the last backward of the step and before clipping / optimizer.step().

        ``step``: the step number to record (a trainer's own counter, e.g. after a resume); by
        default the monitor counts its ``end_step`` calls.
        """
        if step is not None:
            self.step = int(step)
        if self.comm is not None and self.comm.broken:
            self._leave_job()
        probe = self._step_checks(probe)
        driven = self.job.take_probe()  # the probe of a step the job drove (a pipeline step: parallel/pp.py)
        probe = probe if probe is not None else driven
        if self._ended == 0 and self.config.remedy == "drop_culprits" and probe is None:
            raise ConfigError("remedy='drop_culprits' needs the probe closure (end_step(loss, probe=...)): "
                              "without probes no culprit set is verified and ∇_C is unknown")
        t0 = self.meter.begin()
        parts, given_rl = self._blocks.take()
        try:
            scores = self.tokens.stack(parts)
        except CollectiveTimeout:  # the token group's or the expert group's exchange failed: this rank goes on alone
            self._leave_job()
            scores = None
        scale, unscaled = scaler_state(scaler, self.optimizer)
        upd = self._updates.take(self._fanout.held_step)
        unscored = tuple(i for m in sorted(scores.unscored_modules) for i in self._params_of.get(m, ())) if scores else ()
        metas = tuple(m for m, _ in parts)
        rl, rl_pack = rl_fields.step_fields(list(metas), given_rl, scores, self.layer_stats.device)
        x = StepInputs(self.step, self.config.job, self.config.rank, len(parts), loss, scale, unscaled,
                       scores, tuple(self.hooks.layers) if self.hooks else (), self.config.top_k,
                       upd[1] if upd else None, unscored, rl_pack, self.comm,
                       self.samples.pack(scores, set(given_rl)),
                       group_tokens=groups.step_tokens(metas, self.layer_stats.device, self.counters)
                       if self.job.judges_samples else None,  # once per data index (tp, pp: one rank counts)
                       precursors=self.precursors.take() if self.precursors is not None else None)
        if self.job_slots is not None:  # this rank's precursor slots in the job's layout, in the step gather
            x = replace(x, precursor_row=self.job_slots.row(*(x.precursors or ((), None)), self.layer_stats.device))
        try:
            assembled = assemble(self.layer_stats, x)
        except CollectiveTimeout:  # the step gather failed: this rank goes on alone, training never waits
            self._leave_job()
            assembled = assemble(self.layer_stats, replace(x, comm=None))
        self.meter.end(t0)
        own, step_s, ratio = self.meter.finish_step()
        t1 = self.meter.begin()
        ratios = self.update_ratios.ratios(assembled.previous_update) if assembled.previous_update is not None else None
        precursors, job_wide = precursor_stats(x.precursors, assembled.precursors, self.config.precursors,
                                               self.counters, self.job_slots, assembled.precursor_rows)
        self._fanout.release(ratios, self.layer_stats.layers)
        record = replace(assembled.record, overhead_s=own, step_s=step_s, overhead=ratio, shed=self.meter.shed,
                         layers_global=self.comm is not None,
                         groups=groups.step_groups(metas, assembled.group_tokens, self.counters),
                         precursors=precursors)
        if assembled.check is not None:  # a token group's scores (parallel/tokens.py)
            record, scores = self.tokens.checked(record, scores, assembled.check)
        record = self.samples.judge_step(record, assembled.samples, list(metas))
        record = self.drift.watch_step(record, metas, JobShare(
            rank=self.comm.rank, precursors=job_wide, rl=assembled.rl_job,
            ratios=record.layers_global and self._replicas) if self.comm is not None else None)
        spike = self.detector.observe(as_judged(record, assembled.job))
        self._fanout.hold(replace(assembled, record=replace(record, **self.detector.band(spike))))
        self.meter.end(t1)
        incident = None
        if opens_incident(spike):  # not when the step is the run reacting to an earlier incident
            t2 = time.perf_counter()
            rerun = None
            if self.tokens.on_spike and probe is not None:
                breakdown = self.config.layer_breakdown and not self.meter.is_shed("layer_breakdown")
                rerun = functools.partial(self.tokens.rerun, breakdown=breakdown, labels=self.samples.labels)
            incident = self.spikes.incident(
                SpikeInputs(record=record, spike=spike, scores=scores, probe=probe, scale=assembled.scale,
                            unscaled=unscaled, has_scaler=scale is not None, rl=rl,
                            job_loss=assembled.job.loss if assembled.job else record.loss,
                            layer_z=self.detector.layer_z, metas=metas), rerun)
            self.meter.exclude(time.perf_counter() - t2)
            self.incidents.append(incident)
            if self.comm is None or self.config.rank == 0:  # a job's incident is emitted once, by rank 0
                self._fanout.on_incident(incident)
        self.step += 1
        self._ended += 1
        return StepReport(record, spike, incident)

    def _step_checks(self, probe: ProbeFn | None) -> ProbeFn | None:
        """The job's checks of where ``end_step`` was called (DeepSpeed: at the accumulation boundary), and the
        probe the step may run."""
        problem = self.job.step_problem(self.layer_stats)
        if problem:
            if self._ended == 0:
                raise ConfigError(problem)
            self.counters["off_boundary_steps"] += 1
            log.warning("gradloc: %s (step %d has no gradient statistics)", problem, self.step)
        return probe if self.comm is not None or self.job.data.probes_alone else None

    def _leave_job(self) -> None:
        """After a gradloc collective failed, the ranks are out of lockstep: watch this rank alone."""
        log.error("gradloc: collectives are off for the rest of the run, each rank is watched on its own: %s",
                  self.comm.broken if self.comm else "")
        self.counters["left_job"] += 1
        self.comm = self.job_slots = None
        self.detector.agree = None
        self.spikes.alone = True
        self.tokens.alone = True
        self.layer_stats.alone()

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the job: one all-reduce, on a step above the detector's
        sample band only (alone after a failed collective)."""
        try:
            return bool(self.comm.all_reduce(torch.tensor([float(flag)], dtype=torch.float64), op="max",
                                             what="gradloc sample flag")[0] > 0)
        except CollectiveTimeout:
            self._leave_job()
            return flag

    def pause_token_hooks(self, on: bool) -> None:
        """Pause (True) or resume (False) per-token capture, e.g. around extra forward/backward
        passes inside a micro-batch block that are not part of training (probes do this)."""
        if self.hooks:
            self.hooks.suspended = on
