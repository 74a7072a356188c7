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
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gradloc.agent.escape import json_text

if TYPE_CHECKING:
    from gradloc.store import IncidentStore

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DB_HELP = "Incident database [default: $GRADLOC_DB, else ${XDG_STATE_HOME:-~/.local/state}/gradloc/incidents.db]."


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


def _db_option(fn):
    return click.option("--db", type=click.Path(dir_okay=False, path_type=Path), envvar="GRADLOC_DB",
                        default=None, help=_DB_HELP)(fn)


def _json_option(fn):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(fn)


def _since_option(fn):
    return click.option("--since", callback=_since, metavar="WHEN",
                        help="Only incidents from this time on: 30m, 2h, 1d, 1w ago, or a unix time.")(fn)


@contextlib.contextmanager
def _opened(db: Path | None) -> Iterator[IncidentStore]:
    """The store, opened without creating it; store failures become one-line click errors (exit 1)."""
    from gradloc.store import IncidentStore, StoreError, default_db_path

    path = db or default_db_path()
    try:
        store = IncidentStore(path, create=False)
    except (StoreError, sqlite3.Error) as exc:
        hint = "" if Path(path).exists() else " (the agent creates it; pass --db PATH or set GRADLOC_DB)"
        raise click.ClickException(f"{exc}{hint}") from exc
    try:
        yield store
    except (StoreError, sqlite3.Error, ValueError) as exc:
        raise click.ClickException(f"{path}: {exc}") from exc
    finally:
        store.close()


@click.group()
def incidents() -> None:
    """Browse the correlated incidents the agent stored (docs/incident-store.md)."""


@incidents.command("list")
@_db_option
@_json_option
@click.option("--job", default=None, help="Only this job.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1), help="At most this many.")
@_since_option
def list_cmd(db: Path | None, as_json: bool, job: str | None, limit: int, since: float | None) -> None:
    """The newest incidents first, one line each."""
    from gradloc.agent.render_correlated import incident_table
    from gradloc.records import to_dict

    with _opened(db) as store:
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
@_json_option
@click.option("--color/--no-color", default=None, help="Highlight culprit tokens [default: when stdout is a terminal].")
@click.option("--html", "html_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the incident page (one self-contained HTML file) here.")
def show_cmd(incident_id: str, db: Path | None, as_json: bool, color: bool | None, html_file: Path | None) -> None:
    """One incident by its id or one of its rank findings' ids (what the training process printed),
    full or a unique prefix: ranks, shares, culprit spans, each rank's finding."""
    from gradloc.agent.page_chart import episode_opener, page_steps
    from gradloc.agent.render_correlated import correlated_text
    from gradloc.store import correlated_to_dict

    with _opened(db) as store:
        inc = store.get_incident(incident_id)
        if inc is None:
            raise click.ClickException(f"no incident {incident_id.strip()!r} in {store.path}")
        steps = page_steps(store, inc) if html_file is not None else []  # the follow-up steps the chart draws
        opener = episode_opener(store, inc)  # a new-cause incident: the one whose episode it follows
    if not inc.incident_id.startswith(incident_id.strip()):
        click.echo(f"{incident_id.strip()} names a rank finding of incident {inc.incident_id}", err=True)
    from gradloc.agent.links import cli_page_link  # this node's daemon; signed (no token needed) when one is set

    if (link := cli_page_link(inc.incident_id)) is not None:
        click.echo(f"page: {link}", err=True)
    if html_file is not None:
        from gradloc.agent.incident_page import incident_html

        html_file.write_text(incident_html(inc, steps=steps, opener_id=opener), encoding="utf-8")
        click.echo(f"wrote {html_file}", err=True)
    if as_json:
        click.echo(json_text(correlated_to_dict(inc)))
        return
    color = sys.stdout.isatty() if color is None else color
    click.echo(correlated_text(inc, color=color, opener_id=opener), color=color)


@incidents.command("export")
@_db_option
@click.option("--json", "as_json", is_flag=True, help="Accepted for symmetry: export always writes JSON Lines.")
@click.option("--job", default=None, help="Only this job.")
@_since_option
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write to this file instead of stdout.")
def export_cmd(db: Path | None, as_json: bool, job: str | None, since: float | None, output: Path | None) -> None:
    """Every matching incident, oldest first, as JSON Lines (one correlated incident per line)."""
    from gradloc.store import correlated_to_dict

    with _opened(db) as store, _sink(output) as out:
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
