"""The Prometheus collector: families, labels, exemplars, NaN handling, promtool lint, scrape cost."""
from __future__ import annotations

import dataclasses
import math
import re
import shutil
import subprocess
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.utils import floatToGoString

from gradloc.exporters.metric_specs import BY_KEY, SPECS
from gradloc.exporters.precursor_series import PRECURSOR_KEYS
from gradloc.exporters.prometheus import (
    GradlocCollector,
    families,
    make_registry,
    prom_unit,
    render,
)
from gradloc.exporters.snapshot import RankPoint
from gradloc.exporters.state import StateConfig, TelemetryState
from gradloc.records import GroupTokens, Remedy
from tests.builders import (
    NAN,
    TRACE_ID,
    columns,
    correlated,
    layer_names,
    precursor_findings,
    precursor_stats,
    rl_stats,
    sample_stats,
    summary,
)

OM_ACCEPT = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75," \
            "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"  # what Prometheus 2.42 sends
FORBIDDEN_LABELS = {"step", "sample", "sample_id", "token", "token_id", "text"}
JOBS, RANKS, LAYERS = ("llm-7b", "rm-1b"), 3, 40


def realistic_state() -> TelemetryState:
    """2 jobs × 3 ranks × 40 layers, a NaN layer norm, an incident with a missing rank, self-metrics."""
    state, now = TelemetryState(), time.time()
    for j, job in enumerate(JOBS):
        for rank in range(RANKS):
            norms = np.linspace(0.01, 2.0, LAYERS) * (1 + rank + j)
            if (j, rank) == (0, 1):
                norms[3] = NAN
            ratios = np.full(LAYERS, 1e-3)
            ratios[0] = NAN
            for n in (99, 100):
                state.observe_step(summary(job, rank, n, columns(norms, update_ratio=ratios), time_unix=now - 0.05,
                                        loss=None if rank == 2 else 2.5, grad_scale=65536.0 if rank == 0 else None,
                                        skipped=(n == 100 and rank == 1),
                                        shed=("update_ratio",) if (j, rank) == (1, 2) else (),
                                        rl=rl_stats() if j == 0 else None,
                                        samples=sample_stats(job, rank, n, now) if j == 0 else None,
                                        precursors=precursor_stats() if j == 0 else (),
                                        precursor_findings=precursor_findings(job, rank, n, now) if j == 0 else ()))
    state.observe_incident(correlated("llm-7b", 100, global_norm=42.0, ranks=(0, 1), missing=(2,),
                                    kinds=("grad_spike", "loss_spike"),
                                    remedy=Remedy("drop_culprits", True, 42.0, 1.5)))
    state.count("records", ("step",), 12)
    state.count("rejected", ("malformed",))
    state.count("duplicates", ("incident",))
    state.count("limited", ("incident_rate",))
    state.count("retention_deleted", ("steps_by_count",), 5)
    state.set_cumulative("client_dropped", ("llm-7b", "1", "queue_full"), 3)
    state.observe_events("llm-7b", 1, (("localize_errors", 1), ("sink_errors", 4)))
    state.observe_groups("llm-7b", (GroupTokens(kind="source", name="web", samples=4, tokens=512),))
    state.count("export_failures", ("otlp_metrics",))
    state.set_pending(2, queued=3)
    return state


def text_of(state: TelemetryState) -> str:
    return render(state, None)[0].decode()


def om_of(state: TelemetryState) -> str:
    return render(state, OM_ACCEPT)[0].decode()


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for fam in parse_text(text) for s in fam.samples if s.name == name]


# -- families and labels ----------------------------------------------------------------------

def test_one_family_per_spec_with_its_type():
    fams = families(realistic_state().snapshot())
    assert [(f.name, f.type) for f in fams] == [(s.prom, s.kind) for s in SPECS]


def test_label_names_are_the_specs_and_never_high_cardinality():
    for fam, spec in zip(families(realistic_state().snapshot()), SPECS):
        assert not FORBIDDEN_LABELS & set(spec.labels), spec.key
        for s in fam.samples:
            names = set(s.labels) - {"le"}
            assert names == set(spec.labels), (s.name, s.labels)
            assert not FORBIDDEN_LABELS & set(s.labels), s


def test_every_family_with_data_has_samples():
    """The realistic state touches these keys; an exporter that forgot one would leave it empty."""
    fams = {f.name: f for f in families(realistic_state().snapshot())}
    expected_empty = {"gradloc_agent_series_dropped", "gradloc_export_dropped"}
    empty = {name for name, f in fams.items() if not f.samples}
    assert empty == expected_empty


def test_counters_end_in_total_in_the_text_format():
    text = text_of(realistic_state())
    typed = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    counters = {name for name, kind in typed.items() if kind == "counter"}
    assert counters == {s.prom_sample for s in SPECS if s.kind == "counter"}
    assert all(name.endswith("_total") for name in counters)
    sample_names = set(re.findall(r"^(gradloc_\w+)[{ ]", text, re.MULTILINE))
    assert {"gradloc_steps_total", "gradloc_incidents_total", "gradloc_client_dropped_total"} <= sample_names
    assert not {n for n in sample_names if n.endswith("_created")}


def test_per_rank_and_per_layer_values():
    text = text_of(realistic_state())
    norms = {(lab["job"], lab["rank"], lab["layer"]): v for lab, v in samples(text, "gradloc_grad_norm")}
    shed = {(lab["job"], lab["rank"], lab["feature"]): v for lab, v in samples(text, "gradloc_shed")}
    assert len(shed) == len(JOBS) * RANKS * 2  # every known feature, 0 or 1: a bounded, always-present set
    assert shed[(JOBS[1], "2", "update_ratio")] == 1.0 and shed[(JOBS[1], "2", "layer_breakdown")] == 0.0
    assert sum(shed.values()) == 1.0
    assert {v for _, v in samples(text, "gradloc_overhead_ratio")} == {0.03}
    loc = {(lab["job"], lab["status"]): v for lab, v in samples(text, "gradloc_localizations_total")}
    assert loc == {("llm-7b", "located"): 2.0}  # one per reporting rank's finding
    rem = {(lab["action"], lab["applied"]): v for lab, v in samples(text, "gradloc_remedies_total")}
    assert rem == {("drop_culprits", "true"): 2.0}
    classes = {(lab["job"], lab["class"]): v for lab, v in samples(text, "gradloc_incident_classes_total")}
    assert classes == {("llm-7b", "train_inference_mismatch"): 2.0}
    # RL: gauges for the ranks that sent RL fields only, histograms from the trainers' bucket counts
    ratio = {(lab["job"], lab["rank"], lab["reference"]): v for lab, v in samples(text, "gradloc_rl_max_abs_log_ratio")}
    assert ratio == {(JOBS[0], str(r), ref): v for r in range(RANKS) for ref, v in (("rollout", 0.3), ("old", 0.9))}
    assert {v for _, v in samples(text, "gradloc_rl_clipped_ratio")} == {0.05}
    assert {v for _, v in samples(text, "gradloc_rl_entropy")} == {1.7}
    buckets = {lab["le"]: v for lab, v in samples(text, "gradloc_rl_log_ratio_bucket") if lab["job"] == JOBS[0]}
    # 3 ranks × 2 steps × 100 tokens, all in (0, 0.01]
    assert buckets["0.0"] == 0 and buckets["0.01"] == 600 and buckets["+Inf"] == 600
    adv = {lab["le"]: v for lab, v in samples(text, "gradloc_rl_advantage_bucket")}
    assert adv["1.0"] == adv["+Inf"] == 600
    # negative buckets: no _sum and no _count (OpenMetrics); the count is the +Inf bucket
    assert not samples(text, "gradloc_rl_advantage_sum") and not samples(text, "gradloc_rl_advantage_count")
    assert len(norms) == len(JOBS) * RANKS * LAYERS
    assert norms[("rm-1b", "2", "model.layers.39.mlp.down_proj")] == pytest.approx(2.0 * 4)
    assert samples(text, "gradloc_step") and {v for _, v in samples(text, "gradloc_step")} == {100.0}
    steps = {(lab["job"], lab["rank"]): v for lab, v in samples(text, "gradloc_steps_total")}
    assert steps == {(job, str(r)): 2.0 for job in JOBS for r in range(RANKS)}
    skipped = {(lab["job"], lab["rank"]): v for lab, v in samples(text, "gradloc_skipped_steps_total")}
    assert skipped == {(job, "1"): 1.0 for job in JOBS}
    assert samples(text, "gradloc_nonfinite_steps_total") == [({"job": "llm-7b", "rank": "1"}, 2.0)]
    assert samples(text, "gradloc_client_dropped_total") == [
        ({"job": "llm-7b", "rank": "1", "reason": "queue_full"}, 3.0)]
    assert samples(text, "gradloc_agent_pending_correlations") == [({}, 2.0)]
    assert samples(text, "gradloc_agent_queue_depth") == [({}, 3.0)]
    assert samples(text, "gradloc_token_top_share_ratio")[0][1] == 0.25


def test_nan_norm_is_rendered_and_unknown_ratio_and_missing_loss_are_left_out():
    text = text_of(realistic_state())
    assert re.search(r'^gradloc_grad_norm\{job="llm-7b",layer="model\.layers\.3\.mlp\.down_proj",rank="1"\} NaN$',
                     text, re.MULTILINE)
    ratios = samples(text, "gradloc_update_ratio")
    assert len(ratios) == len(JOBS) * RANKS * (LAYERS - 1)
    assert "model.layers.0.mlp.down_proj" not in {lab["layer"] for lab, _ in ratios}
    assert {lab["rank"] for lab, _ in samples(text, "gradloc_loss")} == {"0", "1"}
    assert {lab["rank"] for lab, _ in samples(text, "gradloc_amp_grad_scale")} == {"0"}
    nonfinite = {(lab["job"], lab["rank"]): v for lab, v in samples(text, "gradloc_grad_nonfinite_elements")}
    assert nonfinite[("llm-7b", "1")] == 1.0 and nonfinite[("llm-7b", "0")] == 0.0


def test_nan_global_norm_is_rendered():
    state = TelemetryState()
    state.observe_step(summary("j", 0, 1, columns([NAN, 1.0]), time_unix=time.time(), global_norm=NAN))
    (labels, value), = samples(text_of(state), "gradloc_grad_global_norm")
    assert labels == {"job": "j", "rank": "0"} and math.isnan(value)


def test_only_the_first_layers_exported_get_series():
    state = TelemetryState(StateConfig(max_layers=5))
    state.observe_step(summary("j", 0, 1, columns(np.ones(12)), time_unix=time.time()))
    text = text_of(state)
    for name in ("gradloc_grad_norm", "gradloc_grad_max_abs", "gradloc_update_ratio"):
        assert [lab["layer"] for lab, _ in samples(text, name)] == list(layer_names(5)), name
    assert samples(text, "gradloc_agent_series_dropped_total") == [({"reason": "max_layers"}, 1.0)]


# -- histograms -------------------------------------------------------------------------------

def test_histogram_buckets_are_cumulative_with_sum_and_count():
    state = TelemetryState()
    for norm in (0.5, 2.0, 2.0, 5e4):
        state.observe_step(summary("j", 0, 1, columns([1.0]), time_unix=time.time(), global_norm=norm))
    text = text_of(state)
    buckets = {lab["le"]: v for lab, v in samples(text, "gradloc_step_grad_norm_bucket")}
    assert list(buckets) == [floatToGoString(b) for b in BY_KEY["norm_hist"].buckets] + ["+Inf"]
    assert buckets["0.316"] == 0 and buckets["1.0"] == 1 and buckets["3.16"] == 3 and buckets["10000.0"] == 3
    assert buckets["+Inf"] == 4
    assert samples(text, "gradloc_step_grad_norm_count") == [({"job": "j", "rank": "0"}, 4.0)]
    assert samples(text, "gradloc_step_grad_norm_sum")[0][1] == pytest.approx(50004.5)


# -- exemplars --------------------------------------------------------------------------------

def test_openmetrics_carries_the_incident_trace_id_as_exemplar():
    om = om_of(realistic_state())
    line = next(ln for ln in om.splitlines() if ln.startswith("gradloc_incidents_total"))
    assert line.startswith(f'gradloc_incidents_total{{job="llm-7b",status="partial"}} 1.0 '
                           f'# {{trace_id="{TRACE_ID}"}} 1.0 ')
    exemplars = {(s.name, s.labels.get("kind"), s.labels.get("le")): s.exemplar
                 for fam in parse_openmetrics(om) for s in fam.samples if s.exemplar}
    assert {k[0] for k in exemplars} == {"gradloc_incidents_total", "gradloc_spikes_total",
                                         "gradloc_step_grad_norm_bucket"}
    assert all(e.labels == {"trace_id": TRACE_ID} for e in exemplars.values())
    assert {k[1] for k in exemplars if k[0] == "gradloc_spikes_total"} == {"grad_spike", "loss_spike"}
    # The norm histogram's exemplar sits in the bucket of the incident's global norm (42 → le=100).
    assert {k[2] for k in exemplars if k[0] == "gradloc_step_grad_norm_bucket"} == {"100.0"}


def test_text_format_has_no_exemplars():
    assert "trace_id" not in text_of(realistic_state())


def test_openmetrics_is_valid_for_a_strict_parser():
    """prometheus_client's OpenMetrics parser checks UNIT suffixes, bucket order, _count = +Inf, EOF."""
    fams = {f.name: f for f in parse_openmetrics(om_of(realistic_state()))}
    assert fams["gradloc_token_top_share_ratio"].unit == "ratio"
    assert fams["gradloc_agent_ingest_lag_seconds"].unit == "seconds"
    assert fams["gradloc_grad_norm"].unit == ""
    assert {f.name for f in fams.values()} == {s.prom for s in SPECS}


def test_units_are_declared_only_where_the_name_ends_with_them():
    for spec in SPECS:
        unit = prom_unit(spec)
        assert not unit or spec.prom.endswith("_" + unit), spec
    assert prom_unit(BY_KEY["record_time"]) == "seconds" and prom_unit(BY_KEY["global_norm"]) == ""


# -- odd data ---------------------------------------------------------------------------------

def test_empty_state_renders_in_both_formats():
    state = TelemetryState()
    text, om = text_of(state), om_of(state)
    assert samples(text, "gradloc_agent_pending_correlations") == [({}, 0.0)]
    assert samples(text, "gradloc_agent_queue_depth") == [({}, 0.0)]
    assert len([s for fam in parse_text(text) for s in fam.samples]) == 2  # the agent's own two gauges
    assert om.endswith("# EOF\n") and len(list(parse_openmetrics(om))) == len(SPECS)


def test_odd_data_never_raises_and_labels_stay_valid():
    state = TelemetryState()
    odd = ("a\ud800b", 'quote"back\\slash\nnewline', "dup", "dup", "")  # lone surrogate, escapes, dupes
    cols = columns([1.0, math.inf, NAN, 2.0, 3.0], names=odd, update_ratio=[NAN] * 5)
    state.observe_step(summary("", 0, 1, cols, time_unix=time.time(), global_norm=math.inf, tokens=False))
    with pytest.raises(ValueError, match="label value"):
        state.count("rejected")  # fewer label values than the spec: refused, not padded
    with pytest.raises(ValueError, match="no_such_metric"):
        state.count("no_such_metric", ("x",))  # a key without a spec
    state.observe_incident(correlated("", 1, trace_id="", global_norm=NAN, ranks=()))
    text, om = text_of(state), om_of(state)
    layers = [lab["layer"] for lab, _ in samples(text, "gradloc_grad_norm")]
    assert layers == ["a?b", 'quote"back\\slash\nnewline', "dup", ""]
    assert samples(text, "gradloc_agent_rejected_total") == []
    assert "no_such_metric" not in text and "trace_id" not in om
    assert len(list(parse_openmetrics(om))) == len(SPECS)


# -- registry, negotiation, one snapshot per scrape ------------------------------------------

class CountingState(TelemetryState):
    def __init__(self) -> None:
        super().__init__()
        self.snapshots = 0

    def snapshot(self, now=None, reader=None):
        self.snapshots += 1
        return super().snapshot(now, reader)


def test_one_snapshot_per_scrape_and_none_at_registration():
    state = CountingState()
    registry = make_registry(state)
    assert state.snapshots == 0 and registry is not REGISTRY
    render(registry, None)
    render(registry, OM_ACCEPT)
    assert state.snapshots == 2


def test_registering_twice_is_a_name_clash():
    registry = make_registry(TelemetryState())
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(GradlocCollector(TelemetryState()))


@pytest.mark.parametrize("accept, content_type", [
    (None, "text/plain; version=0.0.4; charset=utf-8"),
    ("text/plain", "text/plain; version=0.0.4; charset=utf-8"),
    (OM_ACCEPT, "application/openmetrics-text; version=1.0.0; charset=utf-8"),
])
def test_content_negotiation(accept, content_type):
    body, ctype = render(realistic_state(), accept)
    assert ctype.startswith(content_type)
    assert body.endswith(b"# EOF\n") == ctype.startswith("application/openmetrics-text")


# -- promtool ---------------------------------------------------------------------------------

def promtool(body: str) -> tuple[int, list[str]]:
    exe = shutil.which("promtool") or "/usr/bin/promtool"
    if not shutil.which(exe):
        pytest.fail("promtool not found: run scripts/setup.sh (installs Debian's prometheus 2.42)", pytrace=False)
    proc = subprocess.run([exe, "check", "metrics"], input=body.encode(), capture_output=True, timeout=60,
                          check=False)
    return proc.returncode, (proc.stdout + proc.stderr).decode().splitlines()


def test_promtool_accepts_the_text_format():
    assert promtool(text_of(realistic_state())) == (0, [])


def test_promtool_on_the_openmetrics_format():
    """promtool 2.42 lints with the classic text parser: it cannot read exemplars (the exemplar syntax
    is checked by the strict parser above and by a real Prometheus in the integration test), and it
    reads an OpenMetrics counter's ``_total`` sample as a family without HELP. With exemplars
    stripped, those HELP lines are the only complaints it may have."""
    om = om_of(realistic_state())
    rc, lines = promtool(om)
    assert rc != 0 and any("timestamp" in ln for ln in lines)  # the exemplar; if this changes, tighten below
    stripped = re.sub(r" # \{[^}]*\} \S+( \S+)?$", "", om, flags=re.MULTILINE)
    assert "trace_id" not in stripped
    counters_with_samples = {s.name for fam in parse_openmetrics(om) if fam.type == "counter" for s in fam.samples}
    rc, lines = promtool(stripped)
    assert sorted(lines) == sorted(f"{name} no help text" for name in counters_with_samples)


# -- cost -------------------------------------------------------------------------------------

@pytest.mark.wallclock  # asserts a wall-clock bound (tests/conftest.py: never beside a multi-process test)
def test_scrape_of_8_ranks_by_256_layers_is_fast():
    state = TelemetryState()
    rng = np.random.default_rng(0)
    for rank in range(8):
        state.observe_step(summary("llm-70b", rank, 1, columns(rng.lognormal(size=256)), time_unix=time.time()))
    registry = make_registry(state)
    timings = {}
    for accept in (None, OM_ACCEPT):
        render(registry, accept)  # warm-up
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            body, _ = render(registry, accept)
            best = min(best, time.perf_counter() - t0)
        timings[accept] = best
        assert body.count(b"\ngradloc_grad_norm{") == 8 * 256
    print(f"scrape 8x256: text {timings[None] * 1e3:.1f} ms, openmetrics {timings[OM_ACCEPT] * 1e3:.1f} ms")
    assert max(timings.values()) < 0.5


def test_a_malformed_rank_point_is_skipped_not_fatal(caplog):
    good = TelemetryState()
    good.observe_step(summary("j", 1, 1, columns([1.0, 2.0]), time_unix=time.time()))
    snap = good.snapshot()
    bad = RankPoint(dataclasses.replace(snap.ranks[0].summary, rank=0, layers=None), time.time(), 2)
    fams = {f.name: f for f in families(dataclasses.replace(snap, ranks=(bad, *snap.ranks)))}
    assert {s.labels["rank"] for s in fams["gradloc_grad_norm"].samples} == {"1"}
    assert {s.labels["rank"] for s in fams["gradloc_grad_global_norm"].samples} == {"1"}  # none half-added
    assert "skipped a malformed RankPoint" in caplog.text


# -- a job whose layer statistics are global (DDP, FSDP2, ZeRO) ---------------------------------

def _global_job_state(world: int = 4, layers: int = 6) -> TelemetryState:
    """``world`` ranks sending the same job-level layer columns (``layers_global``), own losses."""
    state, now = TelemetryState(), time.time()
    norms = np.linspace(0.1, 1.0, layers)
    for rank in range(world):
        s = dataclasses.replace(summary("ddp", rank, 7, columns(norms), time_unix=now, loss=2.0 + rank),
                                layers_global=True)
        state.observe_step(s)
    return state


def test_global_layer_series_are_exported_once_per_job_with_rank_job():
    """W ranks × L layers of identical numbers would be W-fold cardinality: the layer series, the
    global norm and its histogram come once, from rank 0, as rank="job"; each rank keeps its own
    loss, token, overhead and shed series."""
    world, layers = 4, 6
    text = text_of(_global_job_state(world, layers))
    norms = samples(text, "gradloc_grad_norm")
    assert len(norms) == layers and {lab["rank"] for lab, _ in norms} == {"job"}
    assert {lab["rank"] for lab, _ in samples(text, "gradloc_update_ratio")} == {"job"}
    assert [lab["rank"] for lab, _ in samples(text, "gradloc_grad_global_norm")] == ["job"]
    # every rank judged the job's norm: the detector's band is the job's too
    assert samples(text, "gradloc_detector_norm_mean") == [({"job": "ddp", "rank": "job"}, 1.2)]
    assert samples(text, "gradloc_detector_norm_threshold") == [({"job": "ddp", "rank": "job"}, 2.0)]
    assert {lab["rank"]: v for lab, v in samples(text, "gradloc_loss")} == {str(r): 2.0 + r for r in range(world)}
    assert {lab["rank"] for lab, _ in samples(text, "gradloc_overhead_ratio")} == {str(r) for r in range(world)}
    assert {lab["rank"] for lab, _ in samples(text, "gradloc_shed")} == {str(r) for r in range(world)}
    counts = samples(text, "gradloc_step_grad_norm_count")
    assert [(lab["rank"], v) for lab, v in counts] == [("job", 1.0)]  # observed once, not W times
    assert {lab["rank"] for lab, _ in samples(text, "gradloc_steps_total")} == {str(r) for r in range(world)}
    # The same job with per-rank statistics (no wrapper): W × L layer series, as before.
    state = TelemetryState()
    for rank in range(world):
        state.observe_step(summary("plain", rank, 7, columns(np.ones(layers)), time_unix=time.time()))
    assert len(samples(text_of(state), "gradloc_grad_norm")) == world * layers


def test_precursor_series_per_module_head_and_expert_and_bounded():
    text = text_of(realistic_state())
    logits = {(lab["job"], lab["rank"], lab["layer"]): v for lab, v in samples(text, "gradloc_attention_max_logit")}
    assert logits[(JOBS[0], "0", "blocks.1.attn")] == 5.0 and len(logits) == 2 * RANKS  # job 0's ranks only
    heads = {(lab["layer"], lab["head"]): v for lab, v in samples(text, "gradloc_attention_head_entropy_nats")
             if (lab["job"], lab["rank"]) == (JOBS[0], "1")}
    assert heads == {("blocks.0.attn", "0"): 1.6, ("blocks.0.attn", "1"): 2.6, ("blocks.1.attn", "0"): 1.6,
                     ("blocks.1.attn", "1"): 2.6}
    loads = {lab["expert"]: v for lab, v in samples(text, "gradloc_expert_load_ratio")
             if (lab["job"], lab["rank"]) == (JOBS[0], "0")}
    assert loads == {"0": 0.5, "1": 0.8, "2": 1.1, "3": pytest.approx(1.4)}
    assert [v for lab, v in samples(text, "gradloc_output_logsumexp_squared") if lab["rank"] == "2"] == [30.0]
    # the state's layer bound holds for precursor series too: the rest are dropped and counted
    state = TelemetryState(StateConfig(max_layers=3))
    state.observe_step(summary("j", 0, 1, columns([1.0]), time_unix=time.time(), precursors=precursor_stats()))
    text = text_of(state)
    exported = sum(len(samples(text, s.prom)) for s in SPECS if s.key in PRECURSOR_KEYS)
    assert exported == 3
    assert [v for lab, v in samples(text, "gradloc_agent_series_dropped_total") if lab["reason"] == "max_layers"] == [1.0]
