"""The generated part of ``docs/metrics.md``: metric, bucket and limit tables built from the specs.

``python -m gradloc.exporters.metric_docs`` prints it; a test checks that the doc contains exactly
this text, so the doc cannot drift from :data:`~gradloc.exporters.metric_specs.SPECS`.
"""
from __future__ import annotations

import dataclasses

from prometheus_client.utils import floatToGoString

from gradloc.exporters.metric_specs import SPECS, MetricSpec
from gradloc.exporters.prometheus import prom_unit
from gradloc.exporters.state import StateConfig
from gradloc.records.events import MONITOR_EVENTS, OTHER

BEGIN = "<!-- BEGIN GENERATED: python -m gradloc.exporters.metric_docs -->"
END = "<!-- END GENERATED -->"

LIMIT_MEANINGS = {
    "max_series": "(job, rank) pairs with live gauges; further ranks only count "
                  "(`gradloc_agent_series_dropped_total{reason=\"max_series\"}`)",
    "max_layers": "`layer` values per rank; the first N layers of a record get series, the record counts "
                  "in `gradloc_agent_series_dropped_total{reason=\"max_layers\"}`",
    "stale_after_s": "seconds without a record after which a rank's gauges disappear (counters stay)",
    "sources": "data sources that always get their own `source` label (`--sources`)",
    "max_sources": "other `source` values labelled by name, first seen first; later ones are `other` "
                   "(sample ids, origins and tags never become labels)",
}


def _cell(text: str) -> str:
    """Markdown table cell: a literal ``|`` would split the cell."""
    return text.replace("|", "\\|")


def scraped_names(spec: MetricSpec) -> str:
    """The sample names a scrape shows for ``spec``."""
    if spec.kind == "histogram":
        return f"`{spec.prom}_bucket`, `{spec.prom}_sum`, `{spec.prom}_count`"
    return f"`{spec.prom_sample}`"


def _unit(spec: MetricSpec) -> str:
    om = prom_unit(spec)
    return f"`{spec.unit}`" + (f" (OpenMetrics `{om}`)" if om else "")


def metrics_table() -> str:
    rows = ["| Prometheus (as scraped) | OTel | Type | Unit (UCUM) | Labels | Meaning |",
            "|---|---|---|---|---|---|"]
    for s in SPECS:
        labels = ", ".join(f"`{label}`" for label in s.labels) or "—"
        rows.append(f"| {scraped_names(s)} | `{s.otel}` | {s.kind} | {_unit(s)} | {labels} | {_cell(s.help)} |")
    return "\n".join(rows)


def buckets_table() -> str:
    rows = ["| Histogram | Upper bounds (`le`; `+Inf` is implicit) |", "|---|---|"]
    for s in SPECS:
        if s.kind == "histogram":
            rows.append(f"| `{s.prom}` | {', '.join(floatToGoString(b) for b in s.buckets)} |")
    return "\n".join(rows)


def events_table() -> str:
    """The ``event`` values of ``gradloc_monitor_events_total`` (gradloc/records/events.py), with their meanings."""
    rows = ["| `event` | What the monitor counted (cumulative per rank) |", "|---|---|"]
    rows += [f"| `{name}` | {_cell(meaning)} |" for name, meaning in MONITOR_EVENTS.items()]
    rows.append(f"| `{OTHER}` | any counter name not declared in `gradloc/records/events.py` (summed) |")
    return "\n".join(rows)


def limits_table() -> str:
    rows = ["| `StateConfig` field | Default | Meaning |", "|---|---|---|"]
    for f in dataclasses.fields(StateConfig):
        rows.append(f"| `{f.name}` | {f.default} | {_cell(LIMIT_MEANINGS.get(f.name, ''))} |")
    return "\n".join(rows)


def generated_markdown() -> str:
    """The block ``docs/metrics.md`` must contain verbatim (markers included)."""
    parts = (BEGIN, "### Metrics", metrics_table(), "### Monitor events", events_table(),
             "### Histogram buckets", buckets_table(), "### Cardinality limits", limits_table(), END)
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    print(generated_markdown(), end="")
