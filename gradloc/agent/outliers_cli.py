"""``gradloc-agent incidents outliers``: the per-sample findings the agent stored (not incidents: no
probe ran, nothing paged). Reads only, like the rest of ``incidents``; nothing here imports torch."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import click

from gradloc.agent.escape import json_text, visible
from gradloc.agent.incidents_cli import _agent_option, _api, _db_option, _json_option, _opened, _since_option, _source


@click.command("outliers")
@_db_option
@_agent_option
@_json_option
@click.option("--job", default=None, help="Only this job.")
@click.option("--kind", type=click.Choice(["surprise", "rl_mismatch"]), default=None, help="Only this kind.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1, max=10_000),
              help="At most this many.")
@_since_option
def outliers(db: Path | str | None, agent: str | None, as_json: bool, job: str | None, kind: str | None, limit: int,
             since: float | None) -> None:
    """Samples whose surprise stood out against the run's history, and sustained RL mismatches; newest first."""
    from gradloc.records import to_dict

    source = _source(db, agent)
    if source.agent is not None:  # the daemon's /api/outliers rows: to_dict of the same records
        data = _api(source, "/api/outliers", {"job": job, "kind": kind, "since": since, "limit": limit})
        if as_json:
            click.echo(json_text(data))
            return
        rows = [SimpleNamespace(**{**d, "score": float(d["score"]), "z": float(d["z"])}) for d in data]
    else:
        with _opened(source.store) as store:
            rows = store.list_outliers(job=job, kind=kind, since_unix=since, limit=limit)
        if as_json:
            click.echo(json_text([to_dict(o) for o in rows]))
            return
    if not rows:
        click.echo("no sample outliers" + (f" for job {job!r}" if job else "") + (" in that time" if since else ""))
        return
    for o in rows:
        where = "" if o.micro_batch is None else (
            f" · micro-batch {o.micro_batch} · sample {o.sample}" + (f" (id {o.sample_id})" if o.sample_id else "")
            + (f" · positions {o.start}–{o.end - 1}" if o.start is not None and o.end and o.end > o.start else ""))
        click.echo(f"{o.job} · rank {o.rank} · step {o.step} · {o.kind}{where} · score {o.score:.3g} · z {o.z:.1f}")
        click.echo(f"    {visible(o.detail)}")
        if o.text:
            click.echo(f"    text: {visible(o.text)[:200]}")
