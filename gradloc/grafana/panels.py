"""Building blocks of gradloc's Grafana dashboards (Grafana 10/11 JSON model, schemaVersion 39).

Dashboards are generated from code (gradloc/grafana/dashboards.py) so that every query is checked
by the tests: structure (ids, refIds, grid), metric names against ``metric_specs``, PromQL parsed
by ``promtool`` and executed against a real Prometheus that scraped a real run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
WIDTH = 24  # Grafana's grid is 24 columns wide
AGENT_URL = "http://127.0.0.1:9917"  # where incident links point (the agent's HTTP address); a dashboard variable
SCHEMES = ("http", "https")  # agent_scheme: how a browser reaches each node's daemon (https with --tls-cert)


@dataclass
class Query:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass
class Panel:
    title: str
    queries: list[Query]
    unit: str
    kind: str = "timeseries"  # timeseries | stat | table | heatmap | bargauge
    width: int = 12
    height: int = 8
    description: str = ""
    links: list[dict[str, str]] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    overrides: list[dict[str, Any]] = field(default_factory=list)  # Grafana fieldConfig.overrides


def q(expr: str, legend: str = "", instant: bool = False) -> Query:
    return Query(expr, legend, instant)


def dashed(ref_id: str, color: str) -> dict[str, Any]:
    """An override drawing query ``ref_id``'s series as a dashed line of one ``color``."""
    return {"matcher": {"id": "byFrameRefID", "options": ref_id},
            "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                           {"id": "color", "value": {"mode": "fixed", "fixedColor": color}}]}


def variables() -> list[dict[str, Any]]:
    """datasource, agent_url, agent_scheme, job, rank, layer (rank includes "job": the job-wide layer
    series of DDP/FSDP2/ZeRO). Incident links go to ``${agent_scheme}://<the series' instance>`` (the
    daemon Prometheus scraped the series from: the one holding its incidents) or to ``${agent_url}``."""
    def query_var(name: str, query: str, label: str) -> dict[str, Any]:
        return {"name": name, "label": label, "type": "query", "datasource": DS, "refresh": 2,
                "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
                "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
                "sort": 1}

    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        {"name": "agent_url", "label": "gradloc-agent URL", "type": "textbox", "query": AGENT_URL,
         "current": {"text": AGENT_URL, "value": AGENT_URL}, "hide": 0},
        {"name": "agent_scheme", "label": "gradloc-agent scheme (per-node links)", "type": "custom",
         "query": ",".join(SCHEMES), "options": [{"text": s, "value": s, "selected": s == SCHEMES[0]} for s in SCHEMES],
         "current": {"text": SCHEMES[0], "value": SCHEMES[0]}, "hide": 0},
        query_var("job", "label_values(gradloc_steps_total, job)", "job"),
        query_var("rank", 'label_values(gradloc_step{job=~"$job"}, rank)', "rank"),
        query_var("layer", 'label_values(gradloc_grad_norm{job=~"$job"}, layer)', "layer"),
    ]


def layout(panels: list[Panel]) -> list[dict[str, Any]]:
    """Panels flowed left to right, top to bottom, into non-overlapping grid positions."""
    out, x, y, row_h = [], 0, 0, 0
    for i, p in enumerate(panels, start=1):
        if x + p.width > WIDTH:
            x, y, row_h = 0, y + row_h, 0
        out.append(_panel_json(p, i, {"x": x, "y": y, "w": p.width, "h": p.height}))
        x, row_h = x + p.width, max(row_h, p.height)
    return out


def _panel_json(p: Panel, pid: int, grid: dict[str, int]) -> dict[str, Any]:
    targets = [{"refId": chr(ord("A") + i), "datasource": DS, "expr": t.expr, "legendFormat": t.legend,
                "instant": t.instant, "range": not t.instant, "exemplar": p.kind == "timeseries"}
               for i, t in enumerate(p.queries)]
    panel: dict[str, Any] = {"id": pid, "type": p.kind, "title": p.title, "description": p.description,
                             "datasource": DS, "gridPos": grid, "targets": targets,
                             "fieldConfig": {"defaults": {"unit": p.unit, "links": p.links}, "overrides": p.overrides},
                             "options": p.options}
    if p.kind == "heatmap":
        panel["options"] = {"calculate": False, "yAxis": {"unit": "none"}, "cellGap": 1,
                            "color": {"scheme": "Oranges", "mode": "scheme"}, **p.options}
    return panel


def dashboard(uid: str, title: str, panels: list[Panel], description: str,
              annotations: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["gradloc"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "timezone": "", "graphTooltip": 1,
        "templating": {"list": variables()},
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "name": "Annotations & Alerts", "type": "dashboard"},
                                 *(annotations or [])]},
        "links": [{"title": "gradloc dashboards", "type": "dashboards", "tags": ["gradloc"], "asDropdown": True}],
        "panels": layout(panels),
    }
