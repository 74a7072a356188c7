"""Realistic correlated incidents and step summaries for the store, codec and CLI tests.

The main fixture is a 3-rank job where rank 2 never reported step 1200 (status "partial"): rank 0
located one planted token (" bell"), rank 1 found a two-token span of smaller share, and both ranks'
own findings (with Localization) ride along as ``findings``.
"""
from __future__ import annotations

import math

from gradloc.records import (
    Classification,
    Culprit,
    CulpritSpan,
    Evidence,
    Incident,
    LayerShare,
    LayerStats,
    Localization,
    Remedy,
    SampleShare,
    SpikeEvent,
    TokenScore,
    TokenStats,
)
from gradloc.reports import CorrelatedIncident, LayerColumns, MicroBatchShare, RankShare, RankSpan, StepSummary

T0 = 1_760_000_000.0  # a fixed "now" for the tests (2025-10-09)
INCIDENT_ID = "7f3c9a0e5b2d4c1f8a6e0d9b3c2a1f40"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"

BELL = CulpritSpan(micro_batch=3, sample=1, start=41, end=42, share=0.9, token_ids=(66,), text=" bell",
                   context_before=" climb the hill behind the school before the",
                   context_after=" rings. The old clock", sample_id="s1200-3-1", window_start=38,
                   window_tokens=(" school", " before", " the", " bell", " rings", "."),
                   window_scores=(0.001, 0.0, 0.02, 0.81, 0.05, 0.0))
ZEBRA = CulpritSpan(micro_batch=0, sample=2, start=7, end=9, share=0.5, token_ids=(901, 77), text="zebra\tqu",
                    context_before="the quick brown", context_after="ick fox", sample_id=None)


def _layers() -> tuple[LayerStats, ...]:
    return (LayerStats(layer="blocks.1.proj", grad_norm=0.031, grad_max_abs=0.004, nonfinite=0, param_norm=11.6,
                       numel=12480, update_ratio=None),
            LayerStats(layer="head", grad_norm=0.012, grad_max_abs=0.002, nonfinite=0, param_norm=20.1, numel=16384,
                       update_ratio=None))


def finding(rank: int, step: int, span: CulpritSpan, *, incident_id: str, time_unix: float,
            status: str = "located", explained: float | None = 0.93) -> Incident:
    """One rank's own incident, localized to ``span``."""
    spike = SpikeEvent(step=step, kinds=("grad_spike", "loss_spike"), global_norm=3.5, z=41.2, mean=0.8,
                       std=0.066, loss=2.9, loss_z=4.8, loss_mean=2.1, layers=("blocks.1.proj",), detail="")
    culprits = tuple(Culprit(span.micro_batch, span.sample, pos, share=span.share / (span.end - span.start),
                             score_share=0.6, token_id=tok, text=span.text, sample_id=span.sample_id,
                             layers=(LayerShare("head", 0.29), LayerShare("blocks.1.proj", 0.2)))
                     for pos, tok in zip(range(span.start, span.end), span.token_ids))
    loc = Localization(step=step, method="attribution", status=status, level="token" if status == "located" else "",
                       probes=2, explained_share=explained,
                       global_norm=3.5, culprit_norm=3.3, norm_without_culprits=0.9, culprits=culprits,
                       spans=(span,), micro_batch_shares=(0.05, 0.02, 0.03, 0.9), unattributed_share=0.01,
                       loss_share=0.5, loss_without_culprits=2.2, note="",
                       samples=(SampleShare(span.micro_batch, span.sample, 0.8, None, span.sample_id, 56),
                                SampleShare(0, 0, 0.03, None, None, 56)))
    remedy = (Remedy("drop_culprits", True, 3.5, 0.9, "∇ − ∇_C: 1 culprit token(s) dropped from the update")
              if status == "located" else
              Remedy("drop_culprits", False, 3.5, None, f"not applied to a {status} spike: only a located culprit set qualifies"))
    cls = Classification("layer_concentrated", "blocks.1.proj carries 62% of ‖∇‖² and its own z-score flagged it",
                         (Evidence("top_layer_share", 0.62), Evidence("flagged_layers", 1.0)))
    return Incident(incident_id=f"{rank:02d}" + incident_id[2:], job="llm-7b", rank=rank, step=step,
                    time_unix=time_unix, spike=spike, localization=loc, top_layers=_layers(), remedy=remedy,
                    classification=cls)


def make_incident(incident_id: str = INCIDENT_ID, *, job: str = "llm-7b", step: int = 1200,
                  time_unix: float = T0, spans: bool = True) -> CorrelatedIncident:
    """Ranks 0–2 expected, 0 and 1 reported, 2 missing; two culprit spans (one per reporting rank)."""
    f0 = finding(0, step, BELL, incident_id=incident_id, time_unix=time_unix)
    f1 = finding(1, step, ZEBRA, incident_id=incident_id, time_unix=time_unix + 0.4, status="unverified",
                 explained=None)
    rank_spans = (RankSpan(0, 0.72 * 0.9, BELL), RankSpan(1, 0.28 * 0.5, ZEBRA)) if spans else ()
    return CorrelatedIncident(
        incident_id=incident_id, trace_id=TRACE_ID, job=job, step=step, time_unix=time_unix, status="partial",
        kinds=("grad_spike", "loss_spike"), global_norm=4.95, ranks_expected=(0, 1, 2), ranks_reported=(0, 1),
        ranks_missing=(2,),
        rank_shares=(RankShare(0, 0.72, 3.5, 2.9, True, "located", 2),
                     RankShare(1, 0.28, 3.5, 2.7, True, "unverified", 0)),
        micro_batch_shares=(MicroBatchShare(0, 3, 0.66), MicroBatchShare(0, 0, 0.06),
                            MicroBatchShare(1, 0, 0.2), MicroBatchShare(1, 1, 0.08)),
        spans=rank_spans, findings=(f0, f1), closed_unix=time_unix + 5.0,
        note="rank 2 missed the straggler deadline", explained_share=0.93, probes=2,
        top_layers=("blocks.1.proj",))


def nonfinite_incident(incident_id: str = "deadbeef" * 4, time_unix: float = T0 + 60) -> CorrelatedIncident:
    """A NaN-gradient step: non-finite floats everywhere the JSON must carry them as strings."""
    spike = SpikeEvent(step=1300, kinds=("nonfinite_grad",), global_norm=math.inf, z=None, mean=0.8, std=0.07,
                       loss=math.nan, loss_z=None, loss_mean=2.0)
    f0 = Incident(incident_id=incident_id, job="llm-7b", rank=0, step=1300, time_unix=time_unix, spike=spike,
                  localization=None, top_layers=(LayerStats(layer="head", grad_norm=math.nan, grad_max_abs=math.inf,
                                                            nonfinite=12, param_norm=20.0, numel=16384),))
    return CorrelatedIncident(
        incident_id=incident_id, trace_id="0" * 32, job="llm-7b", step=1300, time_unix=time_unix,
        status="complete", kinds=("nonfinite_grad",), global_norm=math.nan, ranks_expected=(0,),
        ranks_reported=(0,), ranks_missing=(), rank_shares=(RankShare(0, None, math.inf, math.nan, True),),
        micro_batch_shares=(), spans=(), findings=(f0,), explained_share=None)


def incident_series(n: int, *, job: str = "llm-7b", start: float = T0, every_s: float = 3600.0,
                    first_step: int = 100) -> list[CorrelatedIncident]:
    """``n`` incidents an hour apart, ids ``0000…``, ``0001…`` (distinct 4-hex prefixes)."""
    return [make_incident(f"{i:04x}" + INCIDENT_ID[4:], job=job, step=first_step + 10 * i,
                          time_unix=start + i * every_s) for i in range(n)]


def step_summary(job: str, rank: int, step: int, time_unix: float, *, loss: float | None = 2.5,
                 skipped: bool = False) -> StepSummary:
    """One rank's step with two layers and token statistics (top_share 0.1, unattributed 0.02)."""
    cols = LayerColumns.build(("blocks.0", "head"), [0.5, 0.2], [0.01, 0.02], [0, 0], [10.0, 20.0],
                              [1000, 2000], [math.nan, 1e-3])
    top = (TokenScore(micro_batch=0, sample=0, position=3, score=2.0, share=0.1, token_id=5),)
    tokens = TokenStats(tokens=4096, total_score=20.0, top=top, top_share=0.1, micro_batch_shares=(0.5, 0.5),
                        unattributed_share=0.02)
    return StepSummary(job=job, rank=rank, step=step, time_unix=time_unix, global_norm=0.8 + step / 1e4, loss=loss, micro_batches=2,
                       layers=cols, tokens=tokens, nonfinite=0, skipped=skipped)


def flooded_incident(tokens: int = 10_000, culprits: int = 121, time_unix: float = T0) -> CorrelatedIncident:
    """Issue 33's bad input: a one-process run whose culprit sample is ``tokens`` identical ``\\x00`` tokens,
    ``culprits`` of them in the middle named at the sample level (94% of ‖∇‖²), the window sent whole."""
    from dataclasses import replace

    start = (tokens - culprits) // 2
    span = CulpritSpan(micro_batch=1, sample=0, start=start, end=start + culprits, share=0.94,
                       token_ids=(0,) * culprits, text="\x00" * culprits, context_before="\x00" * start,
                       context_after="\x00" * (tokens - start - culprits), sample_id="nul-flood", window_start=0,
                       window_tokens=("\x00",) * tokens,
                       window_scores=tuple(0.9 / culprits if start <= i < start + culprits else 0.0 for i in range(tokens)))
    f0 = finding(0, 1200, span, incident_id=INCIDENT_ID, time_unix=time_unix)
    note = "sample level: 121 tokens share the sample's norm; no smaller set explains it"
    f0 = replace(f0, localization=replace(f0.localization, level="sample", explained_share=0.94, note=note))
    return replace(make_incident(time_unix=time_unix), status="complete", ranks_expected=(0,), ranks_reported=(0,),
                   ranks_missing=(), rank_shares=(RankShare(0, 1.0, 3.5, 2.9, True, "located", 2),),
                   micro_batch_shares=(MicroBatchShare(0, 1, 0.94),), spans=(RankSpan(0, 0.94, span),),
                   findings=(f0,), note="", explained_share=0.94)
