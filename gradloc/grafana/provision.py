"""Write gradloc's dashboards, a Grafana datasource and dashboard provider, and the Prometheus rules
into a directory a stock Grafana container can mount (``gradloc-agent grafana provision DIR``)::

    DIR/dashboards/gradloc-*.json                      the five dashboards
    DIR/provisioning/datasources/gradloc.yaml         apiVersion 1: a Prometheus datasource
    DIR/provisioning/dashboards/gradloc.yaml          apiVersion 1: a file provider for DIR/dashboards
    DIR/prometheus/gradloc-rules.yml                  alerting and recording rules (rule_files: [...])

    docker run -v $DIR/provisioning:/etc/grafana/provisioning \\
               -v $DIR/dashboards:/var/lib/grafana/dashboards/gradloc grafana/grafana

Incident links, one daemon per node: an exemplar (a dot on a panel) links to
``<scheme>://${__data.fields["instance"]}/incidents/trace/<trace id>``, followed by
``?sig=${__data.fields["sig"]}`` when the daemons have an auth token (``signed``).
Grafana fills it in at click time from the exemplar's frame, one field per label: ``instance`` is the
scrape target Prometheus read the exemplar from (the daemon that holds the incident, whose HTTP server
serves the page), ``sig`` the signed-link signature that daemon put next to ``trace_id`` (present when
Prometheus scrapes with the token; gradloc/agent/links.py) so the page opens without the token. A
second link goes through ``--agent-url`` (one daemon, or a proxy). ``<scheme>`` is ``--agent-url``'s
(https when the daemons serve TLS); the dashboards' ``agent_scheme`` variable defaults to it.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gradloc.grafana.dashboards import DASHBOARDS
from gradloc.grafana.panels import AGENT_URL, SCHEMES

DATASOURCE_UID = "gradloc-prometheus"
DASHBOARDS_MOUNT = "/var/lib/grafana/dashboards/gradloc"


def rules_text() -> str:
    return resources.files("gradloc.grafana").joinpath("rules.yml").read_text(encoding="utf-8")


def agent_scheme(agent_url: str) -> str:
    """http or https: how a browser reaches the daemons (``agent_url``'s scheme; http when it has none)."""
    scheme = urlsplit(agent_url).scheme.lower()
    return scheme if scheme in SCHEMES else SCHEMES[0]


def exemplar_links(agent_url: str = AGENT_URL, signed: bool = False) -> list[dict[str, str]]:
    """The datasource's exemplar links (``exemplarTraceIdDestinations``): the daemon that holds the
    incident (the exemplar's ``instance``), then ``agent_url``. ``signed`` (the daemons have an auth
    token): both carry the exemplar's ``sig``; without a token there is no ``sig`` label, and a link
    template cannot drop its ``?sig=`` at click time, so the unsigned links have none."""
    page = '/incidents/trace/${__value.raw}' + ('?sig=${__data.fields["sig"]}' if signed else "")
    per_node = agent_scheme(agent_url) + '://${__data.fields["instance"]}' + page
    return [{"name": "trace_id", "url": per_node, "urlDisplayLabel": "gradloc incident page (its daemon)"},
            {"name": "trace_id", "url": agent_url.rstrip("/") + page, "urlDisplayLabel": "gradloc incident page (agent URL)"}]


def _literal(value: str) -> str:
    """``value`` as a provisioning file must spell it: Grafana expands ``$VAR`` and ``${VAR}`` there from its
    environment (``${__value.raw}`` would become ""), and ``$$`` is a literal ``$``."""
    return value.replace("$", "$$")


def dashboard_json(name: str, agent_url: str = AGENT_URL, datasource_uid: str | None = None) -> dict[str, Any]:
    """One dashboard (``name`` in DASHBOARDS), its agent URL (and scheme) and datasource set as the variables'
    defaults."""
    if name not in DASHBOARDS:
        raise KeyError(f"no dashboard {name!r}; there are {', '.join(DASHBOARDS)}")
    dash = DASHBOARDS[name]()
    scheme = agent_scheme(agent_url)
    for var in dash["templating"]["list"]:
        if var["name"] == "agent_url":
            var["query"] = agent_url
            var["current"] = {"text": agent_url, "value": agent_url}
        elif var["name"] == "agent_scheme":
            var["current"] = {"text": scheme, "value": scheme}
            var["options"] = [{**o, "selected": o["value"] == scheme} for o in var["options"]]
        elif var["name"] == "datasource" and datasource_uid:
            var["current"] = {"text": "gradloc Prometheus", "value": datasource_uid}
    return dash


def provision(out: Path, prometheus_url: str = "http://localhost:9090", agent_url: str = AGENT_URL,
              signed: bool = False) -> list[Path]:
    """Write everything under ``out``; returns the files written. ``signed``: the daemons have an auth token,
    so exemplar links carry the ``sig`` they mint (:func:`exemplar_links`)."""
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
        "    jsonData:\n      exemplarTraceIdDestinations:\n"
        + "".join(f"        - name: {d['name']}\n          url: {json.dumps(_literal(d['url']))}\n"
                  f"          urlDisplayLabel: {json.dumps(d['urlDisplayLabel'])}\n" for d in exemplar_links(agent_url, signed)))
    put("provisioning/dashboards/gradloc.yaml",
        "apiVersion: 1\nproviders:\n"
        "  - name: gradloc\n    folder: gradloc\n    type: file\n    disableDeletion: false\n"
        f"    allowUiUpdates: true\n    options:\n      path: {DASHBOARDS_MOUNT}\n")
    put("prometheus/gradloc-rules.yml", rules_text())
    return written
