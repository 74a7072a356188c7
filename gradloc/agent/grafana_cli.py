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
@click.option("--signed-links/--no-signed-links", default=None,
              help="Exemplar links carry the daemon's signature (?sig=), which opens an incident page without the "
                   "token: for daemons with an auth token. [default: when the agent config this command sees "
                   "($GRADLOC_AGENT_CONFIG, GRADLOC_AGENT_AUTH_TOKEN) holds a token]")
def provision(directory: Path, prometheus_url: str, agent_url: str, signed_links: bool | None) -> None:
    """Write the dashboards, Grafana provisioning YAML (apiVersion 1) and the rules file into DIRECTORY."""
    from gradloc.grafana.provision import provision as write

    if signed_links is None:
        signed_links = _config_has_token()
    for path in write(directory, prometheus_url, agent_url, signed=signed_links):
        click.echo(str(path))
    click.echo(f"exemplar links {'carry' if signed_links else 'do not carry'} ?sig= "
               f"({'--signed-links: daemons with a token' if signed_links else 'daemons without a token'})", err=True)


def _config_has_token() -> bool:
    """Whether the agent config (the daemon's environment and config file, as seen here) holds a token."""
    from gradloc.agent.config import load_config
    from gradloc.errors import ConfigError

    try:
        return load_config().token is not None
    except ConfigError as exc:
        raise click.UsageError(f"the agent config: {exc} (or pass --signed-links/--no-signed-links)") from exc


@grafana.command()
@click.argument("name", type=click.Choice(sorted(DASHBOARDS)))
@click.option("--agent-url", default=AGENT_URL, show_default=True)
def export(name: str, agent_url: str) -> None:
    """Print one dashboard's JSON (for Grafana's import dialog or the HTTP API)."""
    from gradloc.grafana.provision import dashboard_json

    click.echo(json.dumps(dashboard_json(name, agent_url), indent=2, ensure_ascii=False))
