"""Per-source series (``gradloc_source_tokens_total``, ``gradloc_source_flags_total``): tokens and flags by data
source, with a bounded source label (configured sources, the first ``max_sources`` seen, then ``other``)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gradloc.agent.core import AgentCore, CoreConfig
from gradloc.errors import ConfigError
from gradloc.exporters.prometheus import render
from gradloc.exporters.source_labels import SourceLabels
from gradloc.exporters.state import StateConfig
from gradloc.records import GroupTokens, SampleInfo, SampleOutlier, SampleStats
from gradloc.reports import RankSpan
from tests.builders import BELL, make_incident, step_summary


def _series(text: str, name: str) -> dict[tuple[str, ...], float]:
    return {tuple(v for k, v in sorted(s.labels.items()) if k != "job"): s.value
            for fam in parse_text(text) for s in fam.samples if s.name == name}


def _step(n: int, tokens: dict[str, int], outlier_source: str | None = None):
    groups = tuple(GroupTokens(kind="source", name=k, samples=1, tokens=v) for k, v in tokens.items())
    groups += (GroupTokens(kind="tag", name="lang=en", samples=1, tokens=5),)  # tags never become labels
    s = replace(step_summary("j", 0, n, 1000.0 + n), groups=groups)
    if outlier_source:
        o = SampleOutlier(kind="surprise", job="j", rank=0, step=n, time_unix=1000.0 + n, score=9.0, z=12.0,
                          baseline=3.0, micro_batch=0, sample=0, tokens=10,
                          sample_info=SampleInfo(source=outlier_source, origin="f:1"))
        s = replace(s, samples=SampleStats(judged=2, flagged=1, outliers=(o,)))
    return s


def test_tokens_and_flags_per_source_with_a_bounded_label():
    core = AgentCore(CoreConfig(state=StateConfig(sources=("math",), max_sources=1))).start()
    try:
        inc = make_incident(job="j")
        inc = replace(inc, spans=(RankSpan(0, 0.9, replace(BELL, sample_info=SampleInfo(source="code"))),
                                  RankSpan(0, 0.1, BELL)))  # the second span names no source
        assert core.submit([_step(1, {"web": 100, "code": 20, "math": 7}, outlier_source="code"),
                            _step(2, {"web": 100, "code": 20, "books": 30})])
        assert core.flush(10.0)
        core.state.observe_incident(inc)  # what the correlator hands the exporters when an incident closes
        text = render(core.state, None)[0].decode()
    finally:
        core.close()
    # math is configured; code is the one dynamic label (first seen: step 1's outlier); web, books and a span
    # without a source are past the bound: other
    assert _series(text, "gradloc_source_tokens_total") == {("math",): 7.0, ("code",): 40.0, ("other",): 230.0}
    assert _series(text, "gradloc_source_flags_total") == {("outlier", "code"): 1.0, ("culprit", "code"): 1.0,
                                                           ("culprit", "other"): 1.0}


def test_the_label_bound():
    labels = SourceLabels(("a",), max_sources=2)
    assert [labels.label(x) for x in ("b", "a", "c", "d", "b", "other")] == ["b", "a", "c", "other", "b", "other"]
    with pytest.raises(ConfigError):
        StateConfig(max_sources=-1)
