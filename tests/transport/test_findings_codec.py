"""Findings on the wire (gradloc/transport/codec_findings.py): exact round trips inside a step, validation naming
the field (per-sample findings), bad precursor findings dropped and counted with the step kept."""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradloc.records import (
    OUTLIER_KINDS,
    SAMPLE_Z_BUCKETS,
    PrecursorDriver,
    PrecursorFinding,
    SampleInfo,
    SampleOutlier,
    SampleStats,
)
from gradloc.records.precursors import MAX_DRIVERS
from gradloc.transport.codec import BatchDecoder
from gradloc.transport.validate import RejectedBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.builders import JOB, step_record  # noqa: E402
from tests.transport.factories import assert_summary_equal, encode, to_bytes  # noqa: E402

finite = st.floats(-1e6, 1e6, allow_nan=False)
count = st.integers(0, 10_000)
opt_count = st.none() | count
text = st.text(max_size=40)


@st.composite
def outliers(draw: st.DrawFn, n: int) -> SampleOutlier:
    kind = draw(st.sampled_from(OUTLIER_KINDS))
    start = draw(opt_count)
    end = None if start is None else start + draw(count)
    return SampleOutlier(kind=kind, job=JOB, rank=1, step=n, time_unix=1.7e9 + n,
                         score=draw(st.floats(0, 1) if kind == "rl_mismatch" else finite), z=draw(finite),
                         baseline=draw(finite), micro_batch=draw(opt_count), sample=draw(opt_count),
                         sample_id=draw(st.none() | text), start=start, end=end, tokens=draw(count),
                         text=draw(st.none() | text), detail=draw(text))


@st.composite
def sample_stats(draw: st.DrawFn, n: int = 3) -> SampleStats:
    return SampleStats(judged=draw(count), unjudged=draw(count), nonfinite=draw(count),
                       z_counts=draw(st.just(()) | st.lists(count, min_size=14, max_size=14).map(tuple)),
                       z_sum=draw(finite), max_z=draw(st.none() | finite), baseline=draw(st.none() | finite),
                       flagged=draw(count), outliers=tuple(draw(st.lists(outliers(n), max_size=4))),
                       rl_mismatch_baseline=draw(st.none() | st.floats(0, 1)), rl_mismatch_streak=draw(count))


@settings(max_examples=100, deadline=None)
@given(sample_stats())
def test_samples_round_trip_inside_their_step(stats):
    rec = step_record(3, samples=stats)
    (got,) = BatchDecoder().decode(to_bytes([rec])).steps
    assert_summary_equal(got, rec)
    assert got.samples == stats


GOOD = SampleOutlier(kind="surprise", job=JOB, rank=1, step=3, time_unix=1.7e9 + 3, score=8.0, z=11.0, baseline=3.5,
                     micro_batch=0, sample=2, sample_id="u", start=0, end=64, tokens=64, text="x", detail="d")


def _rejected(stats: SampleStats, edit=None) -> RejectedBatch:
    msg, steps = encode([step_record(3, samples=stats)])
    if edit is not None:
        edit(msg.steps[0].samples)
    with pytest.raises(RejectedBatch) as info:
        BatchDecoder().decode(msg.SerializeToString())
    return info.value


@pytest.mark.parametrize("stats,edit,reason,words", [
    # (a record cannot hold an unknown kind: OutlierKind; a client of another version can send one)
    (SampleStats(outliers=(GOOD,)), lambda m: setattr(m.outliers[0], "kind", "nope"), "invalid_value",
     "outliers[0].kind"),
    (SampleStats(outliers=(replace(GOOD, z=float("nan")),)), None, "nonfinite", "outliers[0].z"),
    (SampleStats(outliers=(replace(GOOD, start=10, end=5),)), None, "invalid_value", "not a span"),
    (SampleStats(outliers=(replace(GOOD, micro_batch=-1),)), None, "invalid_value", "outliers[0].micro_batch"),
    (SampleStats(outliers=(replace(GOOD, kind="rl_mismatch", score=1.5),)), None, "invalid_value", "mismatch share"),
    (SampleStats(z_counts=(1, 2, 3)), None, "length_mismatch", "z_counts"),
    (SampleStats(z_counts=(0,) * (len(SAMPLE_Z_BUCKETS) + 1)), lambda m: m.z_counts.__setitem__(0, -1),
     "invalid_value", "z_counts[0]"),
    (SampleStats(max_z=float("inf")), None, "nonfinite", "samples.max_z"),
    (SampleStats(rl_mismatch_baseline=2.0), None, "invalid_value", "rl_mismatch_baseline"),
    (SampleStats(judged=-1), None, "invalid_value", "samples.judged"),
    (SampleStats(rl_mismatch_streak=-1), None, "invalid_value", "samples.rl_mismatch_streak"),
    (SampleStats(outliers=(replace(GOOD, text="x" * 70_000),)), None, "invalid_value", "outliers[0].text"),
])
def test_bad_findings_are_rejected_with_the_field(stats, edit, reason, words):
    err = _rejected(stats, edit)
    assert err.reason == reason and words in err.message and "steps[0].samples" in err.message


def test_too_many_outliers_are_rejected():
    err = _rejected(SampleStats(outliers=(GOOD,) * 257))
    assert err.reason == "invalid_value" and "at most 256" in err.message


# -- precursor findings (the drift detector's): a bad one is dropped and counted, never the step --------------------
def _finding(**kw) -> PrecursorFinding:
    args = dict(job=JOB, rank=1, step=3, time_unix=1.7e9 + 3, statistic="attn_entropy", layer="model.layers.1",
                head=2, trend="falling", value=0.4, baseline=1.6, z=-7.5, change=0.25, rate=3.1, since_step=1,
                pages=True, detail="attn_entropy of model.layers.1 falling",
                drivers=(PrecursorDriver(step=2, value=0.3, micro_batch=0, sample=5, position=17, sample_id="s-5",
                                         sample_info=SampleInfo(source="web", origin="web-01.jsonl:9")),
                         PrecursorDriver(step=3, value=0.35, micro_batch=1, sample=0, position=3)))
    args.update(kw)
    return PrecursorFinding(**args)


def test_precursor_findings_round_trip_inside_their_step():
    found = (_finding(), _finding(statistic="dead_experts", layer="moe.gate", head=None, trend="rising", baseline=0.0,
                                  change=float("inf"), pages=False, drivers=()))
    (got,) = BatchDecoder().decode(to_bytes([step_record(3, precursor_findings=found)])).steps
    assert got.precursor_findings == found and got.precursor_findings_dropped == 0
    assert got.precursor_findings[0].drivers[0].sample_info.origin == "web-01.jsonl:9"


def _bad_driver(field: str, value) -> Callable:  # noqa: ANN001
    return lambda m: setattr(m.drivers[0], field, value)


@pytest.mark.parametrize("edit", [
    lambda m: setattr(m, "statistic", "attn_wobble"),
    lambda m: setattr(m, "trend", "sideways"),
    lambda m: setattr(m, "z", float("nan")),
    lambda m: setattr(m, "value", float("inf")),
    lambda m: setattr(m, "baseline", float("-inf")),
    lambda m: setattr(m, "rate", float("nan")),
    lambda m: setattr(m, "change", float("nan")),
    lambda m: setattr(m, "change", float("-inf")),
    lambda m: setattr(m, "since_step", -1),
    lambda m: setattr(m, "since_step", 4),  # after its own step
    lambda m: setattr(m, "head", -1),
    lambda m: setattr(m, "layer", "x" * 1025),
    lambda m: setattr(m, "detail", "x" * 70_000),
    _bad_driver("step", -1),
    _bad_driver("step", 9),  # a driver after the finding's step
    _bad_driver("micro_batch", -1),
    _bad_driver("position", -2),
    _bad_driver("value", float("nan")),
    lambda m: m.drivers[0].sample_info.tags.add(key="", value="x"),  # an invalid provenance
], ids=lambda e: "")
def test_a_bad_precursor_finding_is_dropped_and_counted_the_step_kept(edit):
    msg, _ = encode([step_record(3, precursor_findings=(_finding(), _finding(layer="model.layers.2")))])
    edit(msg.steps[0].precursor_findings[0])
    (got,) = BatchDecoder().decode(msg.SerializeToString()).steps
    assert got.step == 3 and got.precursor_findings == (_finding(layer="model.layers.2"),)
    assert got.precursor_findings_dropped == 1


def test_at_most_64_precursor_findings_per_step_the_rest_counted():
    found = tuple(_finding(layer=f"model.layers.{i}") for i in range(70))
    (got,) = BatchDecoder().decode(to_bytes([step_record(3, precursor_findings=found)])).steps
    assert got.precursor_findings == found[:64] and got.precursor_findings_dropped == 6


def test_only_the_first_max_drivers_are_read():
    msg, _ = encode([step_record(3, precursor_findings=(_finding(),))])
    drivers = msg.steps[0].precursor_findings[0].drivers
    while len(drivers) < MAX_DRIVERS:
        drivers.add(step=3, value=1.0)
    drivers.add(step=-5)  # beyond MAX_DRIVERS: not read (a record holds no more), so not a reason to drop the finding
    (got,) = BatchDecoder().decode(msg.SerializeToString()).steps
    assert len(got.precursor_findings[0].drivers) == MAX_DRIVERS and got.precursor_findings_dropped == 0
