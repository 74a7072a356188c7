"""Memory across runs on the incident page and in ``gradloc-agent incidents show``: a culprit sample flagged in an
earlier run (same origin) says so, and so does its source when other jobs flagged it."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from click.testing import CliRunner

from gradloc.agent.cli import main
from gradloc.agent.incident_page import incident_html
from gradloc.agent.store_context import store_context
from gradloc.records import SampleInfo, SampleOutlier, SampleStats
from gradloc.reports import RankSpan
from gradloc.store.sqlite import IncidentStore
from tests.builders import BELL, make_incident, step_summary

T = 1_760_000_000.0
ROW = SampleInfo(source="forum", origin="forum-03.jsonl:812")


def _incident(n: int, job: str, t: float, info: SampleInfo):
    inc = make_incident(f"{n:032x}", job=job, step=10 * n, time_unix=t)
    return replace(inc, spans=(RankSpan(0, 0.9, replace(BELL, sample_info=info)),))


def test_yesterday_s_culprit_is_recognised_today(tmp_path: Path):
    db = tmp_path / "m.db"
    with IncidentStore(db) as store:
        store.put_incident(_incident(1, "yesterday", T, ROW))
        o = SampleOutlier(kind="surprise", job="yesterday", rank=0, step=30, time_unix=T + 5, score=9.0, z=12.0,
                          baseline=3.0, micro_batch=0, sample=0, tokens=10,
                          sample_info=SampleInfo(source="forum", origin="forum-01.jsonl:4"))
        store.put_steps([replace(step_summary("yesterday", 0, 30, T + 5), samples=SampleStats(flagged=1, outliers=(o,)))])
        store.put_incident(_incident(2, "today", T + 86400, ROW))
        store.put_incident(_incident(3, "today", T + 86500, SampleInfo(source="code", origin="code.jsonl:1")))
        today = store.get_incident(f"{2:032x}")
        ctx = store_context(store, today)
        fresh = store_context(store, store.get_incident(f"{3:032x}"))
    assert ctx.seen[ROW.origin].count == 1 and ctx.seen[ROW.origin].sightings[0].job == "yesterday"
    assert [s.text() for s in ctx.sources] == ["source forum: flagged 2 times before in 1 other job"]
    page = incident_html(today, ctx)
    assert "Seen before" in page and "seen before: job yesterday step 10 (culprit) — 1 time" in page
    assert not fresh.seen and not fresh.sources and "Seen before" not in incident_html(today, fresh)
    out = CliRunner().invoke(main, ["incidents", "show", f"{2:032x}", "--db", str(db), "--no-color"])
    assert out.exit_code == 0, out.output
    assert "seen before: job yesterday step 10 (culprit) — 1 time" in out.output
    assert "source forum: flagged 2 times before in 1 other job" in out.output
