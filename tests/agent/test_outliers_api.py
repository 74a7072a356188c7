"""Per-sample findings at the agent's edges: ``/api/outliers``, the incident index page, ``/metrics``,
``gradloc-agent incidents outliers`` and the JSONL sink."""
from __future__ import annotations

import json
import urllib.error
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradloc.agent.cli import main
from gradloc.agent.core import Declare
from gradloc.exporters.jsonl import JsonlSink
from gradloc.records import SampleOutlier, SampleStats, StepRecord
from gradloc.store.sqlite import IncidentStore
from tests.builders import rank_summary
from tests.helpers import http_get, served_core

EVIL = "<script>window.pwned=1</script>\x1b[2J"


def _outlier(job: str, step: int, kind: str = "surprise", **kw) -> SampleOutlier:
    args = dict(kind=kind, job=job, rank=0, step=step, time_unix=1000.0 + step, score=8.7, z=12.3, baseline=3.4,
                micro_batch=1, sample=2, sample_id=f"uid-{step}", start=0, end=64, tokens=64, text=EVIL,
                detail="surprise 8.70 nats/token")
    if kind == "rl_mismatch":
        args.update(score=0.35, micro_batch=None, sample=None, sample_id=None, start=None, end=None, text=None)
    args.update(kw)
    return SampleOutlier(**args)


def _summary(job: str, step: int, *outs: SampleOutlier):
    return replace(rank_summary(job, 0, step), samples=SampleStats(
        judged=16, flagged=sum(o.kind == "surprise" for o in outs), outliers=outs, baseline=3.4,
        z_counts=(8, 4, 2, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0), z_sum=20.0, max_z=12.3, rl_mismatch_baseline=0.0))


@pytest.fixture(params=["memory", "store"])
def served(request, tmp_path: Path):
    with served_core(request.param, str(tmp_path / "a.db"), [Declare("j", 0, 1), _summary("j", 1, _outlier("j", 1)), _summary("j", 2),
             _summary("k", 3, _outlier("k", 3), _outlier("k", 3, "rl_mismatch"))]) as (url, core):
        yield url


def test_the_api_lists_findings_newest_first_with_filters(served) -> None:
    code, body = http_get(served + "/api/outliers")
    rows = json.loads(body)
    assert code == 200 and [(r["job"], r["step"], r["kind"]) for r in rows] == [
        ("k", 3, "surprise"), ("k", 3, "rl_mismatch"), ("j", 1, "surprise")]
    assert rows[-1]["sample_id"] == "uid-1" and rows[-1]["text"] == EVIL  # JSON keeps the text (escaped by json_text)
    assert [r["step"] for r in json.loads(http_get(served + "/api/outliers?job=j")[1])] == [1]
    assert [r["kind"] for r in json.loads(http_get(served + "/api/outliers?kind=rl_mismatch")[1])] == ["rl_mismatch"]
    assert len(json.loads(http_get(served + "/api/outliers?limit=1")[1])) == 1
    with pytest.raises(urllib.error.HTTPError) as err:
        http_get(served + "/api/outliers?limit=zero")
    assert err.value.code == 400


def test_the_index_page_lists_findings_with_their_text_escaped(served) -> None:
    code, page = http_get(served + "/incidents")
    assert code == 200 and "<h2>Sample outliers</h2>" in page and "uid-1" in page and "the step" in page
    assert "<script>" not in page and "&lt;script&gt;" in page and "\x1b" not in page


def test_metrics_count_findings_by_kind_and_export_the_z_distribution(served) -> None:
    _, text = http_get(served + "/metrics")
    assert 'gradloc_sample_outliers_total{job="k",kind="surprise",rank="0"} 1.0' in text
    assert 'gradloc_sample_outliers_total{job="k",kind="rl_mismatch",rank="0"} 1.0' in text
    assert 'gradloc_sample_surprise_z_bucket{job="j",le="+Inf"} 32.0' in text  # two judged steps of job j
    assert 'gradloc_rl_mismatch_baseline_ratio{job="k",rank="0"} 0.0' in text


def test_the_cli_lists_stored_findings(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with IncidentStore(db) as store:
        store.put_steps([_summary("j", 1, _outlier("j", 1)), _summary("k", 3, _outlier("k", 3, "rl_mismatch"))])
    out = CliRunner().invoke(main, ["incidents", "outliers", "--db", str(db), "--json"])
    assert out.exit_code == 0, out.output
    assert [(r["job"], r["kind"]) for r in json.loads(out.stdout)] == [("k", "rl_mismatch"), ("j", "surprise")]
    out = CliRunner().invoke(main, ["incidents", "outliers", "--db", str(db), "--job", "j"])
    assert out.exit_code == 0 and "micro-batch 1 · sample 2 (id uid-1) · positions 0–63" in out.stdout
    assert "\x1b" not in out.stdout and "\\x1b" in out.stdout  # training text is shown, never executed
    out = CliRunner().invoke(main, ["incidents", "outliers", "--db", str(tmp_path / "missing.db")])
    assert out.exit_code == 1 and "no incident store" in out.output


def test_the_jsonl_sink_writes_each_finding_as_a_line(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "i.jsonl")
    rec = StepRecord(job="j", rank=0, step=1, time_unix=1.0, global_norm=1.0, loss=2.0, micro_batches=1, layers=(),
                     samples=SampleStats(judged=4, flagged=1, outliers=(_outlier("j", 1),)))
    sink.on_step(rec)
    sink.on_step(replace(rec, samples=None))
    sink.shutdown()
    (line,) = (tmp_path / "i.jsonl").read_text().splitlines()
    row = json.loads(line)
    assert row["kind"] == "sample_outlier" and row["outlier"]["kind"] == "surprise"
    assert row["outlier"]["sample_id"] == "uid-1" and row["outlier"]["z"] == 12.3
