"""Incidents on the wire: Incident → ``pb.IncidentMsg`` (``decode_incidents.py``: back, validated), exact both
ways (None ≠ 0.0, NaN kept).

Incidents are rare (one per spike), so they are plain nested messages decoded object by object.
An incident is a *nonfinite-gradient event* when its spike says ``nonfinite_grad`` or one of its
top layers has a nonfinite count > 0; only then may the gradient measurements in it (spike and
localization norms, shares) be ±inf. NaN is also accepted in the localization's derived shares and
norms: the localizer writes NaN there for "could not be measured" (e.g. a zero attribution total).
"""
from __future__ import annotations

from typing import Any

from gradloc.records import (
    Classification,
    Incident,
    LayerShare,
    LayerStats,
    Localization,
    SampleInfo,
    SpikeEvent,
)
from gradloc.transport.wire import pb


def _set_optional(msg: Any, obj: Any, fields: tuple[str, ...]) -> None:
    for f in fields:
        value = getattr(obj, f)
        if value is not None:
            setattr(msg, f, value)


# -- encode ------------------------------------------------------------------------------------
def encode_incident(inc: Incident) -> pb.IncidentMsg:
    m = pb.IncidentMsg(incident_id=inc.incident_id, job=inc.job, rank=inc.rank, step=inc.step,
                       time_unix=inc.time_unix, schema_version=inc.schema_version,
                       spike=_encode_spike(inc.spike), top_layers=[_encode_layer(s) for s in inc.top_layers])
    if inc.localization is not None:
        m.localization.CopyFrom(_encode_localization(inc.localization))
    if inc.classification is not None:
        m.classification.CopyFrom(_encode_class(inc.classification))
    if inc.scope != "rank":
        m.scope = inc.scope
    if inc.remedy is not None:
        r = inc.remedy
        m.remedy.CopyFrom(pb.RemedyMsg(action=r.action, applied=r.applied, norm_before=r.norm_before, reason=r.reason))
        _set_optional(m.remedy, r, ("norm_after",))
    return m


def _encode_spike(s: SpikeEvent) -> pb.SpikeMsg:
    m = pb.SpikeMsg(step=s.step, kinds=s.kinds, global_norm=s.global_norm, layers=s.layers, detail=s.detail)
    _set_optional(m, s, ("z", "mean", "std", "loss", "loss_z", "loss_mean", "follows",
                         "last_healthy_step"))
    return m


def _encode_layer(s: LayerStats) -> pb.LayerStatsMsg:
    m = pb.LayerStatsMsg(layer=s.layer, grad_norm=s.grad_norm, grad_max_abs=s.grad_max_abs, nonfinite=s.nonfinite,
                         param_norm=s.param_norm, numel=s.numel)
    _set_optional(m, s, ("update_ratio", "z"))
    return m


def _shares(shares: tuple[LayerShare, ...]) -> list[pb.LayerShareMsg]:
    return [pb.LayerShareMsg(layer=x.layer, share=x.share) for x in shares]


def _encode_localization(loc: Localization) -> pb.LocalizationMsg:
    m = pb.LocalizationMsg(step=loc.step, method=loc.method, status=loc.status, level=loc.level,
                           probes=loc.probes, passes=loc.passes,
                           global_norm=loc.global_norm, micro_batch_shares=loc.micro_batch_shares,
                           unattributed_share=loc.unattributed_share, note=loc.note)
    _set_optional(m, loc, ("explained_share", "culprit_norm", "norm_without_culprits", "loss_share",
                           "loss_without_culprits"))
    for c in loc.culprits:
        cm = m.culprits.add(micro_batch=c.micro_batch, sample=c.sample, position=c.position, share=c.share,
                            score_share=c.score_share, layers=_shares(c.layers))
        _set_optional(cm, c, ("token_id", "text", "sample_id", "rank"))
        if c.rl is not None:
            _set_optional(cm.rl, c.rl, RL_FIELDS)
            cm.rl.SetInParent()
        if c.classification is not None:
            cm.classification.CopyFrom(_encode_class(c.classification))
        if c.sample_info is not None:
            cm.sample_info.CopyFrom(encode_info(c.sample_info))
    for s in loc.spans:
        sm = m.spans.add(micro_batch=s.micro_batch, sample=s.sample, start=s.start, end=s.end, share=s.share,
                         token_ids=s.token_ids, window_start=s.window_start, window_tokens=s.window_tokens,
                         window_scores=s.window_scores)
        _set_optional(sm, s, ("text", "context_before", "context_after", "sample_id", "rank"))
        if s.sample_info is not None:
            sm.sample_info.CopyFrom(encode_info(s.sample_info))
    for x in loc.samples:
        xm = m.samples.add(micro_batch=x.micro_batch, sample=x.sample, score_share=x.score_share, tokens=x.tokens)
        _set_optional(xm, x, ("share", "sample_id", "rank"))
    for g in loc.groups:
        gm = m.groups.add(share=g.share, micro_batches=g.micro_batches, samples=g.samples, tokens=g.tokens)
        _set_optional(gm, g, ("micro_batch", "rank"))
    return m


RL_FIELDS = ("logp", "rollout_logp", "old_logp", "advantage", "ratio", "clipped", "entropy", "sequence_log_ratio")


def _encode_class(c: Classification) -> pb.ClassificationMsg:
    return pb.ClassificationMsg(kind=c.kind, reason=c.reason,
                                evidence=[pb.EvidenceMsg(name=e.name, value=e.value) for e in c.evidence])


def encode_info(i: SampleInfo) -> pb.SampleInfoMsg:
    m = pb.SampleInfoMsg(prompt_tokens=i.prompt_tokens, response_start=i.response_start,
                         response_tokens=i.response_tokens)
    _set_optional(m, i, ("request_id", "completion_index", "finish_reason", "source", "origin"))
    m.tags.extend(pb.SampleTagMsg(key=k, value=v) for k, v in i.tags)
    return m
