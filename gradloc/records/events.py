"""The monitor's events: what gradloc dropped or degraded on the training side without raising into training.

``Monitor.counters`` (a ``collections.Counter``) counts them; every step record carries the non-zero
cumulative counts (``StepRecord.events``) to the agent, which exports them as
``gradloc_monitor_events_total{job, rank, event}``. ``event`` is a metric label, so its values are a
closed set: :data:`MONITOR_EVENTS` declares every name the monitor and its integrations count, with
its meaning (docs/metrics.md shows this table). A name not declared here is exported as
:data:`OTHER` (and counted there), never as a label of its own.

Names built at run time are declared by their expansions: ``remedy_applied`` / ``remedy_refused``
(gradloc/engine/spike.py) and ``integration_{counter}`` of the integrations' micro-batch/step driver
(:data:`INTEGRATION_COUNTERS`). The base layer names no integration: a job runs one, which its logs and its
``job`` label say; the events are what went wrong, whichever integration drove the loop.
``tests/records/test_event_table.py`` checks that every counter the source bumps is declared.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

OTHER = "other"  # the label of every name not declared below

# what the integrations' micro-batch/step driver counts (gradloc/integrations/held.py), as integration_<counter>
INTEGRATION = "integration"
INTEGRATION_COUNTERS: dict[str, str] = {
    "skipped_micro_batches": "micro-batches whose metadata could not be mapped after setup (trained, left out of "
                             "per-token statistics)",
    "block_errors": "micro-batch blocks whose closing failed",
    "end_step_errors": "end_step calls that failed after setup (the step has no record)",
    "rl_fields_errors": "micro-batches whose RL fields could not be built (left out)",
    "loss_errors": "micro-batch losses that could not be added to the step's loss",
    "on_report_errors": "on_report callbacks that raised",
    "layout_errors": "micro-batches whose layout could not be read after setup (trained unwatched)",
    "close_errors": "monitor closes that raised (at the end of a fit or loop)",
    "provenance_dropped": "rows whose provenance in the batch was invalid (trained, keeping no provenance)",
    "provenance_errors": "micro-batches whose provenance look-up raised after setup (trained, keeping none)",
}

MONITOR_EVENTS: dict[str, str] = {
    # per-token path (gradloc/engine/token_path.py)
    "hook_errors": "per-token hook calls that failed; their modules' gradient is reported unattributed",
    "token_errors": "steps whose per-token scores could not be assembled (no token statistics that step)",
    "token_group_mismatch": "steps whose tensor/pipeline-parallel ranks saw different token ids: token statistics dropped",
    "silent_micro_batches": "micro-batches in which no watched module's hook ran (a graph compiled before watch())",
    "untapped_micro_batches": "compiled micro-batches whose graph ran without gradloc's taps (traced without its hooks)",
    "dropped_micro_batches": "micro-batches whose token ids matched no watched module's activations (left out of token statistics)",
    "uncompilable_said": "runs where watched modules could not be scored inside a torch.compile graph (counted once)",
    "on_spike_rerun_failed": "token_stats='on_spike': re-runs of a flagged step that failed (no token view)",
    # the monitor (gradloc/engine/monitor.py)
    "failed_micro_batches": "micro-batch blocks that exited with an exception (not part of the step)",
    "dropped_rl_fields": "micro-batches whose RL fields were invalid after setup (dropped)",
    "off_boundary_steps": "DeepSpeed: end_step called off the gradient-accumulation boundary (no gradient statistics)",
    "left_job": "a gradloc collective failed: the rank is watched on its own for the rest of the run",
    # spikes (gradloc/engine/spike.py)
    "collective_timeouts": "localizations that failed because a gradloc collective timed out",
    "probe_errors": "localizations that failed because a probe (the probe closure) raised",
    "localize_errors": "localizations that failed for another reason (the incident is unavailable)",
    "classify_errors": "incidents whose classification failed (left unclassified)",
    "remedy_applied": "spike steps the opt-in remedy changed (WatchConfig.remedy)",
    "remedy_refused": "spike steps the opt-in remedy did not qualify to change",
    # optional measurements
    "sample_errors": "steps whose per-sample surprise or judgement failed (no sample findings that step)",
    "update_ratio_errors": "optimizer steps whose update-ratio measurement failed",
    "groups_dropped": "data groups (sources, tags, length buckets) past records.groups.MAX_GROUPS in a step, not counted",
    "group_errors": "steps whose per-group data count failed (no groups that step)",
    "precursors_compiled": "runs of a model handed over compiled (its head, final norm and attention modules found "
                           "by structure; an attention whose softmax is a method call or in a helper of its own is "
                           "not measured there) or with no module run eagerly in its first micro-batch (nothing measured until one is); once",
    "precursors_unsupported": "module calls whose shapes the precursor statistics do not understand (not measured)",
    "precursors_errors": "precursor measurements that failed (that call not measured)",
    "precursors_swap_missed": "attention modules that bound SDPA before gradloc's swap (measured under the mode "
                              "from then on; counted once per module)",
    "precursors_mode_errors": "the precursor attention mode could not be left cleanly (another mode was left open)",
    "precursors_vocab_split": "a tensor-parallel job whose head splits its logits over the vocabulary and has no "
                              "per-position logsumexps to combine (a compiled head): the head's logsumexp² is not "
                              "measured, its largest |logit| is (counted once)",
    "precursors_nonfinite": "precursor values that were not finite (left out of the record)",
    "precursors_own_values": "steps of a multi-rank job whose precursor values were this rank's own, not the job's: "
                             "the ranks measured different slots (a pipeline's stages; a slot new on one rank)",
    # the drift detector (gradloc/engine/drift.py, gradloc/detector/drift.py)
    "precursor_findings": "precursor findings the drift detector made (paging ones included)",
    "drift_errors": "steps whose drift judgement failed (no precursor findings that step)",
    "drift_series_dropped": "precursor series beyond DriftConfig.max_series (not judged; counted per step)",
    "precursor_findings_elsewhere": "findings on a job's precursor values that another rank reports (the one "
                                    "holding the finding's most extreme driver; every rank finds the same)",
    # delivery (gradloc/engine/fanout.py)
    "sink_errors": "sink calls (on_step, on_incident, flush, shutdown) that raised",
    "undelivered_at_close": "records the agent client could not deliver by close_timeout_s (counted at close: "
                            "after the last record, so only Monitor.counters shows it)",
    "fused_head_errors": "a fused LM head's kernel calls whose per-position scores failed (the head's gradient "
                         "unattributed)",
    # the integrations' driver: integration_{counter}
    **{f"{INTEGRATION}_{counter}": f"an integration: {meaning}" for counter, meaning in INTEGRATION_COUNTERS.items()},
}

MAX_EVENT_NAME = 64  # characters of an event name on the wire (longer ones are dropped and counted)
MAX_EVENTS = 64  # names per step record on the wire (beyond it: dropped and counted)


def event_label(name: str) -> str:
    """The ``event`` label of a counter name: itself when declared, else :data:`OTHER`."""
    return name if name in MONITOR_EVENTS else OTHER


def event_counts(counters: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The non-zero counts of ``counters`` as ``StepRecord.events``: (name, count) pairs sorted by name."""
    return tuple(sorted((str(k), int(v)) for k, v in counters.items() if v > 0))


def labelled(events: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Cumulative counts by ``event`` label: undeclared names summed into :data:`OTHER`."""
    out: dict[str, int] = {}
    for name, n in events:
        label = event_label(name)
        out[label] = out.get(label, 0) + n
    return out
