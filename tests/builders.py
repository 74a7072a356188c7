"""The one module that builds records for the tests, stage by stage.

- the monitor's records (``gradloc.records``): :func:`layer`, :func:`step_record`, :func:`incident_record` (one
  rank's incident, every field set: the codec round trips), :func:`finding` (a rank's incident localized to a
  span), :func:`rl_stats`, :func:`sample_stats`;
- one rank's small records for the correlator and agent tests: :func:`rank_summary`, :func:`rank_finding`;
- the agent's (``gradloc.reports``): :func:`columns`, :func:`summary` (a rank's step as the exporters read it),
  :func:`step_summary` (a stored step with a top token), :func:`correlated` (a correlated incident whose every
  rank has one finding), :func:`make_incident` (the rich one: ranks 0–2 expected, rank 2 missing, two spans),
  :func:`nonfinite_incident`, :func:`incident_series`, :func:`flooded_incident`.

Minimal where the readers read few fields (the exporters), complete where a codec or a store must carry every
field. The hypothesis strategies and wire helpers of the transport tests are in ``tests/transport/factories.py``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from gradloc.records import (
    RL_ADVANTAGE_BUCKETS,
    RL_LOG_RATIO_BUCKETS,
    Classification,
    Culprit,
    CulpritSpan,
    Evidence,
    Incident,
    LayerShare,
    LayerStats,
    Localization,
    PrecursorDriver,
    PrecursorFinding,
    PrecursorKind,
    PrecursorStat,
    Remedy,
    RLStats,
    SampleOutlier,
    SampleShare,
    SampleStats,
    SpikeEvent,
    StepRecord,
    TokenScore,
    TokenStats,
)
from gradloc.reports import CorrelatedIncident, LayerColumns, MicroBatchShare, RankShare, RankSpan, StepSummary

JOB = "job-a"  # step_record's and incident_record's job
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"  # correlated()'s trace
NAN = math.nan
T0 = 1_760_000_000.0  # a fixed "now" for the tests (2025-10-09)
INCIDENT_ID = "7f3c9a0e5b2d4c1f8a6e0d9b3c2a1f40"
PARTIAL_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"  # make_incident's trace

BELL = CulpritSpan(micro_batch=3, sample=1, start=41, end=42, share=0.9, token_ids=(66,), text=" bell",
                   context_before=" climb the hill behind the school before the",
                   context_after=" rings. The old clock", sample_id="s1200-3-1", window_start=38,
                   window_tokens=(" school", " before", " the", " bell", " rings", "."),
                   window_scores=(0.001, 0.0, 0.02, 0.81, 0.05, 0.0))
ZEBRA = CulpritSpan(micro_batch=0, sample=2, start=7, end=9, share=0.5, token_ids=(901, 77), text="zebra\tqu",
                    context_before="the quick brown", context_after="ick fox", sample_id=None)



# -- the monitor's records -----------------------------------------------------------------------
def layer(n: str, norm: float = 1.0, **kw: Any) -> LayerStats:
    args = dict(grad_norm=norm, grad_max_abs=norm / 10, nonfinite=0, param_norm=10.0, numel=100, update_ratio=1e-3)
    args.update(kw)
    return LayerStats(layer=n, **args)


def step_record(n: int = 0, layers: tuple[LayerStats, ...] | None = None, **kw: Any) -> StepRecord:
    layers = layers if layers is not None else (layer("embed"), layer("blocks.0.mlp", 2.0), layer("head", 3.0))
    args = dict(job=JOB, rank=1, step=n, time_unix=1.7e9 + n, global_norm=3.7, loss=2.5, micro_batches=2,
                layers=layers)
    args.update(kw)
    return StepRecord(**args)


def incident_record(n: int = 7, **kw: Any) -> Incident:
    spike = SpikeEvent(step=n, kinds=("grad_spike",), global_norm=40.0, z=9.5, mean=1.0, std=0.2, loss=2.5, loss_z=0.1,
                       loss_mean=2.4, layers=("head",), detail="z 9.5")
    cul = Culprit(0, 1, 5, 0.9, 0.8, 42, " x", "uid-1", (LayerShare("head", 0.7), LayerShare("embed", 0.3)))
    span = CulpritSpan(0, 1, 5, 6, 0.9, (42,), " x", "a b", "c d", "uid-1")
    loc = Localization(step=n, method="attribution", status="located", level="token", probes=2, passes=2,
                       explained_share=0.93, global_norm=40.0, culprit_norm=38.0, norm_without_culprits=3.0,
                       culprits=(cul,), spans=(span,), micro_batch_shares=(0.95, 0.05), unattributed_share=0.01,
                       loss_share=0.4, loss_without_culprits=1.5, note="")
    args = dict(incident_id="f" * 32, job=JOB, rank=1, step=n, time_unix=1.7e9, spike=spike, localization=loc,
                top_layers=(layer("head", 39.0),))
    args.update(kw)
    return Incident(**args)


def rl_stats(tokens: int = 100) -> RLStats:
    """A step's RL distributions: every token in the bucket just above 0 (log ratio) / 1 (advantage)."""
    lr = [0] * (len(RL_LOG_RATIO_BUCKETS) + 1)
    lr[RL_LOG_RATIO_BUCKETS.index(0.01)] = tokens
    adv = [0] * (len(RL_ADVANTAGE_BUCKETS) + 1)
    adv[RL_ADVANTAGE_BUCKETS.index(1.0)] = tokens
    return RLStats(tokens, tuple(lr), 0.005 * tokens, 0.3, 0.0, 0.9, 0.05, tuple(adv), 0.8 * tokens, 0.8, 2.5, 1.7,
                   kl_rollout=0.002, job_entropy_mean=1.7, job_kl_rollout=0.002)




def layer_names(n: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.mlp.down_proj" for i in range(n))


def columns(norms: Sequence[float], names: Sequence[str] | None = None,
            update_ratio: Sequence[float] | None = None) -> LayerColumns:
    """Layer columns with the given gradient norms (max_abs = norm / 10, ratios 1e-3 unless given)."""
    norms = np.asarray(norms, dtype=np.float64)
    n = len(norms)
    ratios = np.full(n, 1e-3) if update_ratio is None else update_ratio
    return LayerColumns.build(tuple(names) if names is not None else layer_names(n), norms, norms / 10,
                              np.zeros(n, dtype=np.int64), np.full(n, 10.0), np.full(n, 1000), ratios)


def summary(job: str, rank: int, n: int, layers: LayerColumns, *, time_unix: float, global_norm: float | None = None,
         loss: float | None = 2.5, grad_scale: float | None = None, tokens: bool = True,
         skipped: bool = False, overhead: float | None = 0.03, shed: tuple[str, ...] = (),
         rl: RLStats | None = None, band: tuple[float, float] | None = (1.2, 2.0),
         samples: SampleStats | None = None, precursors: tuple[PrecursorStat, ...] = (),
         precursor_findings: tuple[PrecursorFinding, ...] = ()) -> StepSummary:
    """One rank's step ``n``; the global norm defaults to the L2 norm of the finite layer norms."""
    if global_norm is None:
        finite = layers.grad_norm[np.isfinite(layers.grad_norm)]
        global_norm = float(np.sqrt(np.sum(finite ** 2)))
    stats = TokenStats(tokens=4096, total_score=20.0, top=(), top_share=0.25, micro_batch_shares=(0.5, 0.5),
                       unattributed_share=0.02) if tokens else None
    nonfinite = int(np.sum(~np.isfinite(layers.grad_norm)))
    return StepSummary(job=job, rank=rank, step=n, time_unix=time_unix, global_norm=global_norm, loss=loss, micro_batches=2,
                       layers=layers, tokens=stats, nonfinite=nonfinite, grad_scale=grad_scale, skipped=skipped,
                       overhead_s=None if overhead is None else 0.01, step_s=None if overhead is None else 0.34,
                       overhead=overhead, shed=shed, rl=rl, norm_mean=band and band[0], norm_threshold=band and band[1],
                       samples=samples, precursors=precursors, precursor_findings=precursor_findings)


def precursor_stats(layers: int = 2, heads: int = 2) -> tuple[PrecursorStat, ...]:
    """Every kind of precursor stat: attention per layer (and per head), the head, the final norm, one router with
    per-expert loads."""
    K = PrecursorKind
    out = []
    for i in range(layers):
        out += [PrecursorStat(kind=K.ATTN_MAX_LOGIT, layer=f"blocks.{i}.attn", value=4.0 + i, at=(0, 1, 7)),
                PrecursorStat(kind=K.ATTN_ENTROPY, layer=f"blocks.{i}.attn", value=1.5 - 0.1 * i, at=(1, 0, 3))]
        out += [PrecursorStat(kind=K.ATTN_MAX_LOGIT, layer=f"blocks.{i}.attn", value=3.0 + h, head=h)
                for h in range(heads)]
        out += [PrecursorStat(kind=K.ATTN_ENTROPY, layer=f"blocks.{i}.attn", value=1.6 + h, head=h) for h in range(heads)]
    out += [PrecursorStat(kind=K.LOGIT_MAX_ABS, layer="lm_head", value=12.5, at=(0, 0, 2)),
            PrecursorStat(kind=K.LOGIT_LSE_SQ, layer="lm_head", value=30.0),
            PrecursorStat(kind=K.RESIDUAL_RMS, layer="norm", value=2.2, at=(1, 1, 1)),
            PrecursorStat(kind=K.ROUTER_ENTROPY, layer="blocks.0.moe.gate", value=1.2),
            PrecursorStat(kind=K.EXPERT_LOAD_MAX, layer="blocks.0.moe.gate", value=1.8),
            PrecursorStat(kind=K.DEAD_EXPERTS, layer="blocks.0.moe.gate", value=0.0)]
    out += [PrecursorStat(kind=K.EXPERT_LOAD_MAX, layer="blocks.0.moe.gate", value=0.5 + 0.3 * e, head=e) for e in range(4)]
    return tuple(out)


def precursor_findings(job: str, rank: int, n: int, time_unix: float) -> tuple[PrecursorFinding, ...]:
    """A step's drift findings: an attention entropy falling (and its paging finding), a router's load rising."""
    where = dict(job=job, rank=rank, step=n, time_unix=time_unix)
    driver = PrecursorDriver(step=n - 1, value=0.3, micro_batch=1, sample=2, position=17, sample_id="uid-9")
    entropy = PrecursorFinding(**where, statistic="attn_entropy", layer="blocks.1.attn", trend="falling", value=0.4,
                               baseline=1.6, z=-7.5, change=0.25, rate=3.1, since_step=max(0, n - 40), drivers=(driver,),
                               detail="attn_entropy of blocks.1.attn falling")
    load = PrecursorFinding(**where, statistic="expert_load_max", layer="blocks.0.moe.gate", trend="rising", value=3.0,
                            baseline=1.1, z=9.0, change=2.7, rate=1.5, since_step=max(0, n - 20))
    return entropy, replace(entropy, pages=True), load


def sample_stats(job: str, rank: int, n: int, time_unix: float) -> SampleStats:
    """A step's per-sample judgement: 16 samples (one a surprise outlier) and an rl_mismatch finding."""
    where = dict(job=job, rank=rank, step=n, time_unix=time_unix)
    surprise = SampleOutlier(kind="surprise", **where, score=8.8, z=12.5, baseline=3.4, micro_batch=1, sample=2,
                             sample_id="uid-9", start=0, end=128, tokens=128, text="qzx vvk", detail="garbage")
    mismatch = SampleOutlier(kind="rl_mismatch", **where, score=0.35, z=30.0, baseline=0.0, tokens=2048)
    return SampleStats(judged=15, unjudged=1, z_counts=(6, 5, 3, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0), z_sum=9.0,
                       max_z=12.5, baseline=3.4, flagged=1, outliers=(surprise, mismatch), rl_mismatch_baseline=0.01)


def correlated(job: str, step_n: int, *, trace_id: str = TRACE_ID, global_norm: float = 42.0,
             ranks: Sequence[int] = (0, 1, 2), missing: Sequence[int] = (),
             kinds: tuple[str, ...] = ("grad_spike",), time_unix: float = 1_760_000_000.0,
             probes: int = 3, explained: float | None = 0.9, status: str | None = "located",
             remedy: Remedy | None = None, kind: str | None = "train_inference_mismatch") -> CorrelatedIncident:
    """A correlated incident whose every reporting rank has one finding of ``kinds`` (localized with
    ``status`` unless None; ``remedy`` on every finding)."""
    loc = None if status is None else Localization(step=step_n, method="attribution", status=status,
                                                   probes=probes, explained_share=explained,
                                                   global_norm=global_norm)
    findings = tuple(
        Incident(incident_id=f"{r:02d}{trace_id[2:]}", job=job, rank=r, step=step_n, time_unix=time_unix,
                 spike=SpikeEvent(step=step_n, kinds=kinds, global_norm=global_norm, z=30.0, mean=1.0, std=0.1),
                 localization=loc, remedy=remedy,
                 classification=None if kind is None else Classification(kind, "test"))
        for r in ranks)
    status = "partial" if missing else "complete"
    return CorrelatedIncident(
        incident_id=trace_id[::-1], trace_id=trace_id, job=job, step=step_n, time_unix=time_unix, status=status,
        kinds=kinds, global_norm=global_norm, ranks_expected=tuple(sorted((*ranks, *missing))),
        ranks_reported=tuple(ranks), ranks_missing=tuple(missing), rank_shares=(), micro_batch_shares=(),
        spans=(), findings=findings, closed_unix=time_unix + 1.0, explained_share=explained, probes=probes)


# -- one rank's small records (the correlator and agent tests) ----------------------------------------
def rank_summary(job: str, rank: int, step: int, total_score: float | None = 1.0,
            mb_shares: tuple[float, ...] = (0.5, 0.5)) -> StepSummary:
    """One rank's small step for the correlator and agent tests: one layer, token statistics of
    ``total_score`` (None: none) split over micro-batches as ``mb_shares``."""
    cols = LayerColumns.build(("a",), [1.0], [1.0], [0], [1.0], [4], [np.nan])
    tokens = None if total_score is None else TokenStats(tokens=64, total_score=total_score, top=(), top_share=0.1,
                                                         micro_batch_shares=mb_shares, unattributed_share=0.0)
    return StepSummary(job=job, rank=rank, step=step, time_unix=1000.0 + step, global_norm=2.0 + rank, loss=3.0,
                       micro_batches=len(mb_shares), layers=cols, tokens=tokens)


def rank_finding(job: str, rank: int, step: int, share: float = 0.8, text: str = " bad") -> Incident:
    """One rank's located finding (one culprit token, sample id ``s<rank>``) for the correlator and agent tests."""
    spike = SpikeEvent(step=step, kinds=("grad_spike",), global_norm=5.0, z=9.0, mean=1.0, std=0.3, layers=("head",))
    span = CulpritSpan(1, 0, 7, 8, share, (42,), text, "before", "after", f"s{rank}")
    loc = Localization(step=step, method="attribution", status="located", level="token", probes=1,
                       explained_share=share, global_norm=5.0, culprit_norm=4.0, norm_without_culprits=1.0,
                       spans=(span,))
    return Incident(incident_id=f"r{rank}", job=job, rank=rank, step=step, time_unix=1000.0 + step + rank,
                    spike=spike, localization=loc)


# -- stored and correlated ---------------------------------------------------------------------------
def _layers() -> tuple[LayerStats, ...]:
    return (LayerStats(layer="blocks.1.proj", grad_norm=0.031, grad_max_abs=0.004, nonfinite=0, param_norm=11.6,
                       numel=12480, update_ratio=None),
            LayerStats(layer="head", grad_norm=0.012, grad_max_abs=0.002, nonfinite=0, param_norm=20.1, numel=16384,
                       update_ratio=None))


def finding(rank: int, step: int, span: CulpritSpan, *, incident_id: str, time_unix: float,
            status: str = "located", explained: float | None = 0.93) -> Incident:
    """One rank's own incident, localized to ``span``."""
    spike = SpikeEvent(step=step, kinds=("grad_spike", "loss_spike"), global_norm=3.5, z=41.2, mean=0.8,
                       std=0.066, loss=2.9, loss_z=4.8, loss_mean=2.1, layers=("blocks.1.proj",), detail="",
                       last_healthy_step=step - 1 - rank)
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
        incident_id=incident_id, trace_id=PARTIAL_TRACE_ID, job=job, step=step, time_unix=time_unix, status="partial",
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
