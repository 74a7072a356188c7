"""Every metric gradloc exports, defined once: Prometheus name, OTel name, type, unit, labels.

The Prometheus collector, the OTLP exporter and ``docs/metrics.md`` are all derived from
:data:`SPECS` (a test checks the doc lists exactly these). Conventions (docs/metrics.md):

* Prometheus: base units, ``_total`` on counters (the family name here omits it; the client adds
  it), ``_ratio`` for dimensionless ratios (shares in [0, 1], ‖Δθ‖/‖θ‖, gradloc's overhead),
  ``_seconds`` for durations.
* OTel: dot-separated names without units, UCUM units (``1``, ``s``, ``{step}``).
* Labels are bounded: ``job``, ``rank``, ``layer`` (bounded by the model and the layer grouping),
  and small closed sets (``kind``, ``status``, ``reason``, ``exporter``). Never step numbers, sample
  ids, token ids or text — those live in incidents and traces.
* Gradient norms span ~1e-8 … 1e4: histograms use explicit log-spaced buckets, 2 per decade.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradloc.records import RL_ADVANTAGE_BUCKETS, RL_LOG_RATIO_BUCKETS, SAMPLE_Z_BUCKETS

# 1e-8 … 1e4, two boundaries per decade (1, 3.16): 25 buckets plus +Inf.
NORM_BUCKETS: tuple[float, ...] = tuple(float(f"{x:.3g}") for x in np.logspace(-8, 4, 25))
PROBE_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LAG_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class MetricSpec:
    key: str  # internal id used by TelemetryState
    prom: str  # Prometheus family name (counters: without the `_total` suffix)
    otel: str
    kind: str  # "gauge" | "counter" | "histogram"
    unit: str  # UCUM
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()
    # a histogram the trainer sends as bucket counts (not per value): exported from the state's
    # cumulative counts, in Prometheus as any histogram and over OTLP as pre-aggregated points
    preaggregated: bool = False

    @property
    def prom_sample(self) -> str:
        """The sample name a scrape shows (``…_total`` for counters)."""
        return self.prom + "_total" if self.kind == "counter" else self.prom


def _g(key: str, prom: str, otel: str, unit: str, labels: tuple[str, ...], help: str) -> MetricSpec:
    return MetricSpec(key, prom, otel, "gauge", unit, labels, help)


def _c(key: str, prom: str, otel: str, unit: str, labels: tuple[str, ...], help: str) -> MetricSpec:
    return MetricSpec(key, prom, otel, "counter", unit, labels, help)


def _h(key: str, prom: str, otel: str, unit: str, labels: tuple[str, ...], help: str,
       buckets: tuple[float, ...], preaggregated: bool = False) -> MetricSpec:
    return MetricSpec(key, prom, otel, "histogram", unit, labels, help, buckets, preaggregated)


JR = ("job", "rank")
JRL = ("job", "rank", "layer")

SPECS: tuple[MetricSpec, ...] = (
    # Latest step of each rank (gauges read from the newest record at scrape/export time).
    _g("global_norm", "gradloc_grad_global_norm", "gradloc.grad.global_norm", "1", JR,
       "L2 norm of all (unscaled) gradients at the optimizer boundary, latest step."),
    # Window maxima: what the latest-step gauges miss between two collections (docs/metrics.md, Window maxima).
    _g("global_norm_max", "gradloc_grad_global_norm_max", "gradloc.grad.global_norm_max", "1", JR,
       "Largest global gradient norm of the steps received since this exporter's previous collection (scrape or "
       "OTLP export); the latest step's norm when none arrived since. A one-step spike between two scrapes shows."),
    _g("loss_max", "gradloc_loss_max", "gradloc.loss_max", "1", JR,
       "Largest training loss of the steps received since this exporter's previous collection; the latest step's "
       "loss when none arrived since."),
    _g("norm_mean", "gradloc_detector_norm_mean", "gradloc.detector.norm_mean", "1", JR,
       "The detector's healthy level of the global norm (EMA mean) the latest step was judged against; during its "
       "warm-up, the median of the warm-up's last quarter so far (absent before its 3rd step)."),
    _g("norm_threshold", "gradloc_detector_norm_threshold", "gradloc.detector.norm_threshold", "1", JR,
       "The detector's grad_spike line for the latest step: the larger of healthy mean + z_threshold × std and "
       "spike_ratio × mean. A global norm above it is a spike. During the warm-up, the warmup_spike line "
       "(warmup_ratio × the warm-up's recent median)."),
    _g("layer_norm", "gradloc_grad_norm", "gradloc.grad.norm", "1", JRL,
       "L2 norm of one layer group's gradient, latest step."),
    _g("layer_max_abs", "gradloc_grad_max_abs", "gradloc.grad.max_abs", "1", JRL,
       "Largest absolute gradient element of one layer group, latest step."),
    _g("update_ratio", "gradloc_update_ratio", "gradloc.update.ratio", "1", JRL,
       "‖Δθ‖/‖θ‖ of one layer group's last optimizer update."),
    _g("loss", "gradloc_loss", "gradloc.loss", "1", JR, "Training loss of the latest step."),
    _g("step", "gradloc_step", "gradloc.step", "{step}", JR, "Latest optimizer step reported (a value, never a label)."),
    _g("record_time", "gradloc_last_record_timestamp_seconds", "gradloc.record.time", "s", JR,
       "Unix time the latest step record was produced on the trainer."),
    _g("token_top_share", "gradloc_token_top_share_ratio", "gradloc.token.top_share", "1", JR,
       "Share of the step's per-token attribution score carried by its top token."),
    _g("unattributed", "gradloc_token_unattributed_ratio", "gradloc.token.unattributed_share", "1", JR,
       "Share of ‖∇‖² in parameters no per-token rule covers."),
    _g("grad_scale", "gradloc_amp_grad_scale", "gradloc.amp.grad_scale", "1", JR,
       "Mixed-precision loss scale the raw gradients carried (AMP GradScaler)."),
    _g("nonfinite", "gradloc_grad_nonfinite_elements", "gradloc.grad.nonfinite", "{element}", JR,
       "Non-finite gradient elements in the latest step."),
    _g("overhead", "gradloc_overhead_ratio", "gradloc.overhead", "1", JR,
       "gradloc's own time per step over the training step's own time, smoothed (0.04: steps take 4% longer)."),
    _g("rl_max_abs_log_ratio", "gradloc_rl_max_abs_log_ratio", "gradloc.rl.max_abs_log_ratio", "1",
       ("job", "rank", "reference"),
       "Largest |log-ratio| over the step's loss tokens: reference=rollout is log π_old − log π_rollout (training–inference "
       "mismatch), reference=old is log π_train − log π_old (staleness)."),
    _g("rl_mismatch", "gradloc_rl_mismatch_ratio", "gradloc.rl.mismatch_fraction", "1", JR,
       "Share of the step's loss tokens whose |log π_old − log π_rollout| exceeds log 2 (ratio outside [1/2, 2])."),
    _g("rl_clipped", "gradloc_rl_clipped_ratio", "gradloc.rl.clip_fraction", "1", JR,
       "Share of the step's loss tokens whose importance ratio the loss clipped."),
    _g("rl_entropy", "gradloc_rl_entropy", "gradloc.rl.entropy", "1", JR, "Mean policy entropy over the step's loss tokens."),
    _g("rl_kl_rollout", "gradloc_rl_kl_rollout", "gradloc.rl.kl_rollout", "1", JR,
       "KL(π_rollout ‖ π_trainer) per loss token, the mean of exp(r) − 1 − r over the sampled tokens (r: the "
       "mismatch log ratio)."),
    _g("rl_job_entropy", "gradloc_rl_job_entropy", "gradloc.rl.job_entropy", "1", JR,
       "The job's mean policy entropy over every rank's loss tokens, what the drift detector judges (every rank "
       "exports it; on one process it is gradloc_rl_entropy)."),
    _g("rl_job_kl_rollout", "gradloc_rl_job_kl_rollout", "gradloc.rl.job_kl_rollout", "1", JR,
       "The job's KL(π_rollout ‖ π_trainer) per loss token over every rank's tokens (every rank exports it)."),
    _g("rl_mismatch_baseline", "gradloc_rl_mismatch_baseline_ratio", "gradloc.rl.mismatch_baseline", "1", JR,
       "The run's own healthy mismatch share (median over recent steps that were not flagged); absent before its "
       "warm-up. A share above 2 × this + 0.05 for rl_patience steps is an rl_mismatch finding."),
    _g("shed", "gradloc_shed", "gradloc.shed", "1", ("job", "rank", "feature"),
       "1 while gradloc sheds an optional feature (update_ratio, layer_breakdown) to stay within its overhead budget, else 0."),
    # Precursor statistics of the latest step (gradloc/records/precursors.py), per module that measured them; per
    # head and per expert only with PrecursorConfig.per_head.
    _g("attn_max_logit", "gradloc_attention_max_logit", "gradloc.attention.max_logit", "1", JRL,
       "Largest attention logit (q·k × scale) of one attention module, max over heads; SDPA/flash: over the sampled "
       "query rows (PrecursorConfig.attention_queries), eager: every row."),
    _g("attn_entropy", "gradloc_attention_entropy_nats", "gradloc.attention.entropy", "nat", JRL,
       "Mean entropy of one attention module's rows, the lowest head's (attention entropy collapse: falling)."),
    _g("attn_head_max_logit", "gradloc_attention_head_max_logit", "gradloc.attention.head_max_logit", "1",
       ("job", "rank", "layer", "head"), "Largest attention logit of one head (PrecursorConfig.per_head)."),
    _g("attn_head_entropy", "gradloc_attention_head_entropy_nats", "gradloc.attention.head_entropy", "nat",
       ("job", "rank", "layer", "head"), "Mean row entropy of one attention head (PrecursorConfig.per_head)."),
    _g("logit_max_abs", "gradloc_output_logit_max_abs", "gradloc.output.logit_max_abs", "1", JRL,
       "Largest |output logit| at the loss head (output-logit divergence: rising)."),
    _g("logit_lse_sq", "gradloc_output_logsumexp_squared", "gradloc.output.logsumexp_squared", "1", JRL,
       "Mean logsumexp² of the output logits over the loss positions: the z-loss term."),
    _g("residual_rms", "gradloc_residual_rms", "gradloc.residual.rms", "1", JRL,
       "Root mean square of the residual stream at the final norm's input, mean over positions."),
    _g("router_entropy", "gradloc_router_entropy_nats", "gradloc.router.entropy", "nat", JRL,
       "Mean routing entropy of one MoE router over the step's tokens (router collapse: falling)."),
    _g("expert_load_max", "gradloc_expert_load_max_ratio", "gradloc.expert.load_max", "1", JRL,
       "The most loaded expert's share of one router's routed tokens over the mean share (1: balanced)."),
    _g("expert_load", "gradloc_expert_load_ratio", "gradloc.expert.load", "1", ("job", "rank", "layer", "expert"),
       "One expert's share of its router's routed tokens over the mean share (PrecursorConfig.per_head)."),
    _g("dead_experts", "gradloc_dead_experts", "gradloc.expert.dead", "{expert}", JRL,
       "Experts of one router that no token of the step was routed to."),
    # Counters over the whole run.
    _c("steps", "gradloc_steps", "gradloc.step.count", "{step}", JR, "Step records received."),
    _c("skipped_steps", "gradloc_skipped_steps", "gradloc.step.skipped", "{step}", JR,
       "Steps whose optimizer update was skipped (AMP found inf/NaN)."),
    _c("nonfinite_steps", "gradloc_nonfinite_steps", "gradloc.step.nonfinite", "{step}", JR,
       "Steps with at least one non-finite gradient element."),
    _c("spikes", "gradloc_spikes", "gradloc.spike.count", "{spike}", ("job", "rank", "kind"),
       "Detector findings by kind (one step can have several kinds). Exemplar: incident trace id."),
    _c("incidents", "gradloc_incidents", "gradloc.incident.count", "{incident}", ("job", "status"),
       "Correlated incidents closed (status complete|partial). Exemplar: incident trace id."),
    _c("localizations", "gradloc_localizations", "gradloc.localization.count", "{localization}", ("job", "status"),
       "Per-rank localizations of incidents by outcome (located, diffuse, unverified, unavailable)."),
    _c("incident_classes", "gradloc_incident_classes", "gradloc.incident.class_count", "{finding}", ("job", "class"),
       "Per-rank incident findings by class (train_inference_mismatch, stale_off_policy, low_prob_high_advantage, "
       "layer_concentrated, diffuse, unclassified)."),
    _c("remedies", "gradloc_remedies", "gradloc.remedy.count", "{step}", ("job", "action", "applied"),
       "Spike steps the opt-in remedy acted on (applied=true) or refused (applied=false), by action."),
    _c("sample_outliers", "gradloc_sample_outliers", "gradloc.sample.outliers", "{finding}", ("job", "rank", "kind"),
       "Findings (not incidents: no probe, no page) by kind: surprise (a sample whose surprise stands out against the "
       "run's history), rl_mismatch (a sustained training–inference mismatch)."),
    _c("precursor_findings", "gradloc_precursor_findings", "gradloc.precursor.findings", "{finding}",
       ("job", "rank", "statistic", "trend", "pages"),
       "The drift detector's findings (not incidents: no probe) by statistic (a precursor kind, rl_entropy, "
       "rl_kl_rollout, update_ratio) and trend (rising, falling, oscillating); pages=true: the second finding of a "
       "series whose drift persisted and accelerated. The layer, step and samples are in the finding "
       "(gradloc-agent incidents precursors, /api/precursors), never labels."),
    _c("source_tokens", "gradloc_source_tokens", "gradloc.source.tokens", "{token}", ("job", "source"),
       "Loss tokens trained on per data source (StepRecord.groups, summed over ranks; when the trainer gives "
       "provenance: docs/provenance.md). source: a configured source, one of the first max_sources seen, or other."),
    _c("source_flags", "gradloc_source_flags", "gradloc.source.flags", "{flag}", ("job", "source", "kind"),
       "Flags per data source: kind=culprit (an incident's culprit span), kind=outlier (a surprise outlier a step "
       "carried). Divided by gradloc_source_tokens_total: flags per million tokens (the Patterns panel)."),
    _c("missing_ranks", "gradloc_incident_missing_ranks", "gradloc.incident.missing_ranks", "{rank}", ("job",),
       "Ranks that never reported a step that became an incident (straggler deadline passed)."),
    _c("monitor_events", "gradloc_monitor_events", "gradloc.monitor.events", "{event}", ("job", "rank", "event"),
       "Events where the trainer-side monitor dropped or degraded something without raising into training "
       "(Monitor.counters, cumulative per rank; a restarted trainer's counts add on top). event: a name declared in "
       "gradloc/records/events.py (docs/metrics.md, Monitor events), or other for a name that is not."),
    # Distributions.
    _h("norm_hist", "gradloc_step_grad_norm", "gradloc.step.grad_norm", "1", JR,
       "Distribution of per-step global gradient norms (log-spaced buckets). Prometheus exemplar: incident trace id.",
       NORM_BUCKETS),
    _h("probes", "gradloc_localization_probes", "gradloc.localization.probes", "{probe}", ("job",),
       "Forward/backward probes a localization used (summed over ranks).", PROBE_BUCKETS),
    _h("explained", "gradloc_localization_explained_ratio", "gradloc.localization.explained_share", "1",
       ("job",), "Share of ‖∇‖² the located culprits explain.",
       (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)),
    _h("sample_surprise_z", "gradloc_sample_surprise_z", "gradloc.sample.surprise_z", "1", ("job",),
       "Per-sample surprise z-score against the run's own history, every judged sample (z <= 0 in the first bucket).",
       SAMPLE_Z_BUCKETS, preaggregated=True),
    _h("rl_log_ratio", "gradloc_rl_log_ratio", "gradloc.rl.log_ratio", "1", ("job",),
       "Per-token training–inference mismatch log π_old − log π_rollout (log π_train without an old policy), every step's loss tokens.",
       RL_LOG_RATIO_BUCKETS, preaggregated=True),
    _h("rl_advantage", "gradloc_rl_advantage", "gradloc.rl.advantage", "1", ("job",),
       "Per-token advantages over every step's loss tokens.", RL_ADVANTAGE_BUCKETS, preaggregated=True),
    # Self-metrics of the pipeline: nothing is dropped silently.
    _c("records", "gradloc_agent_records", "gradloc.agent.records", "{record}", ("kind",),
       "Records accepted by the agent (kind step|incident)."),
    _c("limited", "gradloc_agent_limited", "gradloc.agent.limited", "{record}", ("limit",),
       "Incidents dropped (incident_rate) or cut (culprits) by a configured per-job limit."),
    _c("duplicates", "gradloc_agent_duplicates", "gradloc.agent.duplicates", "{record}", ("kind",),
       "Records a client re-sent after a lost acknowledgement, recognised and not stored twice."),
    _c("rejected", "gradloc_agent_rejected", "gradloc.agent.rejected", "{message}", ("reason",),
       "Ingest messages rejected, by reason (malformed, oversized, schema_version, nonfinite, ...)."),
    _c("client_dropped", "gradloc_client_dropped", "gradloc.client.dropped", "{record}", ("job", "rank", "reason"),
       "Records a trainer-side client dropped (queue_full, send_failed, encode_failed, rejected)."),
    _c("export_failures", "gradloc_export_failures", "gradloc.export.failures", "{batch}", ("exporter",),
       "Failed export attempts (otlp_metrics, otlp_traces, store)."),
    _c("export_dropped", "gradloc_export_dropped", "gradloc.export.dropped", "{item}", ("exporter",),
       "Items an exporter dropped (queue full, retries exhausted)."),
    _c("retention_deleted", "gradloc_agent_retention_deleted", "gradloc.agent.retention_deleted", "{row}", ("rule",),
       "Store rows the retention limits deleted (incidents_by_age, incidents_by_count, steps_by_age, steps_by_count, spans, inbox, sample_outliers, precursor_findings, step_groups)."),
    _c("series_dropped", "gradloc_agent_series_dropped", "gradloc.agent.series_dropped", "{record}", ("reason",),
       "Records whose series were not exported because a cardinality bound was hit (max_series, max_layers); "
       "monitor_events: event counts a step carried that were invalid (an empty name or one over 64 characters, a "
       "negative count, beyond 64 names), dropped and the step kept; data_groups: data groups a step carried that "
       "were invalid (an unknown kind, an empty or too long name, a negative count, beyond 64), dropped and the step kept; "
       "precursors: precursor statistics a step carried that were invalid (an unknown kind, a too long layer name, a "
       "negative head, a non-finite value, a bad location, beyond 4096), dropped and the step kept; precursor_findings: "
       "drift findings a step carried that were invalid (an unknown statistic or trend, a non-finite value, a drift "
       "starting after its step, a bad driver, beyond 64), dropped and the step kept."),
    _h("ingest_lag", "gradloc_agent_ingest_lag_seconds", "gradloc.agent.ingest_lag", "s", (),
       "Time from a record's production on the trainer to its ingestion by the agent.", LAG_BUCKETS),
    _g("pending", "gradloc_agent_pending_correlations", "gradloc.agent.pending", "{incident}", (),
       "Incidents waiting for straggler ranks."),
    _g("queued", "gradloc_agent_queue_depth", "gradloc.agent.queue_depth", "{batch}", (),
       "Ingest batches waiting for the agent's pipeline (at most queue_size; beyond it clients are told to back off)."),
)
AGENT_GAUGES = ("pending", "queued")  # the agent's own unlabelled gauges (TelemetrySnapshot fields)

BY_KEY: dict[str, MetricSpec] = {s.key: s for s in SPECS}
