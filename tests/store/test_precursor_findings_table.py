"""The ``precursor_findings`` table (gradloc/store/precursor_findings.py): the drift detector's findings written with
their steps, listed newest first with filters, replaced when a step is re-sent, pruned (on both databases), migrated
into a schema-7 file."""
from __future__ import annotations

import math
import sqlite3
from dataclasses import replace
from pathlib import Path

from gradloc.records import PrecursorDriver, PrecursorFinding, SampleInfo
from gradloc.store.retention import RetentionConfig
from gradloc.store.schema import SCHEMA_VERSION
from gradloc.store.sqlite import IncidentStore
from tests.builders import rank_summary

T0 = 1_700_000_000.0
INFO = SampleInfo(source="forum", origin="forum-03.jsonl:812", tags={"lang": "en"}, request_id="r7")


def _finding(job: str, step: int, statistic: str = "attn_entropy", *, rank: int = 0, t: float = T0,
             pages: bool = False, **kw) -> PrecursorFinding:
    args = dict(job=job, rank=rank, step=step, time_unix=t + step, statistic=statistic, layer="model.layers.1",
                head=None, trend="falling", value=0.4, baseline=1.6, z=-7.5, change=0.25, rate=3.1,
                since_step=max(0, step - 300), pages=pages, detail="attn_entropy of model.layers.1 falling ∑",
                drivers=(PrecursorDriver(step=step, value=0.3, micro_batch=0, sample=5, position=17, sample_id="s-5",
                                         sample_info=INFO),
                         PrecursorDriver(step=step - 1, value=0.35, micro_batch=1, sample=0, position=3)))
    args.update(kw)
    return PrecursorFinding(**args)


def _step(job: str, step: int, *found: PrecursorFinding, rank: int = 0, t: float = T0):
    return replace(rank_summary(job, rank, step), time_unix=t + step, precursor_findings=found)


def test_findings_are_stored_with_their_steps_and_listed_newest_first(target: Path | str) -> None:
    a1 = _finding("a", 400)
    b3 = (_finding("b", 500, "dead_experts", layer="moe.gate", head=3, trend="rising", baseline=0.0,
                   change=math.inf, drivers=()),
          _finding("b", 500, pages=True))
    with IncidentStore(target) as store:
        store.put_steps([_step("a", 400, a1), _step("a", 401), _step("b", 500, *b3)])
        rows = store.list_precursor_findings()
        assert [(f.job, f.step, f.statistic, f.pages) for f in rows] == [
            ("b", 500, "dead_experts", False), ("b", 500, "attn_entropy", True), ("a", 400, "attn_entropy", False)]
        assert rows[-1] == a1 and rows[0] == b3[0]  # every field comes back: drivers, provenance, +inf, the head
        assert rows[-1].drivers[0].sample_info == INFO and rows[0].change == math.inf
        assert [f.step for f in store.list_precursor_findings(job="a")] == [400]
        assert [f.statistic for f in store.list_precursor_findings(statistic="dead_experts")] == ["dead_experts"]
        assert [(f.job, f.pages) for f in store.list_precursor_findings(pages=True)] == [("b", True)]
        assert len(store.list_precursor_findings(pages=False)) == 2
        assert [f.step for f in store.list_precursor_findings(since_unix=T0 + 401)] == [500, 500]
        assert [f.step for f in store.list_precursor_findings(steps=(300, 450))] == [400]
        assert len(store.list_precursor_findings(limit=1)) == 1 and len(store.list_precursor_findings(limit=None)) == 3


def test_a_nan_is_kept_as_nan(target: Path | str) -> None:
    """A record made in process (embedded mode, not checked by the wire) with a NaN: stored (NULL), read as NaN."""
    with IncidentStore(target) as store:
        store.put_steps([_step("a", 400, _finding("a", 400, z=math.nan))])
        (got,) = store.list_precursor_findings()
        assert math.isnan(got.z) and got.value == 0.4


def test_a_resent_step_replaces_its_findings(target: Path | str) -> None:
    with IncidentStore(target) as store:
        store.put_steps([_step("a", 400, _finding("a", 400), _finding("a", 400, pages=True))])
        store.put_steps([_step("a", 400, _finding("a", 400))])  # at-least-once delivery: the same step again
        assert len(store.list_precursor_findings()) == 1
        store.put_steps([_step("a", 400, _finding("a", 400, rank=1), rank=1)])  # another rank's step 400
        assert len(store.list_precursor_findings()) == 2


def test_retention_prunes_old_findings(target: Path | str) -> None:
    with IncidentStore(target, RetentionConfig(max_age_days=1)) as store:
        store.put_steps([_step("a", 400, _finding("a", 400, t=T0 - 3 * 86400), t=T0 - 3 * 86400),
                         _step("a", 401, _finding("a", 401))])
        counts = store.apply_retention(now=T0 + 500)
        assert counts["precursor_findings"] == 1 and [f.step for f in store.list_precursor_findings()] == [401]


def test_a_schema_7_store_gains_the_table_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "v7.db"
    with IncidentStore(path) as store:
        store.put_steps([_step("old", 1)])
    conn = sqlite3.connect(path)  # back to schema 7: no precursor_findings
    conn.executescript("DROP TABLE precursor_findings; PRAGMA user_version = 7;")
    conn.close()
    with IncidentStore(path) as store:
        assert store.step_summaries("old")[0].step == 1
        store.put_steps([_step("j", 400, _finding("j", 400))])
        assert [f.job for f in store.list_precursor_findings()] == ["j"]
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
    conn.close()
