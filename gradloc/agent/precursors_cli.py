"""``gradloc-agent incidents precursors``: the drift detector's findings the agent stored (not incidents: no probe
ran; one pages only once its drift persisted and accelerated). Reads only, like ``incidents outliers``, from a store or
a daemon's ``/api/precursors``; nothing here imports torch."""
from __future__ import annotations

from pathlib import Path

import click

from gradloc.agent.escape import json_text, visible
from gradloc.agent.incidents_cli import _agent_option, _api, _db_option, _json_option, _opened, _since_option, _source


def _statistics() -> list[str]:
    from gradloc.records.precursors import STATISTICS

    return list(STATISTICS)


@click.command("precursors")
@_db_option
@_agent_option
@_json_option
@click.option("--job", default=None, help="Only this job.")
@click.option("--statistic", type=click.Choice(_statistics()), default=None, help="Only this statistic.")
@click.option("--pages-only", is_flag=True, help="Only the paging findings (a drift that persisted and accelerated).")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1, max=10_000),
              help="At most this many.")
@_since_option
def precursors(db: Path | str | None, agent: str | None, as_json: bool, job: str | None, statistic: str | None,
               pages_only: bool, limit: int, since: float | None) -> None:
    """Statistics drifting steadily away from their own history (attention entropy, logits, router load, RL entropy,
    update ratios …), or swinging far wider than they used to; newest first."""
    from gradloc.records import PrecursorFinding, to_dict
    from gradloc.store.incident_json import record_from_dict

    pages = True if pages_only else None
    source = _source(db, agent)
    if source.agent is not None:  # the daemon's /api/precursors rows: to_dict of the same records
        data = _api(source, "/api/precursors", {"job": job, "statistic": statistic, "pages": "true" if pages else None,
                                                "since": since, "limit": limit})
        if as_json:
            click.echo(json_text(data))
            return
        try:
            rows = [record_from_dict(PrecursorFinding, d, f"$[{i}]") for i, d in enumerate(data)]
        except (TypeError, ValueError) as exc:
            raise click.ClickException(f"the agent's /api/precursors answer is not a list of findings: {exc}") from exc
    else:
        with _opened(source.store) as store:
            rows = store.list_precursor_findings(job=job, statistic=statistic, pages=pages, since_unix=since,
                                                 limit=limit)
        if as_json:
            click.echo(json_text([to_dict(f) for f in rows]))
            return
    if not rows:
        click.echo("no precursor findings" + (f" for job {job!r}" if job else "") + (" in that time" if since else ""))
        return
    for f in rows:
        head = f" head {f.head}" if f.head is not None else ""
        paging = " · PAGES" if f.pages else ""
        click.echo(f"{visible(f.job)} · rank {f.rank} · step {f.step} · {f.statistic} of {visible(f.layer) or '-'}{head}"
                   f" · {f.trend} since step {f.since_step}{paging} · {f.value:.4g} vs {f.baseline:.4g} "
                   f"(×{f.change:.3g}, z {f.z:.1f})")
        if f.detail:
            click.echo(f"    {visible(f.detail)}")
        for d in f.drivers[:3]:
            sample = f"sample {d.sample}" + (f" (id {visible(d.sample_id)})" if d.sample_id else "")
            origin = f" · from {visible(d.sample_info.origin)}" if d.sample_info is not None and d.sample_info.origin else ""
            click.echo(f"    driven by step {d.step} · micro-batch {d.micro_batch} · {sample} · position {d.position}"
                       f" · value {d.value:.4g}{origin}")
