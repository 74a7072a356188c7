"""gradloc/records/events.py declares every counter the monitor and its integrations bump: the ``event`` label
of gradloc_monitor_events_total is a closed set, and a counter added without a declaration fails here (it
would otherwise be exported as ``event="other"``)."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from gradloc.records import StepRecord, event_counts
from gradloc.records.events import INTEGRATION_COUNTERS, MONITOR_EVENTS, OTHER

PKG = Path(__file__).resolve().parents[2] / "gradloc"
SIDES = ("engine", "adapters", "integrations", "collector", "parallel", "localizer", "detector")  # where a monitor's counters live


def _sources() -> dict[str, str]:
    return {p.relative_to(PKG).as_posix(): p.read_text(encoding="utf-8")
            for side in SIDES for p in (PKG / side).rglob("*.py")}


def test_every_literal_counter_name_is_declared():
    names: dict[str, str] = {}
    for path, text in _sources().items():
        for name in re.findall(r"counters\[\"([^\"]+)\"\]", text) + re.findall(r"note_event\(\"([^\"]+)\"", text):
            names[name] = path
        for name in re.findall(r"guarded\(\s*[\w.]+,\s*\"([^\"]+)\"", text):
            names[name] = path
    assert len(names) >= 20, names  # the scan found them
    undeclared = {n: p for n, p in names.items() if n not in MONITOR_EVENTS}
    assert not undeclared, f"declare these in gradloc/records/events.py: {undeclared}"


def test_every_dynamic_counter_name_is_known_and_its_expansions_declared():
    dynamic = {(path, m) for path, text in _sources().items()
               for m in re.findall(r"counters\[f\"([^\"]+)\"\]", text) + re.findall(r"note_event\(f\"([^\"]+)\"", text)}
    assert dynamic == {("engine/spike.py", "remedy_{'applied' if remedy.applied else 'refused'}"),
                       ("integrations/held.py", "integration_{counter}")}, (
        "a new dynamic counter name: declare its expansions in gradloc/records/events.py and list it here")
    assert {"remedy_applied", "remedy_refused"} <= MONITOR_EVENTS.keys()
    sources = _sources()
    held = sources["integrations/held.py"]
    counters = set(re.findall(r"self\._count\(\"([^\"]+)\"", held))
    assert re.search(r"self\._count\(f\"\{what\}_errors\"", held)  # guard(fn, what) counts {what}_errors
    whats = {w for path, text in sources.items() if path.startswith("integrations/")
             for w in re.findall(r"\.guard\(.*?, \"([a-z_]+)\"", text, re.S)}
    assert whats >= {"rl_fields", "loss", "on_report", "layout", "close"}, whats
    counters |= {f"{w}_errors" for w in whats}
    assert counters <= INTEGRATION_COUNTERS.keys(), counters - INTEGRATION_COUNTERS.keys()
    assert {f"integration_{c}" for c in INTEGRATION_COUNTERS} <= MONITOR_EVENTS.keys()


def test_the_event_table_names_no_integration():
    """The base layer does not know the integrations: their events are the driver's, whichever one drives."""
    names = " ".join(MONITOR_EVENTS)
    for integration in ("hf", "trl", "verl", "openrlhf", "lightning", "accelerate"):
        assert not any(n.startswith(f"{integration}_") for n in MONITOR_EVENTS), integration
    assert "integration_skipped_micro_batches" in names


def test_other_is_not_a_name_and_records_carry_the_non_zero_counts_sorted():
    assert OTHER not in MONITOR_EVENTS
    c = Counter({"sink_errors": 2, "hook_errors": 1})
    c["token_errors"] += 0
    assert event_counts(c) == (("hook_errors", 1), ("sink_errors", 2))
    assert event_counts(Counter()) == ()
    assert StepRecord(job="j", rank=0, step=0, time_unix=0.0, global_norm=1.0, loss=None, micro_batches=1,
                      layers=()).events == ()
