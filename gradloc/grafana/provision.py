"""Write gradloc's dashboards, a Grafana datasource and dashboard provider, and the Prometheus rules
into a directory a stock Grafana container can mount (``gradloc-agent grafana provision DIR``)::

    DIR/dashboards/gradloc-*.json                      the five dashboards
    DIR/provisioning/datasources/gradloc.yaml         apiVersion 1: a Prometheus datasource
    DIR/provisioning/dashboards/gradloc.yaml          apiVersion 1: a file provider for DIR/dashboards
    DIR/prometheus/gradloc-rules.yml                  alerting and recording rules (rule_files: [...])

    docker run -v $DIR/provisioning:/etc/grafana/provisioning \\
               -v $DIR/dashboards:/var/lib/grafana/dashboards/gradloc grafana/grafana
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from gradloc.grafana.dashboards import DASHBOARDS
from gradloc.grafana.panels import AGENT_URL

DATASOURCE_UID = "gradloc-prometheus"
DASHBOARDS_MOUNT = "/var/lib/grafana/dashboards/gradloc"


def rules_text() -> str:
    return resources.files("gradloc.grafana").joinpath("rules.yml").read_text(encoding="utf-8")


def dashboard_json(name: str, agent_url: str = AGENT_URL, datasource_uid: str | None = None) -> dict[str, Any]:
    """One dashboard (``name`` in DASHBOARDS), its agent URL and datasource set as the variables' defaults."""
    if name not in DASHBOARDS:
        raise KeyError(f"no dashboard {name!r}; there are {', '.join(DASHBOARDS)}")
    dash = DASHBOARDS[name]()
    for var in dash["templating"]["list"]:
        if var["name"] == "agent_url":
            var["query"] = agent_url
            var["current"] = {"text": agent_url, "value": agent_url}
        elif var["name"] == "datasource" and datasource_uid:
            var["current"] = {"text": "gradloc Prometheus", "value": datasource_uid}
    return dash


def provision(out: Path, prometheus_url: str = "http://localhost:9090", agent_url: str = AGENT_URL) -> list[Path]:
    """Write everything under ``out``; returns the files written."""
    written = []

    def put(rel: str, text: str) -> None:
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)

    for name in DASHBOARDS:
        dash = dashboard_json(name, agent_url, DATASOURCE_UID)
        put(f"dashboards/{dash['uid']}.json", json.dumps(dash, indent=2, ensure_ascii=False) + "\n")
    put("provisioning/datasources/gradloc.yaml",
        "apiVersion: 1\ndatasources:\n"
        f"  - name: gradloc Prometheus\n    uid: {DATASOURCE_UID}\n    type: prometheus\n    access: proxy\n"
        f"    url: {json.dumps(prometheus_url)}\n    isDefault: false\n    editable: true\n"
        # an exemplar (a dot on a panel; the incident counter and norm histogram carry them) links to its incident
        "    jsonData:\n      exemplarTraceIdDestinations:\n        - name: trace_id\n"
        f"          url: {json.dumps(agent_url.rstrip('/') + '/incidents/trace/${__value.raw}')}\n"
        "          urlDisplayLabel: gradloc incident page\n")
    put("provisioning/dashboards/gradloc.yaml",
        "apiVersion: 1\nproviders:\n"
        "  - name: gradloc\n    folder: gradloc\n    type: file\n    disableDeletion: false\n"
        f"    allowUiUpdates: true\n    options:\n      path: {DASHBOARDS_MOUNT}\n")
    put("prometheus/gradloc-rules.yml", rules_text())
    return written
