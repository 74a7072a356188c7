"""TelemetryState.forget: the series of ranks and jobs that ended leave /metrics, the rest stays."""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gradloc.exporters.prometheus import render
from gradloc.exporters.snapshot import JOB_KEYS, RANK_KEYS
from gradloc.exporters.state import TelemetryState
from tests.builders import columns, correlated, rl_stats, summary

JOBS, RANKS = ("ended", "running"), 3


def busy_state() -> TelemetryState:
    """Two jobs × 3 ranks with every kind of job/rank series: gauges, counters, histograms, RL
    histograms, an incident with exemplars, client drops (set cumulatively), a global-stats job."""
    state, now = TelemetryState(), time.time()
    for job in JOBS:
        for rank in range(RANKS):
            state.observe_step(summary(job, rank, 5, columns(np.linspace(0.1, 1.0, 4)), time_unix=now, rl=rl_stats()))
            state.set_cumulative("client_dropped", (job, str(rank), "queue_full"), 2)
        state.observe_incident(correlated(job, 5, ranks=(0, 1), missing=(2,)))
    state.observe_step(replace(summary("global", 0, 5, columns(np.ones(4)), time_unix=now), layers_global=True))
    state.count("records", ("step",), 13)
    return state


def series(state: TelemetryState) -> list[tuple[str, dict[str, str]]]:
    text = render(state, None)[0].decode()
    return [(s.name, s.labels) for fam in parse_text(text) for s in fam.samples]


def test_the_job_and_rank_keys_are_the_specs_with_those_labels():
    assert {"steps", "spikes", "norm_hist", "client_dropped", "global_norm", "layer_norm"} <= RANK_KEYS
    assert RANK_KEYS < JOB_KEYS and {"incidents", "probes", "rl_log_ratio", "missing_ranks"} <= JOB_KEYS - RANK_KEYS
    assert not {"records", "rejected", "ingest_lag", "pending"} & JOB_KEYS


def test_forgetting_a_rank_drops_only_its_series():
    state = busy_state()
    before = series(state)
    n = state.forget(ranks=[("ended", "1")])
    after = series(state)
    gone = [s for s in before if s not in after]
    assert n > 0 and gone, "nothing was forgotten"
    assert all(lab.get("job") == "ended" and lab.get("rank") == "1" for _, lab in gone), gone
    assert not [s for s in after if s[1].get("job") == "ended" and s[1].get("rank") == "1"]
    # the rank's gauges, counters (with the client-drop bookkeeping) and histograms were among them
    names = {name for name, _ in gone}
    assert {"gradloc_loss", "gradloc_steps_total", "gradloc_client_dropped_total", "gradloc_spikes_total",
            "gradloc_step_grad_norm_count"} <= names
    # the job's own series and the other ranks' stay
    assert ("gradloc_incidents_total", {"job": "ended", "status": "partial"}) in after
    assert any(lab == {"job": "ended", "rank": "0"} for name, lab in after if name == "gradloc_loss")
    # a rank that comes back counts from 0 (a counter reset to Prometheus), its drops too
    state.set_cumulative("client_dropped", ("ended", "1", "queue_full"), 3)
    text = render(state, None)[0].decode()
    assert 'gradloc_client_dropped_total{job="ended",rank="1",reason="queue_full"} 3.0' in text


def test_forgetting_a_job_drops_every_series_it_labels_and_nothing_else():
    state = busy_state()
    before = series(state)
    state.forget(jobs=["ended", "global"])
    after = series(state)
    assert not [s for s in after if s[1].get("job") in ("ended", "global")]
    assert [s for s in before if s[1].get("job") not in ("ended", "global")] == after
    assert any(lab.get("job") == "running" for _, lab in after)
    assert ("gradloc_agent_records_total", {"kind": "step"}) in after
    # nothing of the forgotten jobs is left inside either (exemplars, drop bookkeeping, rank points)
    assert not [k for k in (*state._counters, *state._hists, *state._exemplars) if k[1][:1] in (("ended",), ("global",))]
    assert {p.summary.job for p in state.snapshot().ranks} == {"running"}


def test_forgetting_nothing_or_unknown_names_is_harmless():
    state = busy_state()
    before = series(state)
    assert state.forget() == 0
    assert state.forget(ranks=[("nope", "0"), ("running", "7")], jobs=["nope"]) == 0
    assert series(state) == before
