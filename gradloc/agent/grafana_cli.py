"""``gradloc-agent grafana provision DIR`` and ``gradloc-agent grafana export NAME`` (click stays here)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from gradloc.grafana.dashboards import DASHBOARDS
from gradloc.grafana.panels import AGENT_URL


@click.group()
def grafana() -> None:
    """gradloc's Grafana dashboards and Prometheus rules."""


@grafana.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--prometheus-url", default="http://localhost:9090", show_default=True,
              help="The datasource's URL, as Grafana reaches Prometheus.")
@click.option("--agent-url", default=AGENT_URL, show_default=True,
              help="The agent's HTTP address, as a browser reaches it (incident links).")
def provision(directory: Path, prometheus_url: str, agent_url: str) -> None:
    """Write the dashboards, Grafana provisioning YAML (apiVersion 1) and the rules file into DIRECTORY."""
    from gradloc.grafana.provision import provision as write

    for path in write(directory, prometheus_url, agent_url):
        click.echo(str(path))


@grafana.command()
@click.argument("name", type=click.Choice(sorted(DASHBOARDS)))
@click.option("--agent-url", default=AGENT_URL, show_default=True)
def export(name: str, agent_url: str) -> None:
    """Print one dashboard's JSON (for Grafana's import dialog or the HTTP API)."""
    from gradloc.grafana.provision import dashboard_json

    click.echo(json.dumps(dashboard_json(name, agent_url), indent=2, ensure_ascii=False))
