"""``pb.IncidentMsg`` → Incident, validated (``codec_incidents.py`` has the encoder and the rules: which values
may be ±inf or NaN in which incident)."""
from __future__ import annotations

import math
from typing import Any, Callable

from gradloc.records import (
    INCIDENT_SCHEMA_VERSION,
    MAX_SPAN_WINDOW,
    Classification,
    ClassKind,
    Culprit,
    CulpritGroup,
    CulpritSpan,
    Evidence,
    Incident,
    IncidentScope,
    LayerShare,
    LayerStats,
    Level,
    Localization,
    Method,
    Remedy,
    SampleInfo,
    SampleShare,
    SpikeEvent,
    SpikeKind,
    Status,
    TokenRL,
    provenance_problem,
)
from gradloc.transport import validate as v
from gradloc.transport.codec_incidents import RL_FIELDS
from gradloc.transport.wire import pb

_SUPPORTED_INCIDENT_VERSIONS = (INCIDENT_SCHEMA_VERSION,)
_GRAD_EVENT = " but the incident is not a nonfinite-gradient event (no 'nonfinite_grad' kind, no layer nonfinite count)"


def _get_optional(msg: Any, field: str, check: Callable[[Any, str], Any], where: str) -> Any:
    return check(getattr(msg, field), f"{where}.{field}") if msg.HasField(field) else None


class _Checks:
    """The float/int/string checks of one incident, with its event flags bound in."""

    def __init__(self, grad_event: bool, loss_event: bool) -> None:
        self.grad_event, self.loss_event = grad_event, loss_event

    def finite(self, x: float, where: str) -> float:
        return v.finite(x, where)

    def grad(self, x: float, where: str) -> float:
        return v.finite(x, where, self.grad_event, _GRAD_EVENT)

    def derived(self, x: float, where: str) -> float:
        """A localization result: NaN = not measurable; ±inf only in a nonfinite-gradient event."""
        return v.finite(x, where, self.grad_event or math.isnan(x), _GRAD_EVENT)

    def loss_derived(self, x: float, where: str) -> float:
        return v.finite(x, where, self.loss_event, " but the spike's loss is finite or unknown")

    @staticmethod
    def any_float(x: float, where: str) -> float:
        return x

    @staticmethod
    def name(x: str, where: str) -> str:
        return v.text(x, where)

    @staticmethod
    def free_text(x: str, where: str) -> str:
        return v.text(x, where, v.MAX_TEXT)


def decode_incident(m: pb.IncidentMsg, world_size: int, where: str) -> Incident:
    if m.schema_version not in _SUPPORTED_INCIDENT_VERSIONS:
        raise v.reject("schema_version", f"{where}.schema_version is {m.schema_version}; supported incident "
                                         f"schema versions: {list(_SUPPORTED_INCIDENT_VERSIONS)}")
    if not m.HasField("spike"):
        raise v.reject("invalid_value", f"{where}.spike is missing")
    top = tuple(_decode_layer(x, f"{where}.top_layers[{i}]") for i, x in enumerate(m.top_layers))
    # An overflowed (+inf) norm of finite elements is a gradient event too (see validate.norm).
    grad_event = ("nonfinite_grad" in m.spike.kinds or any(s.nonfinite > 0 for s in top)
                  or m.spike.global_norm == math.inf)
    loss_event = m.spike.HasField("loss") and not math.isfinite(m.spike.loss)
    c = _Checks(grad_event, loss_event)
    loc = _decode_localization(m.localization, c, f"{where}.localization") if m.HasField("localization") else None
    remedy = _decode_remedy(m.remedy, c, f"{where}.remedy") if m.HasField("remedy") else None
    cls = _decode_class(m.classification, c, f"{where}.classification") if m.HasField("classification") else None
    return Incident(incident_id=v.text(m.incident_id, f"{where}.incident_id", required=True),
                    job=v.text(m.job, f"{where}.job", required=True), rank=v.rank(m.rank, world_size, f"{where}.rank"),
                    step=v.count(m.step, f"{where}.step"), time_unix=c.finite(m.time_unix, f"{where}.time_unix"),
                    spike=_decode_spike(m.spike, c, f"{where}.spike"), localization=loc,
                    schema_version=m.schema_version, top_layers=top, remedy=remedy, classification=cls,
                    scope=_scope(m.scope, f"{where}.scope"))


def _scope(scope: str, where: str) -> IncidentScope:
    if scope not in ("", *IncidentScope):
        raise v.reject("invalid_value", f"{where} is {scope[:40]!r}; known: {', '.join(repr(str(x)) for x in IncidentScope)}")
    return IncidentScope(scope or IncidentScope.RANK)


def _opt_rank(m: Any, where: str) -> int | None:
    return v.count(m.rank, f"{where}.rank") if m.HasField("rank") else None


def _decode_class(m: pb.ClassificationMsg, c: _Checks, where: str) -> Classification:
    return Classification(_enum(ClassKind, m.kind, f"{where}.kind"), c.free_text(m.reason, f"{where}.reason"),
                          tuple(Evidence(c.name(e.name, f"{where}.evidence[{i}].name"),
                                         c.derived(e.value, f"{where}.evidence[{i}].value"))
                                for i, e in enumerate(m.evidence)))


def decode_info(m: pb.SampleInfoMsg, where: str) -> SampleInfo:
    """A validated SampleInfo (also an outlier's: codec_findings.py)."""
    return _decode_info(m, _Checks(False, False), where)


def _decode_info(m: pb.SampleInfoMsg, c: _Checks, where: str) -> SampleInfo:
    source = m.source if m.HasField("source") else None
    origin = m.origin if m.HasField("origin") else None
    tags = tuple((t.key, t.value) for t in m.tags)
    problem = provenance_problem(source, origin, tags)
    if problem:
        raise v.reject("invalid_value", f"{where}: {problem}")
    return SampleInfo(_get_optional(m, "request_id", c.name, where),
                      _get_optional(m, "completion_index", v.count, where),
                      v.count(m.prompt_tokens, f"{where}.prompt_tokens"), v.count(m.response_start, f"{where}.response_start"),
                      v.count(m.response_tokens, f"{where}.response_tokens"),
                      _get_optional(m, "finish_reason", c.name, where), source, origin, tags)


def _decode_token_rl(m: pb.TokenRLMsg, c: _Checks, where: str) -> TokenRL:
    vals = {f: _get_optional(m, f, c.derived, where) for f in RL_FIELDS if f != "clipped"}
    return TokenRL(vals["logp"], vals["rollout_logp"], vals["old_logp"], vals["advantage"], vals["ratio"],
                   m.clipped if m.HasField("clipped") else None, vals["entropy"], vals["sequence_log_ratio"])


def _decode_remedy(m: pb.RemedyMsg, c: _Checks, where: str) -> Remedy:
    return Remedy(c.name(m.action, f"{where}.action"), m.applied, c.grad(m.norm_before, f"{where}.norm_before"),
                  _get_optional(m, "norm_after", c.derived, where), c.free_text(m.reason, f"{where}.reason"))


def _decode_sample(m: pb.SampleShareMsg, c: _Checks, where: str) -> SampleShare:
    return SampleShare(v.count(m.micro_batch, f"{where}.micro_batch"), v.count(m.sample, f"{where}.sample"),
                       c.derived(m.score_share, f"{where}.score_share"), _get_optional(m, "share", c.derived, where),
                       _get_optional(m, "sample_id", c.name, where), v.count(m.tokens, f"{where}.tokens"),
                       _opt_rank(m, where))


def _decode_group(m: pb.CulpritGroupMsg, c: _Checks, where: str) -> CulpritGroup:
    return CulpritGroup(share=c.derived(m.share, f"{where}.share"),
                        micro_batch=_get_optional(m, "micro_batch", v.count, where), rank=_opt_rank(m, where),
                        micro_batches=v.count(m.micro_batches, f"{where}.micro_batches"),
                        samples=v.count(m.samples, f"{where}.samples"), tokens=v.count(m.tokens, f"{where}.tokens"))


def _decode_layer(m: pb.LayerStatsMsg, where: str) -> LayerStats:
    nonfinite = v.count(m.nonfinite, f"{where}.nonfinite")
    c = _Checks(nonfinite > 0, False)
    ratio = None
    if m.HasField("update_ratio"):  # NaN = unknown, like the step columns
        ratio = v.finite(m.update_ratio, f"{where}.update_ratio", c.grad_event or math.isnan(m.update_ratio))
    return LayerStats(layer=v.text(m.layer, f"{where}.layer", required=True),
                      grad_norm=v.norm(m.grad_norm, f"{where}.grad_norm", c.grad_event, _GRAD_EVENT),
                      grad_max_abs=c.grad(m.grad_max_abs, f"{where}.grad_max_abs"), nonfinite=nonfinite,
                      param_norm=v.norm(m.param_norm, f"{where}.param_norm", c.grad_event, _GRAD_EVENT),
                      numel=v.count(m.numel, f"{where}.numel"), update_ratio=ratio,
                      z=m.z if m.HasField("z") and math.isfinite(m.z) else None)  # NaN: unknown, as absent


def _decode_spike(m: pb.SpikeMsg, c: _Checks, where: str) -> SpikeEvent:
    opt = {f: _get_optional(m, f, c.finite, where) for f in ("z", "mean", "std", "loss_z", "loss_mean")}
    return SpikeEvent(
        step=v.count(m.step, f"{where}.step"),
        kinds=tuple(_enum(SpikeKind, k, f"{where}.kinds[{i}]") for i, k in enumerate(m.kinds)),
        global_norm=c.grad(m.global_norm, f"{where}.global_norm"), z=opt["z"], mean=opt["mean"], std=opt["std"],
        loss=_get_optional(m, "loss", c.any_float, where), loss_z=opt["loss_z"], loss_mean=opt["loss_mean"],
        layers=tuple(c.name(x, f"{where}.layers[{i}]") for i, x in enumerate(m.layers)),
        detail=c.free_text(m.detail, f"{where}.detail"),
        follows=v.count(m.follows, f"{where}.follows") if m.HasField("follows") else None,
        last_healthy_step=v.count(m.last_healthy_step, f"{where}.last_healthy_step")
        if m.HasField("last_healthy_step") else None)


def _decode_shares(ms: Any, c: _Checks, where: str) -> tuple[LayerShare, ...]:
    return tuple(LayerShare(v.text(x.layer, f"{where}[{i}].layer", required=True),
                            c.derived(x.share, f"{where}[{i}].share")) for i, x in enumerate(ms))


def _decode_culprit(m: pb.CulpritMsg, c: _Checks, where: str) -> Culprit:
    return Culprit(v.count(m.micro_batch, f"{where}.micro_batch"), v.count(m.sample, f"{where}.sample"),
                   v.count(m.position, f"{where}.position"), c.derived(m.share, f"{where}.share"),
                   c.derived(m.score_share, f"{where}.score_share"), _get_optional(m, "token_id", v.count, where),
                   _get_optional(m, "text", c.free_text, where), _get_optional(m, "sample_id", c.name, where),
                   _decode_shares(m.layers, c, f"{where}.layers"),
                   _decode_token_rl(m.rl, c, f"{where}.rl") if m.HasField("rl") else None,
                   _decode_class(m.classification, c, f"{where}.classification") if m.HasField("classification") else None,
                   _decode_info(m.sample_info, c, f"{where}.sample_info") if m.HasField("sample_info") else None,
                   _opt_rank(m, where))


def _decode_span(m: pb.CulpritSpanMsg, c: _Checks, where: str) -> CulpritSpan:
    start, end = v.count(m.start, f"{where}.start"), v.count(m.end, f"{where}.end")
    if end < start:
        raise v.reject("invalid_value", f"{where}.end is {end}, before start {start}")
    return CulpritSpan(v.count(m.micro_batch, f"{where}.micro_batch"), v.count(m.sample, f"{where}.sample"),
                       start, end, c.derived(m.share, f"{where}.share"),
                       tuple(v.count(t, f"{where}.token_ids[{i}]") for i, t in enumerate(m.token_ids)),
                       *(_get_optional(m, f, c.free_text, where)
                         for f in ("text", "context_before", "context_after")),
                       _get_optional(m, "sample_id", c.name, where),
                       _decode_info(m.sample_info, c, f"{where}.sample_info") if m.HasField("sample_info") else None,
                       _opt_rank(m, where), *_decode_window(m, c, where))


def _decode_window(m: pb.CulpritSpanMsg, c: _Checks, where: str) -> tuple[int, tuple[str, ...], tuple[float, ...]]:
    n = len(m.window_tokens)
    if n != len(m.window_scores):
        raise v.reject("length_mismatch", f"{where}.window_scores has {len(m.window_scores)} values but "
                                          f"window_tokens has {n}")
    if n > MAX_SPAN_WINDOW:
        raise v.reject("invalid_value", f"{where}.window_tokens has {n} tokens (at most {MAX_SPAN_WINDOW})")
    return (v.count(m.window_start, f"{where}.window_start"),
            tuple(c.free_text(t, f"{where}.window_tokens[{i}]") for i, t in enumerate(m.window_tokens)),
            tuple(c.derived(x, f"{where}.window_scores[{i}]") for i, x in enumerate(m.window_scores)))


def _decode_localization(m: pb.LocalizationMsg, c: _Checks, where: str) -> Localization:
    return Localization(
        step=v.count(m.step, f"{where}.step"), method=_enum(Method, m.method, f"{where}.method"),
        status=_enum(Status, m.status, f"{where}.status"), level=_enum(Level, m.level, f"{where}.level"),
        probes=v.count(m.probes, f"{where}.probes"), passes=v.count(m.passes, f"{where}.passes"),
        explained_share=_get_optional(m, "explained_share", c.derived, where),
        global_norm=c.grad(m.global_norm, f"{where}.global_norm"),
        culprit_norm=_get_optional(m, "culprit_norm", c.derived, where),
        norm_without_culprits=_get_optional(m, "norm_without_culprits", c.derived, where),
        culprits=tuple(_decode_culprit(x, c, f"{where}.culprits[{i}]") for i, x in enumerate(m.culprits)),
        spans=tuple(_decode_span(x, c, f"{where}.spans[{i}]") for i, x in enumerate(m.spans)),
        micro_batch_shares=tuple(c.derived(x, f"{where}.micro_batch_shares[{i}]")
                                 for i, x in enumerate(m.micro_batch_shares)),
        unattributed_share=c.derived(m.unattributed_share, f"{where}.unattributed_share"),
        loss_share=_get_optional(m, "loss_share", c.loss_derived, where),
        loss_without_culprits=_get_optional(m, "loss_without_culprits", c.loss_derived, where),
        note=c.free_text(m.note, f"{where}.note"),
        samples=tuple(_decode_sample(x, c, f"{where}.samples[{i}]") for i, x in enumerate(m.samples)),
        groups=tuple(_decode_group(x, c, f"{where}.groups[{i}]") for i, x in enumerate(m.groups)))


def _enum(kind: type, x: str, where: str):  # noqa: ANN202 - one of records' StrEnums
    try:
        return kind(v.text(x, where) if x else x)
    except ValueError:  # the value is not echoed whole: a status message travels in a size-limited trailer
        shown = repr(x[:40]) + (f"… ({len(x)} characters)" if len(x) > 40 else "")
        raise v.reject("invalid_value", f"{where} is {shown}; one of {[e.value for e in kind]}") from None
