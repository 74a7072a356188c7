"""The per-token side of a monitor: its hooks (on during training, or only to re-run a flagged step:
``token_stats="on_spike"``, engine/on_spike.py), a step's scores, and the share of ‖∇‖² they leave
unattributed."""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from typing import Any, Callable

from torch import nn

from gradloc.collector.batch import MicroBatchMeta
from gradloc.collector.layer_stats import LayerStatsCollector
from gradloc.collector.scores_buffer import MicroBatchScores
from gradloc.collector.shards import is_dtensor
from gradloc.collector.token_hooks import TokenHooks
from gradloc.collector.token_summary import StepScores, stack_step
from gradloc.engine import on_spike
from gradloc.errors import BatchMetadataError, ConfigError, UnsupportedModelError
from gradloc.parallel.comm import CollectiveTimeout

log = logging.getLogger("gradloc")


def check_rules(model: nn.Module, hooks: TokenHooks | None, job: Any) -> None:
    """Refuse what per-token statistics cannot do on this model and job; warn of parameters no rule scores."""
    if job.config.token_stats == on_spike.MODE and not job.local_forward:
        raise ConfigError(f"token_stats='on_spike' re-runs a flagged step's micro-batches; under {job.describe()} every "
                          "forward is a collective over several ranks: use token_stats=True there")
    if hooks is not None and not hooks.watched:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no module with a per-token rule (nn.Linear, nn.Embedding, "
            "nn.LayerNorm, nn.RMSNorm, *RMSNorm, HF Conv1D); pass WatchConfig(token_stats=False) for "
            "per-layer statistics only, or register a rule with gradloc.register_rule")
    if hooks is not None and hooks.unruled:
        log.warning("gradloc: no per-token rule for %s (an unknown layout, or a parameter used inside another "
                    "module's computation): their gradient is reported as unattributed_share, never guessed; "
                    "gradloc.register_rule adds one", ", ".join(sorted(hooks.unruled)))


class TokenPath:
    def __init__(self, hooks: TokenHooks | None, mode: bool | str, layer_stats: LayerStatsCollector,
                 params_of: dict[str, list[int]], job: Any, counters: Counter[str]) -> None:
        self.hooks, self.on_spike = hooks, mode == on_spike.MODE
        self.layer_stats, self.params_of, self.job, self.counters = layer_stats, params_of, job, counters
        self.alone = job.world is None  # set when the rank leaves its job: no token-group collective
        self.watched = frozenset(hooks.covered_modules) if hooks else frozenset()

    @property
    def live(self) -> bool:
        """Per-token hooks run during training (not off, not only to re-run a flagged step)."""
        return self.hooks is not None and not self.on_spike

    def stack(self, parts: list[tuple[MicroBatchMeta, MicroBatchScores | None]], rerun: bool = False
              ) -> StepScores | None:
        """The step's scores (None without hooks running, or on an on_spike step that was not re-run)."""
        if not parts or self.hooks is None or (self.on_spike and not rerun):
            return None
        for _, buf in parts:
            if buf is not None:
                self._say_uncompilable(buf)
                buf.fold(self.hooks.watched)  # the compiled taps' scores, now that backward ran
                self._say_errors(buf)
        try:
            if self.hooks.routed is not None and not self.alone:  # expert parallelism: rows' scores home
                self.hooks.routed.settle(parts)
            scores = stack_step(parts, len(self.hooks.layers), self.layer_stats.device, self.watched,
                                heads=self.job.config.samples.enabled,  # the same on every rank of a token group
                                pair_slots=self.hooks.pair_slots, shifts=self.hooks.label_shifts)
            layout = self.job.layout
            if layout is None or layout.token is None or self.alone:
                if scores.pairs is not None:  # Megatron SP alone: its linears' factors have no product here
                    from dataclasses import replace

                    scores = replace(scores, pairs=None, unscored_modules=scores.unscored_modules | scores.pair_names)
                return scores
            return self.job.combine_tokens(scores, len(self.hooks.layers))  # the token group's scores add up
        except CollectiveTimeout:
            raise  # the monitor leaves the job: its ranks are out of lockstep
        except Exception:  # noqa: BLE001 - never raise into the training loop
            self.counters["token_errors"] += 1
            if self.counters["token_errors"] == 1:
                log.warning("gradloc: the step's per-token scores could not be assembled; this step has none",
                            exc_info=True)
            return None

    def checked(self, record: Any, scores: StepScores | None, check: list[float]) -> tuple[Any, StepScores | None]:
        """After the step's host transfer: a token group whose ranks saw different tokens has no token view
        this step (every rank of it drops it, counted and said once); else the exact layer's index."""
        from dataclasses import replace

        from gradloc.parallel.tokens import exact_layer, mismatch

        if mismatch(check):
            self.counters["token_group_mismatch"] += 1
            if self.counters["token_group_mismatch"] == 1:
                log.warning("gradloc: the tensor/pipeline-parallel ranks of a data index were given different token "
                            "ids or loss masks (step %d): their per-token statistics are dropped for such steps; every "
                            "tp/pp rank must see the same micro-batches", record.step)
            return replace(record, tokens=None), None
        return record, (replace(scores, exact_layer=exact_layer(check)) if scores is not None else None)

    def check_wiring(self, buf: MicroBatchScores, setup: bool) -> None:
        """At a micro-batch block's exit: hooks that never ran (a graph compiled before they existed)
        or a (B, T) no watched module saw. ``setup``: the first step of a strict monitor, where a
        wiring mistake raises ``BatchMetadataError``; later it is counted and logged."""
        if self.hooks.silent(buf):  # no hook ran at all: a graph compiled before the hooks existed
            buf.lost_modules.update(self.hooks.covered_modules)  # their gradient: unattributed, never guessed
            self.counters["silent_micro_batches"] += 1
            if self.counters["silent_micro_batches"] == 1:
                log.warning("gradloc: no watched module's forward hook ran in micro-batch %d. A model that torch.compile "
                            "already ran before watch() keeps its graph without gradloc's hooks (pytorch#117758): "
                            "watch it before its first compiled call, or call torch._dynamo.reset() after watch(). "
                            "Per-layer statistics go on; per-token statistics are off (all unattributed).", buf.index)
            return
        if buf.untapped:  # compiled, sinks given, yet no traced hook ran: a graph traced without gradloc's hooks
            self.counters["untapped_micro_batches"] += 1
            if self.counters["untapped_micro_batches"] == 1:
                log.warning("gradloc: micro-batch %d ran a compiled graph without gradloc's taps (one traced for "
                            "another instance of the model's class, or before watch(), and not dropped: "
                            "torch._dynamo.config.skip_nnmodule_hook_guards set back to True?). Per-token "
                            "statistics are off for such micro-batches (all unattributed), counted in "
                            "mon.counters['untapped_micro_batches'] (said once); torch._dynamo.reset() retraces.",
                            buf.index)
            return
        if buf.dropped_calls == 0 or buf.matched_calls > 0:
            return
        msg = (f"token_ids describe a ({buf.batch}, {buf.seq}) micro-batch, but no watched module saw "
               "activations of that shape: pass the ids of the batch this block runs")
        if setup:
            raise BatchMetadataError(msg)  # first step = setup: fail loudly
        self.counters["dropped_micro_batches"] += 1
        log.warning("gradloc: %s (micro-batch dropped from per-token stats)", msg)

    def _say_errors(self, buf: MicroBatchScores) -> None:
        """Hook errors: counted (``hook_errors``), the first said at warning level; the modules they hit count as
        unscored, so their gradient is reported unattributed — never as if it had been scored."""
        if not buf.hook_errors:
            return
        first = self.counters["hook_errors"] == 0
        self.counters["hook_errors"] += buf.hook_errors
        if first:
            log.warning("gradloc: a per-token hook failed (%s); the module's gradient is reported as unattributed "
                        "for such calls; counted in mon.counters['hook_errors'] (said once)", buf.first_error)

    def _say_uncompilable(self, buf: MicroBatchScores) -> None:
        """Once: watched modules whose rule cannot run inside a compiled graph (MoE experts: data-dependent
        recomputation; a tensor-parallel module: DTensor shards, placed by the eager hooks only) went unscored."""
        if buf.sinks is None or self.counters["uncompilable_said"]:
            return
        sharded = lambda m: any(is_dtensor(p) for p in m.parameters(recurse=False))  # noqa: E731
        names = [w.name for w, sink in zip(self.hooks.watched, buf.sinks)
                 if sink.grad is None and w.name not in buf.scored_modules  # (an eager module's hooks scored it)
                 and (not getattr(w.rule, "compilable", True) or sharded(w.module))]
        if names:
            self.counters["uncompilable_said"] += 1
            log.warning("gradloc: %d watched module(s) ran inside a torch.compile graph where their per-token rule "
                        "cannot (%s%s: data-dependent recomputation, or tensor-parallel shards); their gradient is "
                        "reported as unattributed_share. Compile per block around them, or use "
                        "token_stats='on_spike'", len(names), ", ".join(names[:3]), ", ..." if len(names) > 3 else "")

    def rerun(self, scope: Any, x: Any, *, breakdown: bool, labels: Callable[[MicroBatchMeta], Any]) -> Any:
        """token_stats='on_spike': the flagged step's inputs (``engine/spike.SpikeInputs``) with the scores of its
        micro-batches re-run through the step's probe scope, and the share of ‖∇‖² they leave unattributed."""
        parts = on_spike.rerun(self.hooks, scope, list(x.metas), breakdown, labels)
        if parts is None:
            self.counters["on_spike_rerun_failed"] += 1
            return replace(x, scores=None, unattributed=None)
        scores = self.stack(parts, rerun=True)
        return replace(x, scores=scores, unattributed=self.unattributed(scores) if scores is not None else None)

    def unattributed(self, scores: StepScores) -> float:
        """Share of ‖∇‖² no per-token score covers (no rule, or its module unscored): one host read."""
        unscored = [i for m in sorted(scores.unscored_modules) for i in self.params_of.get(m, ())]
        pack = self.layer_stats.grad_pack(1.0, unscored)  # [grad_sq(L) | ... | uncovered_sq]
        total = float(pack[: self.layer_stats.n_layers].sum())
        return float(pack[-1]) / total if total > 0 else 0.0


__all__ = ["TokenPath"]
