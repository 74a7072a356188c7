"""docs/operations.md's deployment examples cannot drift from the CLI: every `gradloc-agent serve`
option they use exists. (The examples themselves are not run: no systemd or container runtime here.)"""
from __future__ import annotations

import re
from pathlib import Path

from gradloc.agent.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _serve_options() -> set[str]:
    serve = main.commands["serve"]
    return {opt for p in serve.params for opt in p.opts}


def test_every_serve_option_in_the_operations_doc_exists():
    text = DOC.read_text(encoding="utf-8").replace("\\\n", " ")
    commands = re.findall(r"gradloc-agent serve([^\n`]*)", text)
    assert len(commands) >= 3, commands  # the TLS example, systemd's ExecStart, the container's
    used = {opt for cmd in commands for opt in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", cmd)}
    assert used and used <= _serve_options(), used - _serve_options()


def test_the_documented_alerts_and_metrics_exist():
    from gradloc.exporters.metric_specs import SPECS
    from gradloc.grafana.provision import rules_text

    text = DOC.read_text(encoding="utf-8")
    names = {s.prom for s in SPECS}
    for m in set(re.findall(r"gradloc_[a-z_]+", text)):
        base = re.sub(r"_(total|bucket|count|sum)$", "", m)
        assert base in names, m
    for alert in set(re.findall(r"`(Gradloc[A-Za-z]+)`", text)):
        assert f"alert: {alert}" in rules_text(), alert
