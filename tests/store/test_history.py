"""Memory across runs (gradloc/store/history.py): a sample flagged in an earlier run is recognised by its origin
(or sample id) in any job of the same store; a v6 store gains the spans' provenance columns and step_groups."""
from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

from gradloc.records import GroupTokens, SampleInfo, SampleOutlier, SampleStats
from gradloc.reports import RankSpan
from gradloc.store.schema import SCHEMA_VERSION
from gradloc.store.sqlite import IncidentStore
from tests.builders import BELL, make_incident, step_summary

T = 1_760_000_000.0
ROW = SampleInfo(source="forum", origin="forum-03.jsonl:812")


def _incident(n: int, job: str, t: float, info: SampleInfo | None = ROW, sample_id: str | None = None):
    inc = make_incident(f"{n:032x}", job=job, step=10 * n, time_unix=t)
    return replace(inc, spans=(RankSpan(0, 0.9, replace(BELL, sample_info=info, sample_id=sample_id)),))


def _outlier_step(job: str, step: int, t: float, info: SampleInfo | None):
    o = SampleOutlier(kind="surprise", job=job, rank=0, step=step, time_unix=t, score=9.0, z=12.0, baseline=3.0,
                      micro_batch=0, sample=0, sample_id="u-1", tokens=10, sample_info=info)
    return replace(step_summary(job, 0, step, t), samples=SampleStats(judged=1, flagged=1, outliers=(o,)))


def test_an_earlier_run_s_culprits_and_outliers_are_recognised_by_origin(target: Path | str):
    with IncidentStore(target) as store:
        store.put_incident(_incident(1, "run-1", T))
        store.put_steps([_outlier_step("run-1", 15, T + 50, ROW)])
        store.put_incident(_incident(2, "run-1", T + 100, info=SampleInfo(source="forum", origin="other.jsonl:1")))
        store.put_incident(_incident(3, "run-2", T + 1000))  # today's run: the same row again
        seen = store.history.seen_before(origin=ROW.origin, sample_id=None, before_unix=T + 1000,
                                 exclude_incident=f"{3:032x}")
        assert seen is not None and seen.count == 2 and seen.key == ROW.origin
        assert [(s.what, s.job, s.step) for s in seen.sightings] == [("outlier", "run-1", 15), ("culprit", "run-1", 10)]
        assert seen.sightings[1].incident_id == f"{1:032x}"
        assert seen.text() == "seen before: job run-1 step 15 (outlier), job run-1 step 10 (culprit) — 2 times"
        # before the first flag: nothing; a row never flagged: nothing; no key: nothing
        assert store.history.seen_before(origin=ROW.origin, sample_id=None, before_unix=T) is None
        assert store.history.source_before(source="forum", before_unix=T + 1000, job="run-2").text() == \
            "source forum: flagged 3 times before in 1 other job"
        assert store.history.seen_before(origin="never.jsonl:0", sample_id=None, before_unix=T + 9999) is None
        assert store.history.seen_before(origin=None, sample_id=None, before_unix=T + 9999) is None


def test_without_an_origin_the_sample_id_matches(target: Path | str):
    with IncidentStore(target) as store:
        store.put_incident(_incident(1, "run-1", T, info=None, sample_id="doc-42"))
        seen = store.history.seen_before(origin=None, sample_id="doc-42", before_unix=T + 1)
        assert seen is not None and seen.count == 1 and seen.sightings[0].job == "run-1"


def test_a_v6_store_gains_the_columns_and_the_groups_table(tmp_path: Path):  # a SQLite file
    path = tmp_path / "v6.db"
    with IncidentStore(path) as store:
        store.put_incident(_incident(1, "old", T, info=None))
    conn = sqlite3.connect(path)  # back to schema 6: no step_groups, no spans.source/origin
    conn.executescript("DROP INDEX spans_origin; DROP INDEX sample_outliers_origin; DROP TABLE step_groups; "
                       "ALTER TABLE spans DROP COLUMN source; ALTER TABLE spans DROP COLUMN origin; "
                       "PRAGMA user_version = 6;")
    conn.close()
    with IncidentStore(path) as store:
        store.put_incident(_incident(2, "new", T + 10))
        store.put_steps([replace(step_summary("new", 0, 3, T + 11),
                                 groups=(GroupTokens(kind="source", name="forum", samples=2, tokens=64),))])
        assert store.history.group_totals() == [("source", "forum", 2, 64)]
        assert store.history.seen_before(origin=ROW.origin, sample_id=None, before_unix=T + 20).sightings[0].job == "new"
        assert store.get_incident(f"{1:032x}") is not None  # the old incident reads as before
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("SELECT origin FROM spans ORDER BY incident_id").fetchall() == [(None,), (ROW.origin,)]
    conn.close()


def test_retention_prunes_old_group_rows(target: Path | str):
    from gradloc.store import RetentionConfig

    with IncidentStore(target, RetentionConfig(max_age_days=1.0)) as store:
        g = (GroupTokens(kind="source", name="web", samples=1, tokens=5),)
        store.put_steps([replace(step_summary("j", 0, 1, T), groups=g), replace(step_summary("j", 0, 2, T + 2 * 86400),
                                                                               groups=g)])
        counts = store.apply_retention(now=T + 2 * 86400)
        assert counts["step_groups"] == 1 and store.history.group_totals() == [("source", "web", 1, 5)]
