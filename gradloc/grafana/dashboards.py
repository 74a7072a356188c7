"""gradloc's six Grafana dashboards, as code (see panels.py). ``DASHBOARDS``: uid -> builder.

- **Training overview**: loss, the global gradient norm with a healthy band, incidents as annotations.
- **Layers**: per-layer norm heatmap, top layers, each layer's share of ‖∇‖² and its z-score, update ratios.
- **Tokens & incidents**: incident rate, explained share, probes per incident, top-token share, a table
  of recent incidents linking to the agent's incident page, per-sample outlier findings and the
  distribution of per-sample surprise z-scores.
- **RL**: the RL distributions (panels show "No data" for a job without RL fields, never an error).
- **Stability**: the precursor statistics (attention logits and entropy, output logits, residual RMS, update
  ratios, policy entropy, MoE routers: docs/precursors.md).
- **Agent health**: ingest, rejections, limits, client drops, queue, export failures, gradloc's overhead.

The overview's band is the detector's own: the healthy EMA mean each step was judged against and
its grad_spike line (the larger of mean + z_threshold × std and spike_ratio × mean), exported by the trainer with every step record.
"""
from __future__ import annotations

from typing import Any, Callable

from gradloc.grafana.panels import Panel, dashboard, dashed, q

S = '{job=~"$job", rank=~"$rank"}'
SL = '{job=~"$job", rank=~"$rank", layer=~"$layer"}'
J = '{job=~"$job"}'
# An incident in the last minute: the counter grew, or its series is new (a job's first incident
# appears at 1, which changes() and increase() alone would never see).
NEW_INCIDENTS = (f"sum by (job, status) ((gradloc_incidents_total{J} - gradloc_incidents_total{J} offset 1m) > 0 "
                 f"or (gradloc_incidents_total{J} unless gradloc_incidents_total{J} offset 1m))")
# One daemon per node: a series' `instance` (Prometheus' scrape target: the daemon's HTTP server, which
# serves the pages) names the daemon that holds its incidents, so the first link goes there; the second
# goes to the one `agent_url` (a single daemon, or a proxy in front of them). The queries behind links
# keep `instance`. With an auth token the list needs it too (a proxy that adds it); one incident's page
# opens from an exemplar dot without it (a signed link: gradloc/agent/links.py, provision.py).
INCIDENT_LINK = [{"title": "incidents of ${__field.labels.job} on ${__field.labels.instance}",
                  "url": "${agent_scheme}://${__field.labels.instance}/incidents?job=${__field.labels.job}",
                  "targetBlank": True},
                 {"title": "incidents of ${__field.labels.job} at ${agent_url}",
                  "url": "${agent_url}/incidents?job=${__field.labels.job}", "targetBlank": True}]


def overview() -> dict[str, Any]:
    panels = [
        Panel("Loss (largest per scrape)", [q(f"gradloc_loss_max{S}", "{{job}} r{{rank}}")], "none",
              description="The largest loss of the steps since the previous scrape (a one-step jump shows at any "
                          "step rate); the latest step's loss when no step arrived since."),
        Panel("Global gradient norm (largest per scrape) and the detector's band", [
            q(f"gradloc_grad_global_norm_max{S}", "{{job}} r{{rank}}"),
            q(f"gradloc_detector_norm_threshold{S}", "spike line {{job}} r{{rank}}"),
            q(f"gradloc_detector_norm_mean{S}", "healthy mean {{job}} r{{rank}}")],
            "none", overrides=[dashed("B", "red"), dashed("C", "green")],
            description="The largest global norm of the steps since the previous scrape (gradloc_grad_global_norm_max: "
                        "a one-step spike between two scrapes still shows), against "
                        "the detector's view of the latest step: its healthy EMA mean of the norm and its grad_spike "
                        "line (the larger of mean + z_threshold × std and spike_ratio × mean); a norm above the line "
                        "is a spike. No band during the "
                        "detector's warm-up."),
        Panel("Steps per second", [q(f"sum by (job) (rate(gradloc_steps_total{S}[$__rate_interval]))", "{{job}}")],
              "ops", width=8),
        Panel("Spikes by kind", [q(f"sum by (job, kind) (increase(gradloc_spikes_total{S}[$__rate_interval]))",
                                   "{{job}} {{kind}}")], "short", width=8),
        Panel("Skipped and non-finite steps", [
            q(f"sum by (job) (increase(gradloc_skipped_steps_total{S}[$__rate_interval]))", "skipped {{job}}"),
            q(f"sum by (job) (increase(gradloc_nonfinite_steps_total{S}[$__rate_interval]))", "non-finite {{job}}")],
            "short", width=8),
    ]
    annotations = [{"name": "incidents", "enable": True, "iconColor": "red", "datasource": {"type": "prometheus",
                    "uid": "${datasource}"}, "expr": NEW_INCIDENTS,
                    "titleFormat": "incident ({{status}})", "textFormat": "job {{job}}", "step": "30s",
                    "useValueForTime": False}]
    return dashboard("gradloc-overview", "gradloc · Training overview", panels,
                     "Loss, gradient norm with its healthy band, incidents as annotations.", annotations)


def layers() -> dict[str, Any]:
    sq = f"gradloc_grad_norm{SL} ^ 2"
    panels = [
        Panel("Per-layer gradient norm", [q(f"gradloc_grad_norm{SL}", "{{layer}}")], "none", kind="heatmap",
              width=24, height=10),
        Panel("Top 10 layers by gradient norm", [q(f"topk(10, gradloc_grad_norm{SL})", "{{layer}} r{{rank}}")], "none"),
        Panel("Share of ‖∇‖² per layer", [q(f"{sq} / on (job, rank) group_left sum by (job, rank) "
                                            f"(gradloc_grad_norm{S} ^ 2)", "{{layer}}")], "percentunit"),
        Panel("Layer z-score (against its own last hour)", [
            q(f"(gradloc_grad_norm{SL} - avg_over_time(gradloc_grad_norm{SL}[1h])) / "
              f"stddev_over_time(gradloc_grad_norm{SL}[1h])", "{{layer}}")], "none"),
        Panel("Update-to-weight ratio ‖Δθ‖/‖θ‖", [q(f"gradloc_update_ratio{SL}", "{{layer}}")], "none"),
        Panel("Largest |g| per layer", [q(f"gradloc_grad_max_abs{SL}", "{{layer}}")], "none", width=24),
    ]
    return dashboard("gradloc-layers", "gradloc · Layers", panels,
                     "Which layers carry the gradient: heatmap, top layers, shares, z-scores, update ratios.")


def tokens() -> dict[str, Any]:
    panels = [
        Panel("Incidents per hour by status", [q(f"sum by (job, status) (rate(gradloc_incidents_total{J}[$__rate_interval])) * 3600",
                                                 "{{job}} {{status}}")], "short", width=8),
        Panel("Explained share (median, p10)", [
            q(f"histogram_quantile(0.5, sum by (job, le) (rate(gradloc_localization_explained_ratio_bucket{J}[1h])))",
              "median {{job}}"),
            q(f"histogram_quantile(0.1, sum by (job, le) (rate(gradloc_localization_explained_ratio_bucket{J}[1h])))",
              "p10 {{job}}")], "percentunit", width=8),
        Panel("Probes per incident (mean)", [
            q(f"sum by (job) (rate(gradloc_localization_probes_sum{J}[1h])) / "
              f"sum by (job) (rate(gradloc_localization_probes_count{J}[1h]))", "{{job}}")], "short", width=8),
        Panel("Top token's share of the token score", [q(f"gradloc_token_top_share_ratio{S}", "{{job}} r{{rank}}")],
              "percentunit"),
        Panel("Unattributed share", [q(f"gradloc_token_unattributed_ratio{S}", "{{job}} r{{rank}}")], "percentunit"),
        Panel("Localizations by outcome", [q(f"sum by (job, status) (increase(gradloc_localizations_total{J}[$__range]))",
                                             "{{status}}", instant=True)], "short", kind="bargauge", width=8),
        Panel("Incident classes", [q(f"sum by (job, class) (increase(gradloc_incident_classes_total{J}[$__range]))",
                                     "{{class}}", instant=True)], "short", kind="bargauge", width=8),
        Panel("Recent incidents (open the incident page)", [
            q(f"sum by (job, status, instance) (gradloc_incidents_total{J})", "", instant=True)],
            "short", kind="table", width=8, links=INCIDENT_LINK,
            description="Incidents per job, status and daemon (instance) since the daemon began tracking the job "
                        "(Prometheus cannot list incidents: an id as a label would be unbounded); the link opens "
                        "that daemon's list of the job's incidents. One incident at a time: the exemplar dots on "
                        "'Incidents per hour by status' carry its trace id and link to its page on the daemon "
                        "that holds it."),
        Panel("Sample outliers per hour by kind", [
            q(f"sum by (job, kind, instance) (rate(gradloc_sample_outliers_total{S}[$__rate_interval])) * 3600",
              "{{job}} {{kind}}")], "short", width=12, links=INCIDENT_LINK,
            description="Findings, not incidents (no probe, nothing pages): samples whose surprise (mean −log p of "
                        "their loss tokens, read off the loss head's gradient) stands out against the run's own "
                        "history — random-id garbage, shifted labels, another script — and sustained RL "
                        "training–inference mismatch. The link lists them (sample id, span, text)."),
        Panel("Per-sample surprise z (median, p99, p99.9)", [
            q(f"histogram_quantile({p}, sum by (job, le) (rate(gradloc_sample_surprise_z_bucket{J}[$__rate_interval])))",
              f"p{100 * p:g} {{{{job}}}}") for p in (0.5, 0.99, 0.999)], "none", width=12,
            description="Every judged sample's z against the run's history (z <= 0 counts in the first bucket); "
                        "a sample at z >= SampleConfig.z_threshold (6) is an outlier."),
        Panel("Spikes and outliers per million tokens, by source", [
            q(f"1e6 * sum by (job, source, instance) (increase(gradloc_source_flags_total{J}[$__range])) / "
              f"sum by (job, source, instance) (increase(gradloc_source_tokens_total{J}[$__range]))", "{{job}} {{source}}",
              instant=True)], "short", kind="bargauge", width=12, links=INCIDENT_LINK,
            description="Culprit spans of incidents plus surprise outliers per million loss tokens each data source "
                        "contributed over the range: a source with a small share of the tokens and many flags is "
                        "where bad data comes from (the trainer gives provenance: docs/provenance.md). source: the "
                        "configured sources, the first --max-sources seen, then other. gradloc-agent patterns has "
                        "tags, length, position and token class too."),
        Panel("Tokens by source", [
            q(f"sum by (job, source, instance) (rate(gradloc_source_tokens_total{J}[$__rate_interval]))", "{{job}} {{source}}")],
            "short", width=12, description="Loss tokens per second per data source: the mixture as trained."),
    ]
    return dashboard("gradloc-tokens", "gradloc · Tokens & incidents", panels,
                     "Incident rate, how well spikes are explained, and links to the incidents.")


def rl() -> dict[str, Any]:
    panels = [
        Panel("Max |log π_old − log π_rollout|", [q(f"gradloc_rl_max_abs_log_ratio{S}", "{{rank}} {{reference}}")],
              "none"),
        Panel("Mismatch share of tokens and the run's baseline", [
            q(f"gradloc_rl_mismatch_ratio{S}", "{{job}} r{{rank}}"),
            q(f"2 * gradloc_rl_mismatch_baseline_ratio{S} + 0.05", "finding line {{job}} r{{rank}}")],
            "percentunit", overrides=[dashed("B", "red")],
            description="Share of loss tokens with |log π_trainer − log π_rollout| > log 2, and the line above which "
                        "a step counts toward an rl_mismatch finding (2 × the run's healthy baseline + 0.05; "
                        "GradlocRLMismatchSustained fires after 5 min above it)."),
        Panel("Clipped share of tokens", [q(f"gradloc_rl_clipped_ratio{S}", "{{job}} r{{rank}}")], "percentunit"),
        Panel("Entropy", [q(f"gradloc_rl_entropy{S}", "{{job}} r{{rank}}"),
                          q(f"max by (job) (gradloc_rl_job_entropy{S})", "{{job}} (job)")], "none",
              description="Each rank's mean entropy of its trained tokens, and the job's over every rank's tokens."),
        Panel("Log ratio distribution (p99 |.|)", [
            q(f"histogram_quantile(0.99, sum by (job, le) (rate(gradloc_rl_log_ratio_bucket{J}[$__rate_interval])))",
              "p99 {{job}}")], "none"),
        Panel("Advantage distribution (p1, p99)", [
            q(f"histogram_quantile(0.01, sum by (job, le) (rate(gradloc_rl_advantage_bucket{J}[$__rate_interval])))", "p1"),
            q(f"histogram_quantile(0.99, sum by (job, le) (rate(gradloc_rl_advantage_bucket{J}[$__rate_interval])))", "p99")],
            "none"),
    ]
    return dashboard("gradloc-rl", "gradloc · RL", panels,
                     "Training–inference mismatch, clipping, entropy and advantages (jobs that hand over RL fields).")


def agent() -> dict[str, Any]:
    panels = [
        Panel("Records ingested per second", [q("sum by (kind) (rate(gradloc_agent_records_total[$__rate_interval]))",
                                                "{{kind}}")], "ops", width=8),
        Panel("Rejected messages", [q("sum by (reason) (increase(gradloc_agent_rejected_total[$__rate_interval]))",
                                      "{{reason}}")], "short", width=8),
        Panel("Limited, duplicates", [
            q("sum by (limit) (increase(gradloc_agent_limited_total[$__rate_interval]))", "limited {{limit}}"),
            q("sum by (kind) (increase(gradloc_agent_duplicates_total[$__rate_interval]))", "duplicate {{kind}}")],
            "short", width=8),
        Panel("Client drops", [q(f"sum by (job, rank, reason) (increase(gradloc_client_dropped_total{S}[$__rate_interval]))",
                                 "{{job}} r{{rank}} {{reason}}")], "short", width=8),
        Panel("Queue depth and incidents waiting for stragglers", [
            q("gradloc_agent_queue_depth", "ingest batches queued"),
            q("gradloc_agent_pending_correlations", "incidents waiting")], "short", width=8,
            description="Batches queued for the pipeline (clients are told to back off at queue_size) and incidents "
                        "waiting for straggler ranks."),
        Panel("Export failures and drops", [
            q("sum by (exporter) (increase(gradloc_export_failures_total[$__rate_interval]))", "failed {{exporter}}"),
            q("sum by (exporter) (increase(gradloc_export_dropped_total[$__rate_interval]))", "dropped {{exporter}}"),
            q("sum by (reason) (increase(gradloc_agent_series_dropped_total[$__rate_interval]))", "series {{reason}}")],
            "short", width=8),
        Panel("Ingest lag (p99)", [q("histogram_quantile(0.99, sum by (le) (rate(gradloc_agent_ingest_lag_seconds_bucket"
                                     "[$__rate_interval])))", "p99")], "s"),
        Panel("Time since a job's last record", [q(f"time() - gradloc_last_record_timestamp_seconds{S}",
                                                   "{{job}} r{{rank}}")], "s"),
        Panel("gradloc's own overhead (share of step time)", [q(f"gradloc_overhead_ratio{S}", "{{job}} r{{rank}}")],
              "percentunit"),
        Panel("Features shed to stay within budget", [q(f"gradloc_shed{S}", "{{feature}} r{{rank}}")], "none"),
    ]
    return dashboard("gradloc-agent", "gradloc · Agent health", panels,
                     "Is the agent keeping up, and is gradloc within its overhead budget?")


def stability() -> dict[str, Any]:
    """The precursor statistics (docs/precursors.md): per module, the module's own name in ``layer`` (not a layer
    group: the $layer variable does not filter them)."""
    panels = [
        Panel("Precursor findings (drift detector)", [
            q(f"sum by (job, statistic, trend, pages) (gradloc_precursor_findings_total{S})",
              "{{job}} {{statistic}} {{trend}} pages={{pages}}")], "none",
            description="Findings so far: a statistic moving steadily away from its own history (or swinging far "
                        "wider). Which module, since when and the samples behind it: gradloc-agent incidents "
                        "precursors, /api/precursors. pages=true: persisted and accelerating."),
        Panel("Attention: largest logit per module", [q(f"gradloc_attention_max_logit{S}", "{{layer}} r{{rank}}")],
              "none", description="Largest q·k × scale of each attention module, max over heads (SDPA: over the "
                                  "sampled query rows). Growing without bound precedes attention collapse "
                                  "(Wortsman et al.); qk-norm holds it."),
        Panel("Attention: entropy per module (lowest head)", [
            q(f"gradloc_attention_entropy_nats{S}", "{{layer}} r{{rank}}")], "none",
            description="Mean entropy of each attention module's rows, its lowest head's, in nats. A fall toward 0 "
                        "is entropy collapse (Zhai et al.)."),
        Panel("Attention per head (PrecursorConfig.per_head)", [
            q(f"gradloc_attention_head_max_logit{S}", "max logit {{layer}} h{{head}}"),
            q(f"gradloc_attention_head_entropy_nats{S}", "entropy {{layer}} h{{head}}")], "none",
            description="Per-head values, only where the monitor measures them per head."),
        Panel("Output logits: largest |logit| and mean logsumexp²", [
            q(f"gradloc_output_logit_max_abs{S}", "max |logit| r{{rank}}"),
            q(f"gradloc_output_logsumexp_squared{S}", "logsumexp² r{{rank}}")], "none",
            description="At the loss head. A steady drift is output-logit divergence; z-loss penalises the second."),
        Panel("Residual stream RMS at the final norm", [q(f"gradloc_residual_rms{S}", "{{layer}} r{{rank}}")], "none"),
        Panel("Update-to-weight ratio, largest layer", [
            q(f"max by (job, rank) (gradloc_update_ratio{S})", "{{job}} r{{rank}}")], "none",
            description="‖Δθ‖/‖θ‖ of the layer that moved most in its last measured update."),
        Panel("Policy entropy and KL to the rollout policy (RL)", [
            q(f"max by (job) (gradloc_rl_job_entropy{S})", "entropy {{job}}"),
            q(f"max by (job) (gradloc_rl_job_kl_rollout{S})", "KL {{job}}")], "none",
            description="The job's mean entropy of the trained tokens over every rank's, as the trainers hand it "
                        "over (a collapse precedes RL instabilities; what the drift detector judges), and "
                        "KL(π_rollout ‖ π_trainer) per token (jobs with RL fields only)."),
        Panel("MoE routers: routing entropy", [q(f"gradloc_router_entropy_nats{S}", "{{layer}} r{{rank}}")], "none",
              description="Mean routing entropy per router; a fall is router collapse."),
        Panel("MoE routers: load of the busiest expert, dead experts", [
            q(f"gradloc_expert_load_max_ratio{S}", "busiest/mean {{layer}} r{{rank}}"),
            q(f"gradloc_dead_experts{S}", "dead {{layer}} r{{rank}}")], "none",
            description="The most loaded expert's token share over the mean (1 = balanced) and experts no token "
                        "reached this step."),
        Panel("Load per expert (PrecursorConfig.per_head)", [
            q(f"gradloc_expert_load_ratio{S}", "{{layer}} e{{expert}}")], "none"),
    ]
    return dashboard("gradloc-stability", "gradloc · Stability", panels,
                     "The slow instabilities before a spike: attention logits and entropy, output logits, the residual "
                     "stream, update ratios, policy entropy, MoE routers.")


DASHBOARDS: dict[str, Callable[[], dict[str, Any]]] = {
    "overview": overview, "layers": layers, "tokens": tokens, "rl": rl, "stability": stability, "agent": agent}
