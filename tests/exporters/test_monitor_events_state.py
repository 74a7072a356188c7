"""gradloc_monitor_events_total: the monitor's cumulative event counts per (job, rank, event), a closed label set."""
from __future__ import annotations

import re
import time

import numpy as np
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gradloc.exporters.metric_specs import BY_KEY
from gradloc.exporters.prometheus import render
from gradloc.exporters.state import TelemetryState
from gradloc.records.events import MAX_EVENT_NAME, MONITOR_EVENTS, OTHER, event_label, labelled
from tests.builders import columns, summary

NAME = "gradloc_monitor_events_total"


def events_of(state: TelemetryState) -> dict[tuple[str, str, str], float]:
    text = render(state, None)[0].decode()
    return {(s.labels["job"], s.labels["rank"], s.labels["event"]): s.value
            for fam in parse_text(text) for s in fam.samples if s.name == NAME}


def test_the_spec_is_a_counter_labelled_by_job_rank_and_event():
    spec = BY_KEY["monitor_events"]
    assert (spec.prom_sample, spec.otel, spec.kind, spec.unit) == (NAME, "gradloc.monitor.events", "counter", "{event}")
    assert spec.labels == ("job", "rank", "event") and spec.help


def test_the_declared_names_are_bounded_label_values():
    assert OTHER not in MONITOR_EVENTS and len(MONITOR_EVENTS) < 64
    for name, meaning in MONITOR_EVENTS.items():
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name) and len(name) <= MAX_EVENT_NAME, name
        assert meaning and "\n" not in meaning, name
    assert event_label("probe_errors") == "probe_errors" and event_label("step_1234_failed") == OTHER
    assert labelled([("probe_errors", 2), ("x", 1), ("y", 4)]) == {"probe_errors": 2, OTHER: 5}


def test_declared_names_are_labels_and_the_rest_are_summed_into_other():
    state = TelemetryState()
    state.observe_events("job", 3, (("hook_errors", 7), ("sample-42", 1), ("custom_thing", 2)))
    assert events_of(state) == {("job", "3", "hook_errors"): 7.0, ("job", "3", OTHER): 3.0}


def test_counts_are_cumulative_and_a_restarted_trainer_never_makes_them_go_down():
    state = TelemetryState()
    for n in (1, 4, 4, 6):  # the same cumulative count, re-sent with every record
        state.observe_events("job", 0, (("probe_errors", n),))
    assert events_of(state) == {("job", "0", "probe_errors"): 6.0}
    state.observe_events("job", 0, (("probe_errors", 2),))  # the trainer restarted: its count restarted
    assert events_of(state) == {("job", "0", "probe_errors"): 8.0}
    state.observe_events("job", 0, (("probe_errors", 5),))
    assert events_of(state) == {("job", "0", "probe_errors"): 11.0}


def test_entries_the_wire_refused_are_counted_and_forgetting_a_rank_drops_its_events():
    state = TelemetryState()
    state.observe_step(summary("job", 0, 1, columns(np.ones(2)), time_unix=time.time()))
    state.observe_events("job", 0, (("left_job", 1),), dropped=2)
    state.observe_events("job", 1, (("left_job", 1),))
    text = render(state, None)[0].decode()
    assert 'gradloc_agent_series_dropped_total{reason="monitor_events"} 2.0' in text
    state.forget(ranks=[("job", "0")])
    assert events_of(state) == {("job", "1", "left_job"): 1.0}
