"""Per-sample findings on the wire (gradloc/transport/codec_findings.py): exact round trips inside a
step, and validation naming the field."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradloc.records import OUTLIER_KINDS, SAMPLE_Z_BUCKETS, SampleOutlier, SampleStats
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
