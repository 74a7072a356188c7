"""docs/metrics.md cannot drift from SPECS: its tables are exactly the generator's output."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from gradloc.exporters import metric_docs
from gradloc.exporters.metric_specs import SPECS
from gradloc.exporters.state import StateConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"


def test_doc_contains_exactly_the_generated_tables():
    doc = DOC.read_text(encoding="utf-8")
    generated = metric_docs.generated_markdown()
    start, end = doc.find(metric_docs.BEGIN), doc.find(metric_docs.END)
    assert start >= 0 and end > start, "generated markers missing from docs/metrics.md"
    assert doc[start:end + len(metric_docs.END) + 1] == generated, (
        "docs/metrics.md is out of date: paste the output of `python -m gradloc.exporters.metric_docs`")
    assert doc.count(metric_docs.BEGIN) == 1


def test_every_metric_has_one_row():
    table = metric_docs.metrics_table()
    for spec in SPECS:
        rows = [ln for ln in table.splitlines() if f"`{spec.otel}`" in ln]
        assert len(rows) == 1, spec.key
        assert spec.prom_sample in rows[0] and spec.kind in rows[0]
    assert len(table.splitlines()) == len(SPECS) + 2


def test_prose_names_only_metrics_that_exist():
    known = {s.prom_sample for s in SPECS} | {f"{s.prom}_{x}" for s in SPECS if s.kind == "histogram"
                                               for x in ("bucket", "sum", "count")}
    mentioned = set(re.findall(r"\bgradloc_[a-z_]+\b", DOC.read_text(encoding="utf-8")))
    assert mentioned and mentioned <= known, mentioned - known


def test_every_state_limit_is_explained():
    fields = {f.name for f in dataclasses.fields(StateConfig)}
    assert fields == set(metric_docs.LIMIT_MEANINGS)


def test_module_prints_the_block():
    out = subprocess.run([sys.executable, "-m", "gradloc.exporters.metric_docs"], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert out == metric_docs.generated_markdown()
