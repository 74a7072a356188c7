"""The drift detector's findings at the agent's edges: ``/api/precursors``, the index page's section, the incident
page's "preceded by", ``/metrics``, the dropped count, ``gradloc-agent incidents precursors`` (store and daemon) and the
JSONL sink — with a store and from the agent's memory without one."""
from __future__ import annotations

import json
import math
import urllib.error
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradloc.agent.cli import main
from gradloc.agent.core import AgentCore, Declare
from gradloc.agent.page_precursors import preceding
from gradloc.exporters.jsonl import JsonlSink
from gradloc.exporters.prometheus import render
from gradloc.records import PrecursorDriver, PrecursorFinding, SampleInfo, StepRecord
from gradloc.store.sqlite import IncidentStore
from tests.builders import correlated, rank_summary
from tests.helpers import http_get, served_core

EVIL = "<script>window.pwned=1</script>\x1b[2J"


def _finding(job: str, step: int, statistic: str = "attn_entropy", **kw) -> PrecursorFinding:
    args = dict(job=job, rank=0, step=step, time_unix=1000.0 + step, statistic=statistic, layer="model.layers.1",
                trend="falling", value=0.4, baseline=1.6, z=-7.5, change=0.25, rate=3.1, since_step=step - 300,
                detail=EVIL, drivers=(PrecursorDriver(step=step - 2, value=0.3, micro_batch=0, sample=5, position=17,
                                                       sample_id="uid-5", sample_info=SampleInfo(origin="web.jsonl:9")),))
    args.update(kw)
    return PrecursorFinding(**args)


FOUND = {"j": (_finding("j", 1000), _finding("j", 1100, pages=True)),
         "k": (_finding("k", 1200, "expert_load_max", layer="moe.gate", trend="rising", value=3.0, baseline=1.1,
                        change=2.7, z=9.0),)}


def _summary(job: str, step: int, *found: PrecursorFinding, dropped: int = 0):
    return replace(rank_summary(job, 0, step), precursor_findings=found, precursor_findings_dropped=dropped)


@pytest.fixture(params=["memory", "store"])
def served(request, tmp_path: Path):
    with served_core(request.param, str(tmp_path / "a.db"), [Declare("j", 0, 1), _summary("j", 1000, FOUND["j"][0]), _summary("j", 1050, dropped=2),
             _summary("j", 1100, FOUND["j"][1]), _summary("k", 1200, *FOUND["k"])]) as (url, core):
        yield (url, core)


def test_the_api_lists_findings_newest_first_with_filters(served) -> None:
    url, _ = served
    code, body = http_get(url + "/api/precursors")
    rows = json.loads(body)
    assert code == 200 and [(r["job"], r["step"], r["statistic"], r["pages"]) for r in rows] == [
        ("k", 1200, "expert_load_max", False), ("j", 1100, "attn_entropy", True), ("j", 1000, "attn_entropy", False)]
    assert rows[-1]["detail"] == EVIL and rows[-1]["drivers"][0]["sample_info"]["origin"] == "web.jsonl:9"
    assert [r["step"] for r in json.loads(http_get(url + "/api/precursors?job=j")[1])] == [1100, 1000]
    assert [r["job"] for r in json.loads(http_get(url + "/api/precursors?statistic=expert_load_max")[1])] == ["k"]
    assert [r["step"] for r in json.loads(http_get(url + "/api/precursors?pages=true")[1])] == [1100]
    assert [r["step"] for r in json.loads(http_get(url + "/api/precursors?since=2150&limit=1")[1])] == [1200]
    for bad in ("limit=zero", "pages=maybe", "since=yesterday"):
        with pytest.raises(urllib.error.HTTPError) as err:
            http_get(url + "/api/precursors?" + bad)
        assert err.value.code == 400


def test_the_index_page_lists_findings_escaped(served) -> None:
    url, _ = served
    code, page = http_get(url + "/incidents")
    assert code == 200 and '<h2 id="precursor-findings">Precursor findings</h2>' in page
    assert "expert_load_max" in page and "moe.gate" in page and "uid-5" in page and "web.jsonl:9" in page
    assert "<script>" not in page and "&lt;script&gt;" in page and "\x1b" not in page
    _, only_k = http_get(url + "/incidents?job=k")
    assert "moe.gate" in only_k and "model.layers.1" not in only_k


def test_the_incident_page_names_the_series_drifting_before_it(served) -> None:
    url, core = served
    inc = correlated("j", 1150)  # j's attn_entropy drifting since step 700 and 800 (paged at 1100); k's is another job
    if core.store is not None:
        core.store.put_incident(inc)
    else:
        core.recent.append(inc)
    _, page = http_get(url + "/incidents/" + inc.incident_id)
    assert ('<p class="preceded">preceded by: <a href="/incidents?job=j&amp;statistic=attn_entropy#precursor-findings">'
            "attn_entropy of model.layers.1 falling since step 700</a> <span class=\"flag\">(paged)</span></p>") in page
    assert "expert_load_max" not in page


def test_preceding_keeps_one_finding_per_series_within_the_window() -> None:
    a, b = _finding("j", 5000, since_step=4000), _finding("j", 5100, since_step=4100, pages=True)
    far, later = _finding("j", 2000), _finding("j", 6100, since_step=6050)
    other = _finding("j", 5000, "logit_max_abs", layer="lm_head", trend="rising", since_step=4900)
    got = preceding([a, b, far, later, other, _finding("x", 5000)], "j", 6000)
    assert got == (replace(a, pages=True), other)  # the earliest drift of each series, paged when any of it paged
    assert preceding([later], "j", 6000) == () and preceding([a], "j", 7001) == ()  # after it; found too long before


def test_metrics_count_findings_by_closed_labels_and_the_dropped_ones(served) -> None:
    url, _ = served
    _, text = http_get(url + "/metrics")
    assert ('gradloc_precursor_findings_total{job="j",pages="false",rank="0",statistic="attn_entropy",'
            'trend="falling"} 1.0') in text
    assert 'gradloc_precursor_findings_total{job="j",pages="true",rank="0",statistic="attn_entropy",trend="falling"} 1.0' in text
    assert 'gradloc_agent_series_dropped_total{reason="precursor_findings"} 2.0' in text
    family = [ln for ln in text.splitlines() if ln.startswith("gradloc_precursor_findings_total")]
    assert family and not any("layer" in ln or "step=" in ln or "sample" in ln for ln in family)  # cardinality


def test_the_cli_lists_stored_findings(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with IncidentStore(db) as store:
        store.put_steps([_summary("j", 1000, *FOUND["j"][:1]), _summary("j", 1100, FOUND["j"][1]),
                         _summary("k", 1200, *FOUND["k"])])
    out = CliRunner().invoke(main, ["incidents", "precursors", "--db", str(db), "--json"])
    assert out.exit_code == 0, out.output
    assert [(r["job"], r["step"]) for r in json.loads(out.stdout)] == [("k", 1200), ("j", 1100), ("j", 1000)]
    out = CliRunner().invoke(main, ["incidents", "precursors", "--db", str(db), "--job", "j", "--pages-only"])
    assert out.exit_code == 0, out.output
    assert "j · rank 0 · step 1100 · attn_entropy of model.layers.1 · falling since step 800 · PAGES" in out.stdout
    assert "step 1000" not in out.stdout and "driven by step 1098 · micro-batch 0 · sample 5 (id uid-5)" in out.stdout
    assert "\x1b" not in out.stdout and "\\x1b" in out.stdout  # client text is shown, never executed
    out = CliRunner().invoke(main, ["incidents", "precursors", "--db", str(db), "--statistic", "expert_load_max"])
    assert out.exit_code == 0 and "moe.gate" in out.stdout and "model.layers.1" not in out.stdout
    assert CliRunner().invoke(main, ["incidents", "precursors", "--db", str(db), "--statistic", "nope"]).exit_code == 2
    out = CliRunner().invoke(main, ["incidents", "precursors", "--db", str(tmp_path / "missing.db")])
    assert out.exit_code == 1 and "no incident store" in out.output


def test_the_cli_reads_a_daemon(served) -> None:
    url, _ = served
    out = CliRunner().invoke(main, ["incidents", "precursors", "--agent", url.removeprefix("http://"), "--job", "k"])
    assert out.exit_code == 0, out.output
    assert "k · rank 0 · step 1200 · expert_load_max of moe.gate · rising since step 900" in out.stdout
    out = CliRunner().invoke(main, ["incidents", "precursors", "--agent", url, "--pages-only", "--json"])
    assert out.exit_code == 0 and [r["step"] for r in json.loads(out.stdout)] == [1100]


def test_the_jsonl_sink_writes_each_finding_as_a_line(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "i.jsonl")
    found = _finding("j", 1000, statistic="dead_experts", baseline=0.0, change=math.inf)
    sink.on_step(StepRecord(job="j", rank=0, step=1000, time_unix=2000.0, global_norm=1.0, loss=2.0, micro_batches=1,
                            layers=(), precursor_findings=(found,)))
    sink.shutdown()
    (line,) = (tmp_path / "i.jsonl").read_text().splitlines()
    row = json.loads(line)
    assert row["kind"] == "precursor_finding" and row["finding"]["statistic"] == "dead_experts"
    assert row["finding"]["change"] == "inf"


def test_a_core_without_exporters_keeps_findings_in_memory_bounded() -> None:
    from gradloc.agent.core import CoreConfig

    core = AgentCore(CoreConfig(recent_incidents=2)).start()
    try:
        core.submit([_summary("j", 1000 + i, _finding("j", 1000 + i)) for i in range(5)])
        assert core.flush(10)
        assert [f.step for f in core.recent_precursors] == [1003, 1004]
        text = render(core.state, None)[0].decode()
        assert 'statistic="attn_entropy",trend="falling"} 5.0' in text
    finally:
        core.close()


def test_incidents_show_names_the_series_drifting_before_it(tmp_path: Path) -> None:
    db, inc = tmp_path / "s.db", correlated("j", 1150)
    with IncidentStore(db) as store:
        store.put_steps([_summary("j", 1000, FOUND["j"][0]), _summary("j", 1100, FOUND["j"][1]),
                         _summary("k", 1200, *FOUND["k"])])
        store.put_incident(inc)
    out = CliRunner().invoke(main, ["incidents", "show", inc.incident_id[:12], "--db", str(db), "--no-color"])
    assert out.exit_code == 0, out.output
    assert "  preceded by: attn_entropy of model.layers.1 falling since step 700 (paged)\n" in out.stdout
    html_file = tmp_path / "page.html"
    out = CliRunner().invoke(main, ["incidents", "show", inc.incident_id[:12], "--db", str(db), "--html", str(html_file)])
    assert out.exit_code == 0 and 'class="preceded"' in html_file.read_text()
