"""``gradloc-agent quarantine add|remove|list|export|import``: the samples and sources kept out of the next run, edited by
hand in the store (``--db``, or ``$GRADLOC_DB``, or the default store) and exported for the loader-side helpers
(gradloc/integrations/quarantine.py). Nothing here imports torch."""
from __future__ import annotations

import time
from pathlib import Path

import click

from gradloc.agent.escape import json_text, visible
from gradloc.agent.incidents_cli import _db_option, _json_option, _opened

_KIND = click.Choice(["sample", "origin", "source"])


@click.group("quarantine")
def quarantine() -> None:
    """Samples (by id or origin) and whole sources kept out of the next run."""


@quarantine.command("add")
@_db_option
@click.argument("kind", type=_KIND)
@click.argument("value")
@click.option("--reason", default="by hand", show_default=True, help="Why (kept with the entry).")
def add(db: Path | str | None, kind: str, value: str, reason: str) -> None:
    """Quarantine one sample id, origin ("file:row") or source."""
    from gradloc.records import QuarantineEntry

    try:
        entry = QuarantineEntry(kind=kind, value=value, reason=reason, added_unix=time.time())
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    with _opened(db) as store:
        new = store.quarantine.add([entry])
    click.echo(f"{'quarantined' if new else 'already quarantined'}: {kind} {visible(value)}")


@quarantine.command("remove")
@_db_option
@click.argument("kind", type=_KIND)
@click.argument("value")
def remove(db: Path | str | None, kind: str, value: str) -> None:
    """Let one sample id, origin or source back in."""
    with _opened(db) as store:
        if not store.quarantine.remove(kind, value):
            raise click.ClickException(f"not quarantined: {kind} {visible(value)}")
    click.echo(f"removed from the quarantine: {kind} {visible(value)}")


@quarantine.command("list")
@_db_option
@_json_option
@click.option("--kind", type=_KIND, default=None, help="Only this kind.")
@click.option("--job", default=None, help="Only what this job's incidents or outliers put there.")
def list_(db: Path | str | None, as_json: bool, kind: str | None, job: str | None) -> None:
    """What is quarantined, oldest first."""
    from gradloc.records import to_dict

    with _opened(db) as store:
        entries = store.quarantine.list(kind=kind, job=job)
    if as_json:
        click.echo(json_text([to_dict(e) for e in entries]))
        return
    if not entries:
        click.echo("nothing is quarantined")
    for e in entries:
        where = f" · job {e.job} step {e.step}" if e.job is not None else ""
        click.echo(f"{e.kind} {visible(e.value)} · {visible(e.reason)}{where}")


@quarantine.command("export")
@_db_option
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
def export(db: Path | str | None, out: Path) -> None:
    """Write the list as JSON lines, for QuarantineList.load in the training job."""
    from gradloc.records.quarantine import entries_jsonl

    with _opened(db) as store:
        entries = store.quarantine.list()
    out.write_text(entries_jsonl(entries), encoding="utf-8")
    click.echo(f"{_entries(len(entries))} written to {out}")


@quarantine.command("import")
@_db_option
@click.argument("src", type=click.Path(dir_okay=False, exists=True, path_type=Path))
def import_(db: Path | str | None, src: Path) -> None:
    """Add the entries of a JSON-lines list (an export, or QuarantineList.save after with_lookalikes) to the store.
    Lines that are not entries are named and skipped; entries already there are kept as they are."""
    from gradloc.records.quarantine import parse_jsonl

    entries, bad = parse_jsonl(src.read_text(encoding="utf-8").splitlines())
    for n, why in bad:
        click.echo(f"line {n} skipped: {visible(why)}", err=True)
    with _opened(db) as store:
        new = store.quarantine.add(entries)
    click.echo(f"{_entries(new)} added, {len(entries) - new} already quarantined, {len(bad)} lines skipped")


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


__all__ = ["quarantine"]
