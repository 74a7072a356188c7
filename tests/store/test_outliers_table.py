"""The ``sample_outliers`` table (gradloc/store/outliers.py): findings written with their steps,
listed newest first, replaced when a step is re-sent, pruned (on both databases), migrated into older files."""
from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

from gradloc.records import SampleOutlier, SampleStats
from gradloc.store import inbox
from gradloc.store.retention import RetentionConfig
from gradloc.store.schema import _SCHEMA_V1, SCHEMA_VERSION
from gradloc.store.sqlite import IncidentStore
from tests.builders import rank_summary

T0 = 1_700_000_000.0


def _step(job: str, step: int, *kinds: str, rank: int = 0, t: float = T0):
    outs = tuple(SampleOutlier(kind=k, job=job, rank=rank, step=step, time_unix=t + step, score=8.0 + i, z=10.0 + i,
                               baseline=3.5, micro_batch=None if k == "rl_mismatch" else 1, sample=2,
                               sample_id=f"{job}-{step}-{i}", start=0, end=64, tokens=64, text="qzx ∑", detail="d")
                 for i, k in enumerate(kinds))
    s = replace(rank_summary(job, rank, step), time_unix=t + step)
    return replace(s, samples=SampleStats(judged=16, flagged=len(outs), outliers=outs))


def test_findings_are_stored_with_their_steps_and_listed_newest_first(target: Path | str) -> None:
    with IncidentStore(target) as store:
        store.put_steps([_step("a", 1, "surprise"), _step("a", 2), _step("b", 3, "surprise", "rl_mismatch")])
        rows = store.list_outliers()
        assert [(o.job, o.step, o.kind) for o in rows] == [("b", 3, "surprise"), ("b", 3, "rl_mismatch"),
                                                          ("a", 1, "surprise")]
        assert rows[-1] == _step("a", 1, "surprise").samples.outliers[0]  # every field comes back
        assert [o.step for o in store.list_outliers(job="a")] == [1]
        assert [o.kind for o in store.list_outliers(kind="rl_mismatch")] == ["rl_mismatch"]
        assert [o.step for o in store.list_outliers(since_unix=T0 + 2)] == [3, 3]
        assert len(store.list_outliers(limit=1)) == 1 and len(store.list_outliers(limit=None)) == 3


def test_a_resent_step_replaces_its_findings(target: Path | str) -> None:
    with IncidentStore(target) as store:
        store.put_steps([_step("a", 1, "surprise", "surprise")])
        store.put_steps([_step("a", 1, "surprise")])  # at-least-once delivery: the same step again
        assert len(store.list_outliers()) == 1
        store.put_steps([_step("a", 1, "surprise", rank=1)])  # another rank's step 1 is another step
        assert len(store.list_outliers()) == 2


def test_an_older_store_gains_the_table_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    conn = sqlite3.connect(path)
    conn.executescript(_SCHEMA_V1 + "; PRAGMA user_version = 1;")
    inbox.create(conn)
    conn.execute("PRAGMA user_version = 2")
    conn.execute("INSERT INTO steps VALUES ('j', 0, 1, 1.0, 1.0, 1.0, 0.0, 0.0, 0, 0)")
    conn.commit()
    conn.close()
    with IncidentStore(path) as store:
        assert store.step_summaries("j")[0].step == 1
        store.put_steps([_step("j", 2, "surprise")])
        assert [o.step for o in store.list_outliers()] == [2]
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()


def test_retention_prunes_old_findings(target: Path | str) -> None:
    with IncidentStore(target, RetentionConfig(max_age_days=1)) as store:
        store.put_steps([_step("a", 1, "surprise", t=T0 - 3 * 86400), _step("a", 2, "surprise")])
        counts = store.apply_retention(now=T0 + 10)
        assert counts["sample_outliers"] == 1 and [o.step for o in store.list_outliers()] == [2]


def test_an_outlier_keeps_its_provenance_and_a_v4_store_gains_the_columns(tmp_path: Path) -> None:
    from gradloc.records import SampleInfo
    from gradloc.store import aliases, outliers

    info = SampleInfo(source="forum", origin="forum-03.jsonl:812", tags={"lang": "en"}, request_id="r7")
    path = tmp_path / "v4.db"
    conn = sqlite3.connect(path)  # a store of schema 4: the outliers table without the provenance columns
    conn.executescript(_SCHEMA_V1 + "; PRAGMA user_version = 1;")
    inbox.create(conn)
    conn.execute(outliers._SCHEMA.split(";")[0].replace(""",
    source      TEXT,  -- SampleInfo.source (queried by source)
    origin      TEXT,  -- SampleInfo.origin
    info        TEXT   -- the whole SampleInfo, JSON (records.to_dict)""", ""))
    aliases.create(conn)
    conn.execute("INSERT INTO sample_outliers (job, rank, step, time_unix, kind, score, z, baseline, tokens, detail) "
                 "VALUES ('old', 0, 1, 1.0, 'surprise', 8.0, 10.0, 3.5, 64, 'before provenance')")
    conn.execute("PRAGMA user_version = 4")
    conn.commit()
    conn.close()
    step = _step("j", 2, "surprise")
    with_info = replace(step, samples=replace(step.samples, outliers=tuple(
        replace(o, sample_info=info) for o in step.samples.outliers)))
    with IncidentStore(path) as store:
        store.put_steps([with_info])
        got = {o.job: o for o in store.list_outliers()}
        assert got["j"] == with_info.samples.outliers[0] and got["j"].sample_info == info
        assert got["old"].sample_info is None and got["old"].detail == "before provenance"
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("SELECT source, origin FROM sample_outliers WHERE job = 'j'").fetchone() == \
        ("forum", "forum-03.jsonl:812")
    conn.close()
