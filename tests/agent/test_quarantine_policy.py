"""Quarantine by policy (agent/quarantine_policy.py): the daemon's core keeps the samples a located incident names
(by origin when the loader gave one, else by sample id) and the outliers above z out of the next run, and the
incident's page says which. Real components: AgentCore, Correlator, an IncidentStore on a temp file."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gradloc.agent.core import AgentCore, CoreConfig, Declare
from gradloc.agent.correlator import CorrelatorConfig
from gradloc.agent.incident_page import incident_html
from gradloc.agent.quarantine_policy import QuarantinePolicy, incident_entries, outlier_entries
from gradloc.agent.store_context import StoreContext
from gradloc.errors import ConfigError
from gradloc.records import SampleInfo, SampleOutlier, SampleStats
from gradloc.store.sqlite import IncidentStore
from tests.builders import BELL, T0, finding, make_incident, rank_summary

INFO = SampleInfo(source="forum", origin="forum-03.jsonl:812")


def test_a_located_incident_s_sample_level_culprits_are_quarantined_by_origin_else_by_id():
    inc = make_incident()  # rank 0 located BELL (sample id s1200-3-1); rank 1 unverified (never quarantined)
    assert [(e.kind, e.value, e.incident_id) for e in incident_entries(QuarantinePolicy(culprits=True), inc, 5.0)] \
        == [("sample", "s1200-3-1", inc.incident_id)]
    f0 = inc.findings[0]
    with_origin = replace(inc, findings=(replace(f0, localization=replace(f0.localization, spans=tuple(
        replace(s, sample_info=INFO) for s in f0.localization.spans))), *inc.findings[1:]))
    (e,) = incident_entries(QuarantinePolicy(culprits=True), with_origin, 5.0)
    assert (e.kind, e.value, e.job, e.step) == ("origin", "forum-03.jsonl:812", "llm-7b", 1200)
    assert "token-level culprit of incident" in e.reason
    assert incident_entries(QuarantinePolicy(), inc, 5.0) == []  # off by default
    with pytest.raises(ConfigError):
        QuarantinePolicy(outlier_z=0)


def test_outliers_at_or_above_z_are_quarantined():
    outs = tuple(SampleOutlier(kind="surprise", job="j", rank=0, step=9, time_unix=1.0, score=8.0, z=z, baseline=3.0,
                               micro_batch=0, sample=i, sample_id=f"u{i}", start=0, end=4, tokens=4,
                               sample_info=INFO if i == 1 else None) for i, z in enumerate((11.9, 12.0, 30.0)))
    step = replace(rank_summary("j", 0, 9), samples=SampleStats(judged=3, flagged=3, outliers=outs))
    got = outlier_entries(QuarantinePolicy(outlier_z=12.0), [step], 5.0)
    assert [(e.kind, e.value) for e in got] == [("origin", "forum-03.jsonl:812"), ("sample", "u2")]


def test_the_core_quarantines_what_the_incident_names_and_the_page_says_so(tmp_path: Path) -> None:
    db = tmp_path / "agent.db"
    core = AgentCore(CoreConfig(correlator=CorrelatorConfig(straggler_deadline_s=30.0),
                                quarantine=QuarantinePolicy(culprits=True)), IncidentStore(db))
    core.start()
    inc = replace(finding(0, 1200, BELL, incident_id="", time_unix=T0), incident_id="a" * 32)
    assert core.submit([Declare("llm-7b", 0, 1), inc], timeout_s=5.0)
    core.close(timeout_s=10.0)
    with IncidentStore(db) as store:
        (stored,) = list(store.iter_incidents())
        held = store.quarantine.list(incident_id=stored.incident_id)
        assert [(e.kind, e.value) for e in held] == [("sample", "s1200-3-1")]
    page = incident_html(stored, StoreContext(quarantined=tuple(held)))
    assert "<h2>Quarantined</h2>" in page and "s1200-3-1" in page


def test_the_core_quarantines_outliers_from_the_steps_it_stores(tmp_path: Path) -> None:
    db = tmp_path / "agent.db"
    core = AgentCore(CoreConfig(quarantine=QuarantinePolicy(outlier_z=12.0)), IncidentStore(db))
    core.start()
    out = SampleOutlier(kind="surprise", job="j", rank=0, step=9, time_unix=1.0, score=8.0, z=20.0, baseline=3.0,
                        micro_batch=0, sample=1, sample_id="u1", start=0, end=4, tokens=4, sample_info=INFO)
    step = replace(rank_summary("j", 0, 9), samples=SampleStats(judged=3, flagged=1, outliers=(out,)))
    assert core.submit([Declare("j", 0, 1), step], timeout_s=5.0)
    core.close(timeout_s=10.0)
    with IncidentStore(db) as store:
        assert [(e.kind, e.value, e.job, e.step) for e in store.quarantine.list()] == \
            [("origin", "forum-03.jsonl:812", "j", 9)]


def test_embedded_mode_quarantines_by_the_watch_config_s_policy(tmp_path: Path) -> None:
    """watch(..., quarantine_culprits=True) without a daemon: the in-process agent puts what a located incident
    names on its store's list, as ``serve --quarantine-culprits`` does."""
    from gradloc.config import WatchConfig
    from gradloc.errors import ConfigError
    from gradloc.sinks import default_sinks

    db = tmp_path / "embedded.db"
    (agent,) = default_sinks(WatchConfig(job="llm-7b", store_path=str(db), quarantine_culprits=True))
    agent.on_incident(replace(finding(0, 1200, BELL, incident_id="", time_unix=T0), incident_id="a" * 32))
    agent.shutdown()
    with IncidentStore(db) as store:
        assert [(e.kind, e.value) for e in store.quarantine.list()] == [("sample", "s1200-3-1")]
    (off,) = default_sinks(WatchConfig(job="llm-7b", store_path=str(tmp_path / "off.db")))  # the default: off
    off.on_incident(replace(finding(0, 1200, BELL, incident_id="", time_unix=T0), incident_id="b" * 32))
    off.shutdown()
    with IncidentStore(tmp_path / "off.db") as store:
        assert store.quarantine.list() == []
    with pytest.raises(ConfigError, match="quarantine_outlier_z"):
        WatchConfig(quarantine_outlier_z=-1.0)
