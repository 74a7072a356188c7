"""``gradloc-agent incidents list|show|export``: read the incident store from a terminal or a script.

Only reads: the daemon owns writing. A missing database, an unknown or ambiguous id and an unreadable
store end with exit code 1 and one line on stderr, never a traceback. The store (and numpy, through
the records) is imported when a command runs, so ``gradloc-agent --help`` and ``demo`` do not pay for
it; nothing here imports torch.
"""
from __future__ import annotations

import contextlib
import math
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gradloc.agent.escape import json_text
from gradloc.agent.source import AgentUnreachable, Source, quoted, resolve

if TYPE_CHECKING:
    from gradloc.store import IncidentStore

_API_MAX = 10_000  # rows one /api/incidents answer holds at most (gradloc/agent/http.py)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DB_HELP = ("Incident store: a SQLite file, or a postgresql://user@host:port/db URL "
            "[default: $GRADLOC_DB, else ${XDG_STATE_HOME:-~/.local/state}/gradloc/incidents.db].")


def parse_since(text: str, now: float) -> float:
    """``30m``/``2h``/``1d``/``1w``/``45s`` before ``now``, or an absolute unix time."""
    value = text.strip().lower()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw])", value)
    if match:
        return now - float(match[1]) * _UNITS[match[2]]
    try:
        unix = float(value)
    except ValueError:
        unix = math.nan
    if not math.isfinite(unix) or unix < 0:
        raise ValueError(f"expected a duration like 30m, 2h, 1d, 1w or a unix time, got {text!r}")
    return unix


def _since(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_since(value, time.time())
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc


def _store_target(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | str | None:
    from gradloc.store.backends import as_target

    return None if value is None else as_target(value)  # a URL stays a string: a Path would fold its "//"


def _db_option(fn):
    return click.option("--db", "--store", "db", envvar="GRADLOC_DB", default=None, metavar="PATH|URL",
                        callback=_store_target, help=_DB_HELP)(fn)


def _json_option(fn):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(fn)


def _since_option(fn):
    return click.option("--since", callback=_since, metavar="WHEN",
                        help="Only incidents from this time on: 30m, 2h, 1d, 1w ago, or a unix time.")(fn)


def _agent_option(fn):
    return click.option("--agent", default=None, metavar="HOST:PORT",
                        help="Read this daemon's HTTP API (its `--http` address; http(s)://HOST:PORT too) instead of "
                             "a store. Without --db/--agent: the daemon the agent config names ($GRADLOC_AGENT_CONFIG, "
                             "GRADLOC_AGENT_HTTP), else its store; stderr says which (docs/agent.md).")(fn)


def _source(db: Path | str | None, agent: str | None) -> Source:
    """Where to read (gradloc/agent/source.py), said on stderr when no flag named it; errors exit 1."""
    ctx = click.get_current_context()
    from_env = db is not None and ctx.get_parameter_source("db") is click.core.ParameterSource.ENVIRONMENT
    try:
        source = resolve(db, from_env, agent)
    except AgentUnreachable as exc:
        raise click.ClickException(str(exc)) from exc
    except ValueError as exc:
        raise click.UsageError(str(exc), ctx=ctx) from exc
    if source.said:
        click.echo(source.said, err=True)
    return source


def _api(source: Source, path: str, params: dict | None = None):
    """The daemon's answer as JSON; no answer, no token, a bad query: one line, exit 1."""
    try:
        return source.fetch_json(path, params)
    except (AgentUnreachable, LookupError, ValueError) as exc:
        raise click.ClickException(str(exc).strip("'\"")) from exc


def _row(data: dict):
    """An ``/api/incidents`` row as the store's IncidentRow (the JSON spells non-finite floats as strings)."""
    from gradloc.store.rows import IncidentRow

    share = data.get("explained_share")
    return IncidentRow(data["incident_id"], data["trace_id"], data["job"], int(data["step"]), float(data["time_unix"]),
                       data["status"], tuple(data["kinds"]), float(data["global_norm"]),
                       tuple(data["ranks_missing"]), None if share is None else float(share), int(data["probes"]))


@contextlib.contextmanager
def _opened(db: Path | str | None) -> Iterator[IncidentStore]:
    """The store, opened without creating it; store failures become one-line click errors (exit 1) that
    name it without its password."""
    from gradloc.store import IncidentStore, StoreError, default_db_path
    from gradloc.store.backends import database_errors, is_url

    path = db or default_db_path()
    try:
        store = IncidentStore(path, create=False)
    except (StoreError, *database_errors()) as exc:
        hint = "" if is_url(path) or Path(path).exists() else \
            " (the agent creates it; pass --db PATH or set GRADLOC_DB)"
        raise click.ClickException(f"{exc}{hint}") from exc
    try:
        yield store
    except (StoreError, ValueError, *database_errors()) as exc:
        raise click.ClickException(f"{store.path}: {exc}") from exc
    finally:
        store.close()


@click.group()
def incidents() -> None:
    """Browse the correlated incidents the agent stored (docs/incident-store.md)."""


@incidents.command("list")
@_db_option
@_agent_option
@_json_option
@click.option("--job", default=None, help="Only this job.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1, max=10_000), help="At most this many.")
@_since_option
def list_cmd(db: Path | str | None, agent: str | None, as_json: bool, job: str | None, limit: int,
             since: float | None) -> None:
    """The newest incidents first, one line each."""
    from gradloc.agent.render_correlated import incident_table
    from gradloc.records import to_dict

    source = _source(db, agent)
    if source.agent is not None:
        rows = [_row(r) for r in _api(source, "/api/incidents", {"job": job, "limit": limit, "since": since})]
    else:
        with _opened(source.store) as store:
            rows = store.list_incidents(job=job, limit=limit, since_unix=since)
    if as_json:
        click.echo(json_text([to_dict(r) for r in rows]))
    elif rows:
        click.echo(incident_table(rows))
    else:
        click.echo("no incidents" + (f" for job {job!r}" if job else "") + (" in that time" if since else ""))


@incidents.command("show")
@click.argument("incident_id")
@_db_option
@_agent_option
@_json_option
@click.option("--color/--no-color", default=None, help="Highlight culprit tokens [default: when stdout is a terminal].")
@click.option("--html", "html_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the incident page (one self-contained HTML file) here.")
def show_cmd(incident_id: str, db: Path | str | None, agent: str | None, as_json: bool, color: bool | None,
             html_file: Path | None) -> None:
    """One incident by its id or one of its rank findings' ids (what the training process printed),
    full or a unique prefix: ranks, shares, culprit spans, each rank's finding."""
    from gradloc.agent.render_correlated import correlated_text
    from gradloc.store import correlated_to_dict

    source = _source(db, agent)
    inc, ctx, page = _show_from_agent(source, incident_id, html_file) if source.agent is not None else \
        _show_from_store(source, incident_id, html_file)
    if not inc.incident_id.startswith(incident_id.strip()):
        click.echo(f"{incident_id.strip()} names a rank finding of incident {inc.incident_id}", err=True)
    if source.agent is not None:
        link = source.page_link(inc.incident_id)
    elif source.said:  # no flag named the store: the daemon the config names did not answer, no link would open
        link = None
    else:  # --db: the page on the daemon the agent config names; signed (no token needed) when one is set
        from gradloc.agent.config import cli_page_link

        link = cli_page_link(inc.incident_id)
    click.echo(f"page: {link}" if link else "page: none (no gradloc agent serves this store here; --html FILE "
                                            "writes the page)", err=True)
    if html_file is not None:
        html_file.write_text(page, encoding="utf-8")
        click.echo(f"wrote {html_file}", err=True)
    if as_json:
        click.echo(json_text(correlated_to_dict(inc)))
        return
    color = sys.stdout.isatty() if color is None else color
    click.echo(correlated_text(inc, color=color, context=ctx), color=color)


def _show_from_store(source: Source, incident_id: str, html_file: Path | None):
    """(incident, what the store knows around it (agent/store_context.py), its page HTML or "")."""
    from gradloc.agent.store_context import store_context

    with _opened(source.store) as store:
        inc = store.get_incident(incident_id)
        if inc is None:
            raise click.ClickException(f"no incident {incident_id.strip()!r} in {store.path}")
        ctx = store_context(store, inc, steps=html_file is not None)  # the chart's follow-up steps for --html only
    if html_file is None:
        return inc, ctx, ""
    from gradloc.agent.incident_page import incident_html

    return inc, ctx, incident_html(inc, ctx)


def _show_from_agent(source: Source, incident_id: str, html_file: Path | None):
    """The same through the daemon's API; the page is the daemon's own (its chart reads its store)."""
    from gradloc.store.incident_json import correlated_from_dict

    key = quoted(incident_id)
    if not key:
        raise click.UsageError("an incident id (or a prefix of one) is required")
    try:
        inc = correlated_from_dict(source.fetch_json(f"/api/incidents/{key}"))
    except LookupError as exc:
        raise click.ClickException(f"no incident {incident_id.strip()!r} at the agent {source.agent}") from exc
    except (AgentUnreachable, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    except (TypeError, KeyError) as exc:
        raise click.ClickException(f"the agent at {source.agent} sent an incident this CLI cannot read: {exc}") from exc
    page = ""
    if html_file is not None:
        try:
            page = source.fetch(f"/incidents/{quoted(inc.incident_id)}").decode("utf-8")
        except (AgentUnreachable, LookupError, ValueError) as exc:
            raise click.ClickException(str(exc).strip("'\"")) from exc
    return inc, None, page  # the daemon's page has its store's context; the text goes without


@incidents.command("export")
@_db_option
@_agent_option
@click.option("--json", "as_json", is_flag=True, help="Accepted for symmetry: export always writes JSON Lines.")
@click.option("--job", default=None, help="Only this job.")
@_since_option
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write to this file instead of stdout.")
def export_cmd(db: Path | str | None, agent: str | None, as_json: bool, job: str | None, since: float | None,
               output: Path | None) -> None:
    """Every matching incident, oldest first, as JSON Lines (one correlated incident per line)."""
    from gradloc.store import correlated_to_dict

    source = _source(db, agent)
    if source.agent is not None:
        rows = _api(source, "/api/incidents", {"job": job, "since": since, "limit": _API_MAX})
        if len(rows) == _API_MAX:
            click.echo(f"the agent lists at most {_API_MAX} incidents: exported the newest {_API_MAX}; "
                       "--since or --db for the rest", err=True)
        with _sink(output) as out:
            for row in reversed(rows):  # the API lists newest first
                out.write(json_text(_api(source, f"/api/incidents/{quoted(row['incident_id'])}")) + "\n")
        count = len(rows)
    else:
        with _opened(source.store) as store, _sink(output) as out:
            count = 0
            for inc in store.iter_incidents(job=job, since_unix=since):
                out.write(json_text(correlated_to_dict(inc), allow_nan=False) + "\n")
                count += 1
    if output is not None:
        click.echo(f"exported {count} incident(s) to {output}", err=True)


@contextlib.contextmanager
def _sink(output: Path | None):
    if output is None:
        yield sys.stdout
        return
    try:
        fh = open(output, "w", encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror}") from exc
    with fh:
        yield fh
