"""Step records on the wire: StepRecord → ``pb.Step`` (trainer) and ``pb.Step`` → StepSummary (daemon).

Per-layer statistics travel as columns (one packed ``repeated double`` per statistic) and the layer
names as a separately sent, content-addressed table, so a 256-layer step costs six memcpy-like
array decodes on the daemon instead of 256 Python objects, and no names after the first batch.
Token statistics (top-k scores with their per-layer shares) are columns as well; the shares name
layers by index into the step's table (names it lacks go into ``extra_layers``).
"""
from __future__ import annotations

import itertools
import math
from typing import NoReturn

import numpy as np

from gradloc.records import (
    RL_ADVANTAGE_BUCKETS,
    RL_LOG_RATIO_BUCKETS,
    LayerShare,
    RLStats,
    StepRecord,
    TokenScore,
    TokenStats,
)
from gradloc.reports import LayerColumns, StepSummary
from gradloc.transport import validate as v
from gradloc.transport.codec_findings import (
    decode_samples,
    encode_precursor_findings,
    encode_samples,
    precursor_findings_of,
)
from gradloc.transport.codec_lists import events_of, groups_of, precursors_of
from gradloc.transport.wire import pb

_NAN = float("nan")
_FLOAT_COLUMNS = ("grad_norm", "grad_max_abs", "param_norm")
_INT_COLUMNS = ("layer_nonfinite", "numel")
_MAX_SHED = 8
_GRAD_EVENT = " but the step's nonfinite count is 0 (accepted only with a nonfinite count > 0)"


# -- encode (trainer side, background thread) --------------------------------------------------
def encode_step(rec: StepRecord, table_id: int, index: dict[str, int], job: str, rank: int) -> pb.Step:
    """``index`` maps the step's layer names to their table positions; ``job``/``rank`` are the
    client's (sent only where the record differs from them)."""
    ls = rec.layers
    m = pb.Step(step=rec.step, time_unix=rec.time_unix, global_norm=rec.global_norm,
                micro_batches=rec.micro_batches, nonfinite=rec.nonfinite, skipped=rec.skipped,
                layer_table_id=table_id,
                grad_norm=[s.grad_norm for s in ls], grad_max_abs=[s.grad_max_abs for s in ls],
                layer_nonfinite=[s.nonfinite for s in ls], param_norm=[s.param_norm for s in ls],
                numel=[s.numel for s in ls])
    if any(s.update_ratio is not None for s in ls):
        m.update_ratio.extend([_NAN if s.update_ratio is None else s.update_ratio for s in ls])
    if rec.job != job:
        m.job = rec.job
    if rec.rank != rank:
        m.rank = rec.rank
    if rec.loss is not None:
        m.loss = rec.loss
    if rec.grad_scale is not None:
        m.grad_scale = rec.grad_scale
    if rec.tokens is not None:
        _encode_tokens(rec.tokens, index, m.tokens)
    for field, value in (("overhead_seconds", rec.overhead_s), ("step_seconds", rec.step_s), ("overhead", rec.overhead)):
        if value is not None:
            setattr(m, field, value)
    m.shed.extend(rec.shed)
    if rec.rl is not None:
        _encode_rl(rec.rl, m.rl)
    m.layers_global = rec.layers_global
    band = (rec.norm_mean, rec.norm_threshold)
    if all(x is not None and math.isfinite(x) for x in band):  # an overflowed band is left out, not the step
        m.norm_mean, m.norm_threshold = band
    if rec.samples is not None:
        encode_samples(rec.samples, m.samples)
    for name, n in rec.events:
        m.events[name] = n
    for grp in rec.groups:
        m.groups.add(kind=str(grp.kind), name=grp.name, samples=grp.samples, tokens=grp.tokens)
    for p in rec.precursors:
        msg = m.precursors.add(kind=str(p.kind), layer=p.layer, value=p.value, at=p.at or ())
        if p.head is not None:
            msg.head = p.head
        if p.rank is not None:
            msg.rank = p.rank
    encode_precursor_findings(rec.precursor_findings, m)
    return m


_RL_FLOATS = ("log_ratio_sum", "max_abs_log_ratio", "mismatch_fraction", "max_abs_log_ratio_old", "clip_fraction",
              "advantage_sum", "advantage_rms", "max_abs_advantage", "entropy_mean", "kl_rollout", "job_entropy_mean",
              "job_kl_rollout")


def _encode_rl(r: RLStats, out: pb.RLStatsMsg) -> None:
    out.tokens = r.tokens
    out.log_ratio_counts.extend(r.log_ratio_counts)
    out.advantage_counts.extend(r.advantage_counts)
    for f in _RL_FLOATS:
        if getattr(r, f) is not None:
            setattr(out, f, getattr(r, f))


def _decode_rl(m: pb.RLStatsMsg, where: str) -> RLStats:
    counts = {}
    for f, bounds in (("log_ratio_counts", RL_LOG_RATIO_BUCKETS), ("advantage_counts", RL_ADVANTAGE_BUCKETS)):
        got = getattr(m, f)
        if len(got) not in (0, len(bounds) + 1):
            raise v.reject("length_mismatch", f"{where}.{f} has {len(got)} counts, expected {len(bounds) + 1} (or none)")
        counts[f] = tuple(v.count(c, f"{where}.{f}[{i}]") for i, c in enumerate(got))
    floats = {f: v.finite(getattr(m, f), f"{where}.{f}") if m.HasField(f) else None for f in _RL_FLOATS}
    return RLStats(v.count(m.tokens, f"{where}.tokens"), counts["log_ratio_counts"], floats["log_ratio_sum"],
                   floats["max_abs_log_ratio"], floats["mismatch_fraction"], floats["max_abs_log_ratio_old"],
                   floats["clip_fraction"], counts["advantage_counts"], floats["advantage_sum"], floats["advantage_rms"],
                   floats["max_abs_advantage"], floats["entropy_mean"], kl_rollout=floats["kl_rollout"],
                   job_entropy_mean=floats["job_entropy_mean"], job_kl_rollout=floats["job_kl_rollout"])


def _encode_tokens(t: TokenStats, index: dict[str, int], out: pb.TokenStatsMsg) -> None:
    top = t.top
    out.tokens, out.total_score, out.top_share = t.tokens, t.total_score, t.top_share
    out.micro_batch_shares.extend(t.micro_batch_shares)
    out.unattributed_share, out.dropped_calls = t.unattributed_share, t.dropped_calls
    for field in ("micro_batch", "sample", "position", "score", "share"):
        getattr(out, field).extend([getattr(s, field) for s in top])
    if any(s.token_id is not None for s in top):
        if any(s.token_id is not None and s.token_id < 0 for s in top):  # -1 means None on the wire
            raise v.reject("invalid_value", f"a token score has a negative token_id: {[s.token_id for s in top]}")
        out.token_id.extend([-1 if s.token_id is None else s.token_id for s in top])
    if any(s.sample_id is not None for s in top):
        out.sample_id.extend(["" if s.sample_id is None else s.sample_id for s in top])
        out.sample_id_none.extend([j for j, s in enumerate(top) if s.sample_id is None])
    extra: dict[str, int] = {}
    for s in top:
        out.layer_count.append(len(s.layers))
        for share in s.layers:
            k = index.get(share.layer)
            if k is None:
                k = extra.setdefault(share.layer, len(index) + len(extra))
            out.layer_index.append(k)
            out.layer_share.append(share.share)
    out.extra_layers.extend(extra)  # insertion order = index order


# -- decode + validate (daemon side, hot path) -------------------------------------------------
def decode_step(m: pb.Step, names: tuple[str, ...], job: str, rank: int, world_size: int,
                where: str, keep_top: bool = True) -> StepSummary:
    """One validated StepSummary; raises :class:`~gradloc.transport.validate.RejectedBatch`.

    ``keep_top=False`` validates the per-step top tokens but leaves ``tokens.top`` empty: building
    16 TokenScores (with their layer shares) per record was 70% of the daemon's decode time, and
    nothing in the daemon reads them (incidents carry their own culprits)."""
    cols = _columns(m, names, where)
    nonfinite = v.count(m.nonfinite, f"{where}.nonfinite")
    event = nonfinite > 0
    job = v.text(m.job, f"{where}.job", required=True) if m.HasField("job") else job
    rank = v.rank(m.rank, world_size, f"{where}.rank") if m.HasField("rank") else rank
    events, dropped = events_of(m) if m.events else ((), 0)
    groups, groups_dropped = groups_of(m) if m.groups else ((), 0)
    precursors, precursors_dropped = precursors_of(m) if m.precursors else ((), 0)
    findings, findings_dropped = precursor_findings_of(m, job, rank, m.step, m.time_unix) \
        if m.precursor_findings else ((), 0)
    overhead = {name: v.nonneg(getattr(m, f), f"{where}.{f}") if m.HasField(f) else None
                for name, f in (("overhead_s", "overhead_seconds"), ("step_s", "step_seconds"), ("overhead", "overhead"))}
    norm_mean, norm_threshold = _band(m, where)
    return StepSummary(
        job=job, rank=rank, step=v.count(m.step, f"{where}.step"), time_unix=v.finite(m.time_unix, f"{where}.time_unix"),
        global_norm=v.norm(m.global_norm, f"{where}.global_norm", event, _GRAD_EVENT),
        loss=m.loss if m.HasField("loss") else None,  # any value: a non-finite loss is itself an event
        micro_batches=v.count(m.micro_batches, f"{where}.micro_batches"), layers=cols,
        tokens=_decode_tokens(m.tokens, names, f"{where}.tokens", event, keep_top) if m.HasField("tokens") else None,
        nonfinite=nonfinite,
        grad_scale=v.finite(m.grad_scale, f"{where}.grad_scale") if m.HasField("grad_scale") else None,
        skipped=m.skipped, **overhead, shed=_shed(m, where),
        rl=_decode_rl(m.rl, f"{where}.rl") if m.HasField("rl") else None, layers_global=m.layers_global,
        norm_mean=norm_mean, norm_threshold=norm_threshold,
        samples=decode_samples(m.samples, job, rank, m.step, m.time_unix, f"{where}.samples")
        if m.HasField("samples") else None,
        events=events, events_dropped=dropped, groups=groups, groups_dropped=groups_dropped,
        precursors=precursors, precursors_dropped=precursors_dropped,
        precursor_findings=findings, precursor_findings_dropped=findings_dropped)


def _band(m: pb.Step, where: str) -> tuple[float | None, float | None]:
    """The detector's healthy band: both or neither, finite, 0 <= mean <= threshold."""
    if not (m.HasField("norm_mean") or m.HasField("norm_threshold")):
        return None, None
    if not (m.HasField("norm_mean") and m.HasField("norm_threshold")):
        raise v.reject("invalid_value", f"{where}: norm_mean and norm_threshold come together (the detector's band)")
    mean = v.nonneg(m.norm_mean, f"{where}.norm_mean")
    threshold = v.nonneg(m.norm_threshold, f"{where}.norm_threshold")
    if threshold < mean:
        raise v.reject("invalid_value", f"{where}.norm_threshold {threshold!r} is below norm_mean {mean!r}")
    return mean, threshold


def _shed(m: pb.Step, where: str) -> tuple[str, ...]:
    if len(m.shed) > _MAX_SHED:
        raise v.reject("invalid_value", f"{where}.shed names {len(m.shed)} features (at most {_MAX_SHED})")
    return tuple(v.text(x, f"{where}.shed[{i}]", required=True) for i, x in enumerate(m.shed))


def _columns(m: pb.Step, names: tuple[str, ...], where: str) -> LayerColumns:
    n = len(names)
    for field in (*_FLOAT_COLUMNS, *_INT_COLUMNS, "update_ratio"):
        got = len(getattr(m, field))
        if got != n and not (field == "update_ratio" and got == 0):
            raise v.reject("length_mismatch", f"{where}.{field} has {got} values but layer table "
                                              f"{m.layer_table_id:#018x} has {n} layers")
    gn, gm, pn = (np.array(getattr(m, f), dtype=np.float64) for f in _FLOAT_COLUMNS)
    nf, numel = (np.array(getattr(m, f), dtype=np.int64) for f in _INT_COLUMNS)
    ur = np.array(m.update_ratio, dtype=np.float64) if len(m.update_ratio) else np.full(n, _NAN)
    v.layer_columns(where, names, gn, gm, pn, ur, nf, numel)
    return LayerColumns.build(names, gn, gm, nf, pn, numel, ur)


def _decode_tokens(t: pb.TokenStatsMsg, names: tuple[str, ...], where: str, event: bool,
                   keep_top: bool = True) -> TokenStats:
    """Token scores and shares are gradient measurements: non-finite only in a nonfinite-gradient step.

    Fast path: each column read once (upb field access is slow) and checked with one combined
    test; the field-by-field checks that name the offending entry run only when it fails."""
    mb, sample, pos = tuple(t.micro_batch), tuple(t.sample), tuple(t.position)
    score, share, counts = tuple(t.score), tuple(t.share), tuple(t.layer_count)
    index, lshare, mbs = tuple(t.layer_index), tuple(t.layer_share), tuple(t.micro_batch_shares)
    k = len(score)
    token_id = tuple(t.token_id) or (-1,) * k
    sample_id: list[str | None] = list(t.sample_id) or [None] * k
    none = tuple(t.sample_id_none)
    for j in none:
        if j < len(sample_id):  # (out of range: reported by _explain_tokens)
            sample_id[j] = None
    layer_names = names + tuple(t.extra_layers)
    floats = (t.total_score, t.top_share, t.unattributed_share, *mbs, *score, *share, *lshare)
    if ({len(mb), len(sample), len(pos), len(share), len(counts), len(token_id), len(sample_id)} != {k}
            or sum(counts) != len(index) or len(lshare) != len(index)
            or min(t.tokens, t.dropped_calls, *mb, *sample, *pos) < 0 or min(token_id, default=0) < -1
            or max(index, default=-1) >= len(layer_names) or max(none, default=-1) >= k or "" in t.extra_layers
            or max(map(len, layer_names[len(names):] + tuple(x or "" for x in sample_id)), default=0) > v.MAX_NAME
            or not (event or all(map(math.isfinite, floats)))):
        _explain_tokens(t, layer_names, where, event)
    if not keep_top:
        return TokenStats(tokens=t.tokens, total_score=t.total_score, top=(), top_share=t.top_share,
                          micro_batch_shares=mbs, unattributed_share=t.unattributed_share, dropped_calls=t.dropped_calls)
    layers = tuple(map(LayerShare, map(layer_names.__getitem__, index), lshare))
    ends = tuple(itertools.accumulate(counts))
    top = tuple(TokenScore(micro_batch=mb[j], sample=sample[j], position=pos[j], score=score[j], share=share[j],
                           token_id=None if token_id[j] < 0 else token_id[j], sample_id=sample_id[j],
                           layers=layers[ends[j] - counts[j]:ends[j]]) for j in range(k))
    return TokenStats(tokens=t.tokens, total_score=t.total_score, top=top, top_share=t.top_share,
                      micro_batch_shares=mbs, unattributed_share=t.unattributed_share, dropped_calls=t.dropped_calls)


def _explain_tokens(t: pb.TokenStatsMsg, layer_names: tuple[str, ...], where: str, event: bool) -> NoReturn:
    k = len(t.score)
    for field in ("micro_batch", "sample", "position", "share", "layer_count", "token_id", "sample_id"):
        n = len(getattr(t, field))
        if n != k and not (n == 0 and field in ("token_id", "sample_id")):
            raise v.reject("length_mismatch", f"{where}.{field} has {n} values but score has {k}")
    n = sum(t.layer_count)
    for field in ("layer_index", "layer_share"):
        if len(getattr(t, field)) != n:
            raise v.reject("length_mismatch", f"{where}.{field} has {len(getattr(t, field))} values but "
                                              f"sum(layer_count) is {n}")
    for field in ("tokens", "dropped_calls"):
        v.count(getattr(t, field), f"{where}.{field}")
    for field in ("micro_batch", "sample", "position"):
        for j, x in enumerate(getattr(t, field)):
            v.count(x, f"{where}.{field}[{j}]")
    for j, x in enumerate(t.token_id):
        if x < -1:
            raise v.reject("invalid_value", f"{where}.token_id[{j}] is {x} (must be >= 0, or -1 for unknown)")
    for j, x in enumerate(t.sample_id_none):
        if x >= k:
            raise v.reject("invalid_value", f"{where}.sample_id_none[{j}] is {x}, beyond the {k} scores")
    for j, x in enumerate(t.layer_index):
        if x >= len(layer_names):
            raise v.reject("invalid_value", f"{where}.layer_index[{j}] is {x}, beyond the {len(layer_names)} "
                                            "layer names of the step (table + extra_layers)")
    for field in ("extra_layers", "sample_id"):
        for j, x in enumerate(getattr(t, field)):
            v.text(x, f"{where}.{field}[{j}]", required=field == "extra_layers")
    for field in ("total_score", "top_share", "unattributed_share"):
        v.finite(getattr(t, field), f"{where}.{field}", event, _GRAD_EVENT)
    for field in ("micro_batch_shares", "score", "share", "layer_share"):
        for j, x in enumerate(getattr(t, field)):
            v.finite(x, f"{where}.{field}[{j}]", event, _GRAD_EVENT)
    raise AssertionError(f"{where}: the fast check failed but no field did")  # unreachable
