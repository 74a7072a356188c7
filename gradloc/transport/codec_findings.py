"""Findings on the wire, inside a ``pb.Step``: per-sample findings (``SampleStats`` ↔ ``pb.SampleStatsMsg``) and the
drift detector's precursor findings (``PrecursorFinding`` ↔ ``pb.PrecursorFindingMsg``).

A finding's job, rank, step and time are its step's, so they are not sent again. Validation follows
:mod:`gradloc.transport.validate`: counts >= 0, every float finite (a finding is judged only on
finite surprises and shares), kinds from :data:`~gradloc.records.OUTLIER_KINDS`, spans with
0 <= start <= end, a mismatch share in [0, 1], bounded strings and at most :data:`MAX_OUTLIERS`
outliers per step; a bad outlier rejects the batch. A bad precursor finding (an unknown statistic or trend, a
non-finite value, a drift that starts after its step, a bad driver …) is dropped and counted instead, the step
kept, like the precursor statistics beside it (codec_lists.py), and so is every valid one after the first
:data:`MAX_PRECURSOR_FINDINGS`.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from gradloc.records import OUTLIER_KINDS, SAMPLE_Z_BUCKETS, PrecursorDriver, PrecursorFinding, SampleOutlier, SampleStats
from gradloc.records.precursors import MAX_DRIVERS, STATISTICS, Trend
from gradloc.transport import validate as v
from gradloc.transport.codec_incidents import encode_info
from gradloc.transport.decode_incidents import decode_info
from gradloc.transport.wire import pb

MAX_OUTLIERS = 256  # per step (the trainer sends at most SampleConfig.max_outliers + 1)
MAX_PRECURSOR_FINDINGS = 64  # precursor findings of one step kept (the rest are dropped and counted)
_TRENDS = tuple(t.value for t in Trend)
log = logging.getLogger(__name__)
_OPTIONAL_INTS = ("micro_batch", "sample", "start", "end")


def encode_samples(s: SampleStats, out: pb.SampleStatsMsg) -> None:
    out.judged, out.unjudged, out.nonfinite, out.flagged = s.judged, s.unjudged, s.nonfinite, s.flagged
    out.rl_mismatch_streak = s.rl_mismatch_streak
    out.z_counts.extend(s.z_counts)
    out.z_sum = s.z_sum
    for name in ("max_z", "baseline", "rl_mismatch_baseline"):
        if getattr(s, name) is not None:
            setattr(out, name, getattr(s, name))
    for o in s.outliers:
        m = out.outliers.add(kind=o.kind, score=o.score, z=o.z, baseline=o.baseline, tokens=o.tokens, detail=o.detail)
        for name in (*_OPTIONAL_INTS, "sample_id", "text"):
            if getattr(o, name) is not None:
                setattr(m, name, getattr(o, name))
        if o.sample_info is not None:
            m.sample_info.CopyFrom(encode_info(o.sample_info))


def decode_samples(m: pb.SampleStatsMsg, job: str, rank: int, step: int, time_unix: float,
                   where: str) -> SampleStats:
    """A validated SampleStats; raises :class:`~gradloc.transport.validate.RejectedBatch`."""
    counts = tuple(m.z_counts)
    if counts and len(counts) != len(SAMPLE_Z_BUCKETS) + 1:
        raise v.reject("length_mismatch", f"{where}.z_counts has {len(counts)} counts, expected "
                                          f"{len(SAMPLE_Z_BUCKETS) + 1} (or none)")
    for i, c in enumerate(counts):
        v.count(c, f"{where}.z_counts[{i}]")
    if len(m.outliers) > MAX_OUTLIERS:
        raise v.reject("invalid_value", f"{where}.outliers has {len(m.outliers)} entries (at most {MAX_OUTLIERS})")
    share = m.rl_mismatch_baseline if m.HasField("rl_mismatch_baseline") else None
    if share is not None and not (v.finite(share, f"{where}.rl_mismatch_baseline") >= 0 and share <= 1):
        raise v.reject("invalid_value", f"{where}.rl_mismatch_baseline is {share!r} (a share: must be in [0, 1])")
    outliers = tuple(_outlier(o, job, rank, step, time_unix, f"{where}.outliers[{i}]") for i, o in enumerate(m.outliers))
    return SampleStats(
        judged=v.count(m.judged, f"{where}.judged"), unjudged=v.count(m.unjudged, f"{where}.unjudged"),
        nonfinite=v.count(m.nonfinite, f"{where}.nonfinite"), z_counts=counts, z_sum=v.finite(m.z_sum, f"{where}.z_sum"),
        max_z=v.finite(m.max_z, f"{where}.max_z") if m.HasField("max_z") else None,
        baseline=v.finite(m.baseline, f"{where}.baseline") if m.HasField("baseline") else None,
        flagged=v.count(m.flagged, f"{where}.flagged"), outliers=outliers, rl_mismatch_baseline=share,
        rl_mismatch_streak=v.count(m.rl_mismatch_streak, f"{where}.rl_mismatch_streak"))


def _outlier(o: pb.SampleOutlierMsg, job: str, rank: int, step: int, time_unix: float, where: str) -> SampleOutlier:
    if o.kind not in OUTLIER_KINDS:
        raise v.reject("invalid_value", f"{where}.kind is {v.text(o.kind, where + '.kind')!r} (one of {list(OUTLIER_KINDS)})")
    ints = {name: v.count(getattr(o, name), f"{where}.{name}") if o.HasField(name) else None for name in _OPTIONAL_INTS}
    if (ints["start"] is None) != (ints["end"] is None) or (ints["start"] is not None and ints["end"] < ints["start"]):
        raise v.reject("invalid_value", f"{where}: start {ints['start']} and end {ints['end']} are not a span "
                                        "(both or neither, start <= end)")
    score = v.finite(o.score, f"{where}.score")
    if o.kind == "rl_mismatch" and not 0 <= score <= 1:
        raise v.reject("invalid_value", f"{where}.score is {score!r} (a mismatch share: must be in [0, 1])")
    return SampleOutlier(
        kind=o.kind, job=job, rank=rank, step=step, time_unix=time_unix, score=score, z=v.finite(o.z, f"{where}.z"),
        baseline=v.finite(o.baseline, f"{where}.baseline"), **ints,
        sample_id=v.text(o.sample_id, f"{where}.sample_id") if o.HasField("sample_id") else None,
        tokens=v.count(o.tokens, f"{where}.tokens"),
        text=v.text(o.text, f"{where}.text", v.MAX_TEXT) if o.HasField("text") else None,
        detail=v.text(o.detail, f"{where}.detail", v.MAX_TEXT),
        sample_info=decode_info(o.sample_info, f"{where}.sample_info") if o.HasField("sample_info") else None)


# -- precursor findings (the drift detector's, StepRecord.precursor_findings) --------------------------------------
def encode_precursor_findings(findings: Sequence[PrecursorFinding], out: pb.Step) -> None:
    for f in findings:
        m = out.precursor_findings.add(statistic=f.statistic, layer=f.layer, trend=str(f.trend), value=f.value,
                                       baseline=f.baseline, z=f.z, change=f.change, rate=f.rate,
                                       since_step=f.since_step, pages=f.pages, detail=f.detail)
        if f.head is not None:
            m.head = f.head
        for d in f.drivers:
            dm = m.drivers.add(step=d.step, value=d.value, micro_batch=d.micro_batch, sample=d.sample,
                               position=d.position)
            if d.sample_id is not None:
                dm.sample_id = d.sample_id
            if d.sample_info is not None:
                dm.sample_info.CopyFrom(encode_info(d.sample_info))
            if d.rank is not None:
                dm.rank = d.rank


def precursor_findings_of(m: pb.Step, job: str, rank: int, step: int,
                          time_unix: float) -> tuple[tuple[PrecursorFinding, ...], int]:
    """The step's valid precursor findings (at most MAX_PRECURSOR_FINDINGS) and how many entries were dropped."""
    kept: list[PrecursorFinding] = []
    for i, f in enumerate(m.precursor_findings):
        if len(kept) == MAX_PRECURSOR_FINDINGS:
            break
        try:
            kept.append(_precursor_finding(f, job, rank, step, time_unix, f"precursor_findings[{i}]"))
        except ValueError as exc:  # RejectedBatch (a ValueError) from the checks, or the record's own: dropped, counted
            log.debug("gradloc: a precursor finding dropped: %s", exc)
    return tuple(kept), len(m.precursor_findings) - len(kept)


def _precursor_finding(f: pb.PrecursorFindingMsg, job: str, rank: int, step: int, time_unix: float,
                       where: str) -> PrecursorFinding:
    if f.statistic not in STATISTICS or f.trend not in _TRENDS:
        raise v.reject("invalid_value", f"{where}: unknown statistic or trend")
    if not 0 <= f.since_step <= step:
        raise v.reject("invalid_value", f"{where}.since_step is {f.since_step}, outside [0, step {step}]")
    if math.isnan(f.change) or f.change == -math.inf:  # +inf: a drift from a zero baseline
        raise v.reject("nonfinite", f"{where}.change is {f.change!r}")
    return PrecursorFinding(
        job=job, rank=rank, step=step, time_unix=time_unix, statistic=f.statistic,
        layer=v.text(f.layer, f"{where}.layer"), head=v.count(f.head, f"{where}.head") if f.HasField("head") else None,
        trend=Trend(f.trend), value=v.finite(f.value, f"{where}.value"), baseline=v.finite(f.baseline, f"{where}.baseline"),
        z=v.finite(f.z, f"{where}.z"), change=f.change, rate=v.finite(f.rate, f"{where}.rate"), since_step=f.since_step,
        pages=f.pages, detail=v.text(f.detail, f"{where}.detail", v.MAX_TEXT),
        drivers=tuple(_driver(d, step, f"{where}.drivers[{j}]") for j, d in enumerate(f.drivers[:MAX_DRIVERS])))


def _driver(d: pb.PrecursorDriverMsg, step: int, where: str) -> PrecursorDriver:
    if not 0 <= d.step <= step:
        raise v.reject("invalid_value", f"{where}.step is {d.step}, outside [0, step {step}]")
    return PrecursorDriver(
        step=d.step, value=v.finite(d.value, f"{where}.value"), micro_batch=v.count(d.micro_batch, f"{where}.micro_batch"),
        sample=v.count(d.sample, f"{where}.sample"), position=v.count(d.position, f"{where}.position"),
        sample_id=v.text(d.sample_id, f"{where}.sample_id") if d.HasField("sample_id") else None,
        sample_info=decode_info(d.sample_info, f"{where}.sample_info") if d.HasField("sample_info") else None,
        rank=v.count(d.rank, f"{where}.rank") if d.HasField("rank") else None)
