"""``gradloc-agent patterns``: which kinds of data spike — culprits and outliers per source, tag, length, position,
token class and RL class, per million tokens each group contributed (gradloc/agent/patterns.py). Reads only."""
from __future__ import annotations

import time
from pathlib import Path

import click

from gradloc.agent.escape import json_text, visible
from gradloc.agent.incidents_cli import (
    _agent_option,
    _api,
    _db_option,
    _json_option,
    _opened,
    _since,
    _since_option,
    _source,
)
from gradloc.agent.patterns import KINDS, PatternRow, Patterns, from_dict


@click.command("patterns")
@_db_option
@_agent_option
@_json_option
@click.option("--job", default=None, help="Only this job (default: every job in the store).")
@_since_option
@click.option("--until", callback=_since, metavar="WHEN", help="Only before this time (same forms as --since).")
@click.option("--kind", "kinds", type=click.Choice(KINDS), multiple=True, help="Only these group kinds.")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=1, max=1000),
              help="At most this many groups per kind (text output).")
def patterns(db: Path | None, agent: str | None, as_json: bool, job: str | None, since: float | None,
             until: float | None, kinds: tuple[str, ...], top: int) -> None:
    """Culprits and outliers per data group, normalised by the tokens each group contributed; highest rate first."""
    from gradloc.agent.patterns import from_store
    from gradloc.records import to_dict

    source = _source(db, agent)
    if source.agent is not None:
        data = _api(source, "/api/patterns", {"job": job, "since": since, "until": until})
        result = from_dict(data)
    else:
        with _opened(source.store) as store:
            result = from_store(store, job=job, since_unix=since, until_unix=until)
        data = to_dict(result)
    if kinds:
        data["rows"] = [r for r in data["rows"] if r["kind"] in kinds]
    if as_json:
        click.echo(json_text(data))
        return
    click.echo(_header(result))
    for kind in kinds or KINDS:
        rows = result.of(kind)
        if rows:
            click.echo(f"\nby {kind.replace('_', ' ')}:")
            for row in rows[:top]:
                click.echo("  " + row_text(row))
            if len(rows) > top:
                click.echo(f"  … {len(rows) - top} more (--top)")


def _header(p: Patterns) -> str:
    window = ""
    if p.since_unix is not None or p.until_unix is not None:
        fmt = lambda t: time.strftime("%Y-%m-%d %H:%M", time.gmtime(t))  # noqa: E731
        window = f" · {fmt(p.since_unix) if p.since_unix else '…'} to {fmt(p.until_unix) if p.until_unix else 'now'} UTC"
    return (f"{'job ' + visible(p.job) if p.job else 'every job'}{window}: {p.incidents} incidents "
            f"({p.culprits} culprit spans), {p.outliers} outliers")


def row_text(r: PatternRow) -> str:
    """One group on one line: its name, flags, tokens, rate."""
    flags = f"{r.culprits} culprit{'s' if r.culprits != 1 else ''} in {r.incidents} incident" \
            f"{'s' if r.incidents != 1 else ''}, {r.outliers} outlier{'s' if r.outliers != 1 else ''}"
    if r.per_million is None and r.token_share is None:
        return f"{visible(r.name):<28} {flags} · {r.flag_share:.0%} of flags"
    rate = f"{r.per_million:,.1f} per M tokens" if r.per_million is not None else "no tokens counted"
    return (f"{visible(r.name):<28} {rate:>22} · {flags} · {r.flag_share:.0%} of flags from "
            f"{(r.token_share or 0.0):.0%} of tokens ({r.tokens:,} tokens, {r.samples:,} samples)")
