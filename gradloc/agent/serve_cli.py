"""``gradloc-agent serve``: flags → :class:`AgentConfig` (merged with the config file and the
environment) → :class:`Daemon`. Only this module knows about click."""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import click

from gradloc.agent.config import AgentConfig, load_config
from gradloc.errors import ConfigError

_D = AgentConfig()


@click.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="TOML config file (keys as the flags, underscores; optional [agent] table). "
                   "Also $GRADLOC_AGENT_CONFIG.")
@click.option("--ingest", default=None, metavar="HOST:PORT", help=f"gRPC ingest address [{_D.ingest}].")
@click.option("--http", default=None, metavar="HOST:PORT", help=f"/metrics and /api address [{_D.http}].")
@click.option("--store", "--db", "db", default=None, metavar="PATH|URL",
              help="Incident store: a SQLite file, or postgresql://user@host:port/db (many daemons may share one "
                   "database; docs/incident-store.md); 'none' disables it "
                   "[$GRADLOC_DB or ~/.local/state/gradloc/incidents.db].")
@click.option("--otlp-endpoint", default=None, metavar="HOST:PORT",
              help="Forward metrics and incident traces over OTLP/gRPC to this collector.")
@click.option("--otlp-interval-s", type=float, default=None, help=f"OTLP metric export interval [{_D.otlp_interval_s}].")
@click.option("--straggler-deadline-s", type=float, default=None,
              help=f"How long an incident waits for the other ranks [{_D.straggler_deadline_s}].")
@click.option("--max-message-bytes", type=int, default=None, help=f"Largest ingest message [{_D.max_message_bytes}].")
@click.option("--queue-size", type=int, default=None, help=f"Ingest batches queued before backpressure [{_D.queue_size}].")
@click.option("--retention-days", type=float, default=None, help=f"Drop incidents older than this [{_D.retention_days}].")
@click.option("--retention-incidents", type=int, default=None, help=f"Keep at most this many incidents [{_D.retention_incidents}].")
@click.option("--retention-step-rows", type=int, default=None,
              help=f"Keep at most this many step summaries per job [{_D.retention_step_rows}].")
@click.option("--max-incidents-per-minute", type=int, default=None,
              help=f"Per job; more are dropped and counted [{_D.max_incidents_per_minute}].")
@click.option("--max-culprits", type=int, default=None, help=f"Per incident; more are cut and counted [{_D.max_culprits}].")
@click.option("--max-layers", type=int, default=None, help=f"Layer series per rank [{_D.max_layers}].")
@click.option("--max-series", type=int, default=None, help=f"(job, rank) pairs with live series [{_D.max_series}].")
@click.option("--sources", default=None, metavar="A,B,…",
              help="Data sources that always get their own source label on the per-source series.")
@click.option("--max-sources", type=int, default=None,
              help=f"Other sources labelled by name, first seen first; later ones are 'other' [{_D.max_sources}].")
@click.option("--auth-token-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Require this bearer token (the file's content) on ingest and HTTP. Or $GRADLOC_AGENT_AUTH_TOKEN.")
@click.option("--insecure", is_flag=True, default=None,
              help="Allow binding beyond loopback without a token (a trusted network only).")
@click.option("--metrics-open", is_flag=True, default=None, help="Serve /metrics without the token (for Prometheus).")
@click.option("--tls-cert", type=click.Path(dir_okay=False, exists=True), default=None,
              help="PEM certificate: TLS for gRPC ingest and HTTP (with --tls-key).")
@click.option("--tls-key", type=click.Path(dir_okay=False, exists=True), default=None, help="PEM private key of --tls-cert.")
@click.option("--link-ttl-s", type=float, default=None,
              help=f"How long a signed incident-page link (no token needed) stays valid [{_D.link_ttl_s:g}; max 30 days].")
@click.option("--job-retention-s", type=float, default=None,
              help=f"Forget a job's (rank's) series and state after this long without a record [{_D.job_retention_s}].")
@click.option("--quarantine-culprits/--no-quarantine-culprits", default=None,
              help="Quarantine every sample a located incident names (gradloc-agent quarantine list).")
@click.option("--quarantine-outlier-z", type=float, default=None,
              help="Also quarantine every surprise outlier at or above this z [0: none].")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None)
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
              help="Once serving, write {\"ingest\": \"host:port\", \"http\": \"host:port\"} here "
                   "(useful with port 0).")
def serve(config_file: str | None, ready_file: str | None, **flags: Any) -> None:
    """Run the agent daemon: gRPC ingest, /metrics, /api/incidents, store, OTLP forwarding.

    Settings come from defaults < --config file < GRADLOC_AGENT_* environment < flags.
    """
    from gradloc.agent.daemon import Daemon

    given = {k: v for k, v in flags.items() if v is not None}
    try:
        cfg = load_config(config_file, os.environ, given)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        daemon = Daemon(cfg).start()
    except (OSError, RuntimeError, ConfigError) as exc:
        raise click.ClickException(f"could not start: {exc}") from exc
    addresses = {"ingest": "%s:%d" % daemon.ingest_address, "http": "%s:%d" % daemon.http_address}
    click.echo(f"gradloc-agent serving: ingest {addresses['ingest']} · http://{addresses['http']}/metrics", err=True)
    if ready_file:
        tmp = ready_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(addresses, fh)
        os.replace(tmp, ready_file)
    daemon.serve_until_signal()
