"""The spike path of a DDP / FSDP2 job: every rank localizes together, one incident comes out.

Each rank attributes its own tokens (its hooks saw only its micro-batches). A spike is judged on the
job's step, identically on every rank (collector/job.py), so every rank enters this path together:

1. **Candidates** — one ``all_gather`` of a fixed-size summary per rank: its top-K tokens by the
   position-exact score (with their micro-batch), its median score, non-finite count and
   unattributed share. Every rank then ranks the union the same way (the core's thresholds, with
   the median of the ranks' medians) and knows which candidates are its own.
2. **Probes** — rounds of one probe per rank, up to ``max_probes``: a rank probes its next
   candidate micro-batch. Under DDP a probe runs in ``no_sync()`` (its backward must not start the
   gradient all-reduce on one rank only) and ranks without candidates idle; under FSDP2 a probe's
   forward and backward are collectives (parameter all-gather, gradient reduce-scatter), so every
   rank takes part in every round, with an all-false token mask when it has nothing to probe.
3. **Combine** — DDP: one all-reduce of ∇_C (summed over ranks, ÷ W as DDP averages), so every rank
   holds the job's ∇_C and computes the same shares; FSDP2: the probes' reduce-scatter already
   combined it, sharded, and one all-reduce of four scalars gives ⟨∇_C, ∇⟩, ‖∇_C‖², ‖∇ − ∇_C‖² and ℓ_C.
4. **Records** — every rank builds the records of its own culprits and spans (rank named in each)
   and one ``all_gather_object`` gives every rank the same localization. Rank 0 emits the incident.

Every collective has a deadline (``JobComm``); a timeout becomes an ``unavailable`` localization
naming it. Not done across ranks: growing the candidate set after a failed verification, and
bisection; the note says so.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, ContextManager

import numpy as np
import torch

from gradloc.adapters.dist import CollectiveTimeout, JobComm
from gradloc.adapters.spike import SpikeInputs, SpikePath, token_view
from gradloc.collector.layer_stats import local
from gradloc.localizer import ProbeSession, SpikeContext, StoredGradient
from gradloc.localizer.diffuse import describe
from gradloc.localizer.localizer import MAX_UNATTRIBUTED, LocalizeResult
from gradloc.localizer.probes import Grads, distance, dot, grad_norm
from gradloc.localizer.levels import pick_samples
from gradloc.localizer.spans import build_culprits, build_spans, range_span
from gradloc.localizer.token_view import TokenView
from gradloc.records import Level, Localization, Method, SampleShare, Status


class ProbeFailed(RuntimeError):
    """A probe raised on some rank; every rank learned it in the same collective."""


class DistSpikePath(SpikePath):
    scope = "job"

    def __init__(self, *args: Any, comm: JobComm, kind: str, probe_context: Callable[[], ContextManager[Any]],
                 deepspeed: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.comm, self.kind, self.probe_context = comm, kind, probe_context
        self.deepspeed = deepspeed  # DeepSpeedLayerStats of a DeepSpeed engine (probes by autograd.grad)
        # FSDP2 and ZeRO-3 gather parameters in a probe's forward: every rank probes in every round
        self.lockstep = kind == "fsdp" or (deepspeed is not None and deepspeed.lockstep_probes)

    def _localize(self, x: SpikeInputs) -> LocalizeResult:
        self._error = ""
        try:
            return self._job_localize(x)
        except CollectiveTimeout as exc:
            self.counters["collective_timeouts"] += 1
            return LocalizeResult(self._unavailable(x, f"localization failed: {exc}"))
        except ProbeFailed as exc:  # every rank got here together: the job's collectives stay in lockstep
            self.counters["probe_errors"] += 1
            return LocalizeResult(self._unavailable(x, f"localization failed: {exc}"))
        except Exception as exc:  # never raise into the training loop (the other ranks time out)
            self.counters["localize_errors"] += 1
            return LocalizeResult(self._unavailable(x, f"localization failed on rank {self.comm.rank}: "
                                                       f"{type(exc).__name__}: {exc}"))

    def _unavailable(self, x: SpikeInputs, note: str) -> Localization:
        return Localization(step=x.record.step, method=Method.NONE, status=Status.UNAVAILABLE, probes=0,
                            global_norm=x.record.global_norm, note=note)

    # -- 1. candidates --------------------------------------------------------------------------
    def _job_localize(self, x: SpikeInputs) -> LocalizeResult:
        rec, cfg, W = x.record, self.localizer.cfg, self.comm.world_size
        view = token_view(x.scores, self.token_layers, x.scale, rec.tokens.unattributed_share if rec.tokens else 1.0, x.rl)
        summary = _summary(view, cfg.max_candidates)
        summary[-1] = float(view is not None and view.scores.size > 0) + 2.0 * float(x.probe is not None)
        rows = self.comm.all_gather(summary, "gradloc candidates").numpy()  # (W, 3K + 5)
        K = cfg.max_candidates
        if not (rows[:, 3 * K + 4] % 2).all():
            return LocalizeResult(self._unavailable(x, "a rank has no per-token statistics for this step"))
        if rows[:, 3 * K + 1].any():
            return self._nonfinite(x, view, rows)
        if (rows[:, 3 * K + 2] > MAX_UNATTRIBUTED).any():
            return LocalizeResult(self._unavailable(x, "attribution unavailable on a rank (unattributed share above "
                                                       f"{MAX_UNATTRIBUTED:.0%}); bisection does not run across ranks"))
        cands = _global_candidates(rows, K, cfg.candidate_rel_score, cfg.candidate_outlier_factor)
        mine = [(flat, mb) for (_, r, flat, mb) in cands if r == self.comm.rank]
        job_total = float(rows[:, 3 * K + 3].sum())
        if not (rows[:, 3 * K + 4] >= 2).all():  # a rank without a probe closure: attribution only, no probes
            return LocalizeResult(self._unverified(x, view, cands, mine, job_total))
        groups = _groups(mine, view)
        n_groups = [len({mb for (_, r2, _, mb) in cands if r2 == r}) for r in range(W)]
        rounds = min(cfg.max_probes, max(n_groups, default=0))
        stored = StoredGradient([p.grad for p in self.params], 1.0 if x.unscaled else 1.0 / x.scale, rec.global_norm)
        ctx = SpikeContext(x.spike.mean, x.job_loss, x.spike.loss_mean, x.spike.std, self.cfg.detector.z_threshold)
        with self._session(x) as session:
            g_c, loss_c = self._probe_rounds(session, view, [g for g in groups[:rounds]], rounds)
            if cands:
                explained, c_norm, without, loss_c = self._combine(stored, g_c, loss_c)
                if self.localizer._verified(explained, stored.norm, loss_c, ctx):
                    note = _note(n_groups, rounds, W)
                    loc = self._located(x, view, cands, mine, explained, c_norm, without, loss_c, rounds, note, ctx,
                                        job_total)
                    return LocalizeResult(loc, g_c if self.cfg.remedy == "drop_culprits" else None)
                why = (f"the top {len(cands)} attributed token(s) on {len({c[1] for c in cands})} rank(s) explain only "
                       f"{explained:.2f} of ‖∇‖² and less than half of the spike's excess")
            else:
                why = "no token stands out in any rank's attribution scores"
            del g_c
            return LocalizeResult(self._diffuse(x, view, stored, session, rounds, why, job_total, ctx))

    def _session(self, x: SpikeInputs) -> Any:
        if self.deepspeed is not None:
            from gradloc.adapters.deepspeed.stats import AutogradProbeSession

            gas = int(self.deepspeed.engine.gradient_accumulation_steps())
            return _Session(AutogradProbeSession(self.model, self.params, x.scores.metas, x.probe, self.pause_hooks,
                                                 loss_factor=1.0 / gas), self.probe_context())
        return _Session(ProbeSession(self.model, self.params, x.scores.metas, x.probe, self.pause_hooks),
                        self.probe_context())

    # -- 2./3. probe rounds and the combine -------------------------------------------------------
    def _probe_rounds(self, session: ProbeSession, view: TokenView, groups: list[tuple[int, np.ndarray]],
                      rounds: int) -> tuple[Grads, float]:
        g_c: Grads = [None] * len(self.params)
        for i in range(rounds):
            if i < len(groups) and not self._error:
                m, flats = groups[i]
                try:
                    g_c = session.add_to(g_c, view.metas[m].index, torch.from_numpy(view.mask_for(m, flats)))
                except Exception as exc:  # noqa: BLE001 - DDP: carry on with nothing, so no rank waits
                    if self.lockstep:
                        raise  # its forward/backward are collectives: the other ranks time out
                    self._error = f"the probe on rank {self.comm.rank} failed: {type(exc).__name__}: {exc}"
            elif self.lockstep:  # a collective: take part with nothing to probe
                meta = view.metas[0]
                g_c = session.add_to(g_c, meta.index, torch.zeros(meta.batch, meta.seq, dtype=torch.bool))
                session.losses.pop()
        return g_c, float(sum(session.losses))

    def _combine(self, stored: StoredGradient, g_c: Grads, loss_c: float) -> tuple[float, float, float, float]:
        W = self.comm.world_size
        if self.deepspeed is not None:
            from gradloc.adapters.deepspeed.stats import zero_combine

            *out, failed = zero_combine(self.deepspeed.access, self.comm, g_c, loss_c, bool(self._error),
                                        stored.norm ** 2)
            if failed:
                raise ProbeFailed("; ".join(e for e in self.comm.all_gather_object(self._error, "gradloc probe errors") if e))
            return tuple(out)  # type: ignore[return-value]
        if self.kind == "fsdp":  # g_c and the stored gradient are this rank's shards of the job's
            gl, sl = [None if g is None else local(g) for g in g_c], [None if g is None else local(g) for g in stored.grads]
            parts = torch.tensor([dot(gl, sl, stored.inv_scale), grad_norm(gl) ** 2,
                                  distance(sl, gl, stored.inv_scale) ** 2, loss_c], dtype=torch.float64)
            inner, c_sq, d_sq, loss = self.comm.all_reduce(parts, what="gradloc probe combine").tolist()
            total_sq = stored.norm ** 2
            return (inner / total_sq if total_sq > 0 else math.nan), math.sqrt(c_sq), math.sqrt(d_sq), loss / W
        full = [g if g is not None else torch.zeros_like(p) for g, p in zip(g_c, self.params)]
        self.comm.all_reduce_(full, "gradloc probe combine")  # DDP: Σ over ranks …
        torch._foreach_div_(full, float(W))  # … averaged, as DDP averages the training gradient
        g_c[:] = full
        flags = self.comm.all_reduce(torch.tensor([loss_c, float(bool(self._error))], dtype=torch.float64),
                                     what="gradloc probe loss")
        if flags[1] > 0:  # every rank learns what failed where (one more collective, on this path only)
            errors = self.comm.all_gather_object(self._error, "gradloc probe errors")
            raise ProbeFailed("; ".join(e for e in errors if e))
        loss = float(flags[0])
        total_sq = stored.norm ** 2
        inner = dot(full, stored.grads, stored.inv_scale)
        return (inner / total_sq if total_sq > 0 else math.nan), grad_norm(full), \
            distance(stored.grads, full, stored.inv_scale), loss / W

    # -- 4. records ---------------------------------------------------------------------------
    def _located(self, x: SpikeInputs, view: TokenView, cands: list, mine: list, explained: float, c_norm: float,
                 without: float, loss_c: float, rounds: int, note: str, ctx: SpikeContext,
                 job_total: float) -> Localization:
        total_score = sum(c[0] for c in cands)
        flats = [f for f, _ in mine]
        shares = [explained * float(view.rank_scores[f]) / total_score for f in flats] if total_score > 0 else [math.nan] * len(flats)
        culprits = [replace(c, rank=self.comm.rank) for c in build_culprits(view, flats, shares, self.localizer.decode)]
        spans = [replace(s, rank=self.comm.rank) for s in build_spans(view, culprits, self.localizer.decode,
                                                                   self.localizer.cfg.context_tokens)]
        every = self.comm.all_gather_object((culprits, spans, _top_samples(view)), "gradloc culprit records")
        all_c = sorted((c for e in every for c in e[0]), key=lambda c: -c.share if math.isfinite(c.share) else 0.0)
        all_s = sorted((s for e in every for s in e[1]), key=lambda s: -s.share if math.isfinite(s.share) else 0.0)
        loss_share = loss_c / ctx.loss if ctx.loss else None
        return Localization(step=x.record.step, method=Method.ATTRIBUTION, status=Status.LOCATED,
                            level=Level.SPAN if any(s.end - s.start > 1 for s in all_s) else Level.TOKEN,
                            probes=rounds, explained_share=explained, global_norm=x.record.global_norm,
                            culprit_norm=c_norm, norm_without_culprits=without, culprits=tuple(all_c),
                            spans=tuple(all_s), unattributed_share=view.unattributed_share, loss_share=loss_share,
                            loss_without_culprits=(ctx.loss - loss_c) if ctx.loss is not None else None, note=note,
                            samples=_merge_samples([e[2] for e in every], job_total))

    def _nonfinite(self, x: SpikeInputs, view: TokenView, rows: np.ndarray) -> LocalizeResult:
        bad = np.flatnonzero(view.eligible & ~(np.isfinite(view.scores) & np.isfinite(view.rank_scores)))
        bad = bad[: self.localizer.cfg.max_candidates]
        culprits = [replace(c, rank=self.comm.rank) for c in build_culprits(view, [int(b) for b in bad],
                                                                            [math.nan] * bad.size, self.localizer.decode)]
        every = self.comm.all_gather_object(culprits, "gradloc non-finite records")
        loc = Localization(step=x.record.step, method=Method.ATTRIBUTION, status=Status.LOCATED, level=Level.TOKEN,
                           probes=0, global_norm=x.record.global_norm, culprits=tuple(c for e in every for c in e),
                           note="non-finite gradient: culprits are the positions where it appears, on the ranks "
                                "where it appears")
        return LocalizeResult(loc)

    def _unverified(self, x: SpikeInputs, view: TokenView, cands: list, mine: list, job_total: float) -> Localization:
        flats = [f for f, _ in mine]
        shares = [float(view.rank_scores[f]) / job_total for f in flats] if job_total > 0 else [math.nan] * len(flats)
        culprits = [replace(c, rank=self.comm.rank) for c in build_culprits(view, flats, shares, self.localizer.decode)]
        spans = [replace(s, rank=self.comm.rank) for s in build_spans(view, culprits, self.localizer.decode,
                                                                   self.localizer.cfg.context_tokens)]
        every = self.comm.all_gather_object((culprits, spans, _top_samples(view)), "gradloc culprit records")
        return Localization(step=x.record.step, method=Method.ATTRIBUTION,
                            status=Status.UNVERIFIED if cands else Status.DIFFUSE, probes=0,
                            global_norm=x.record.global_norm, culprits=tuple(c for e in every for c in e[0]),
                            spans=tuple(s for e in every for s in e[1]), unattributed_share=view.unattributed_share,
                            note="a rank gave no probe closure: shares are attribution scores",
                            samples=_merge_samples([e[2] for e in every], job_total))

    def _diffuse(self, x: SpikeInputs, view: TokenView, stored: StoredGradient, session: ProbeSession, used: int,
                 why: str, job_total: float, ctx: SpikeContext) -> Localization:
        every = self.comm.all_gather_object(_top_samples(view), "gradloc samples")
        samples = list(_merge_samples(every, job_total))
        left = self.localizer.cfg.max_probes - used
        for i, s in enumerate(samples[:max(left, 0)]):
            mine = s.rank == self.comm.rank
            flats = view.sample_flats(_meta_pos(view, s.micro_batch), s.sample) if mine else np.zeros(0, dtype=np.int64)
            g, loss = self._probe_rounds(session, view, [(_meta_pos(view, s.micro_batch), flats)] if mine else [], 1)
            explained = self._combine(stored, g, loss)[0]
            samples[i] = replace(s, share=explained)
        n = int(self.comm.all_reduce(torch.tensor([sum(m.n_samples for m in view.metas)], dtype=torch.float64)))
        probes = used + min(max(left, 0), len(samples))
        promoted = _promote(samples, lambda share: self.localizer._verified(share, stored.norm, 0.0, ctx), n)
        if promoted is not None:  # a measured sample carries it: name it (sample level; no decomposition across ranks)
            share, spans = promoted
            spans = self._sample_spans(view, spans)
            return Localization(step=x.record.step, method=Method.ATTRIBUTION, status=Status.LOCATED,
                                level=Level.SAMPLE, probes=probes, explained_share=share,
                                global_norm=x.record.global_norm, spans=spans,
                                unattributed_share=view.unattributed_share, samples=tuple(samples),
                                note=f"{why}; {len(spans)} sample(s) measured by probes carry {share:.0%} of ‖∇‖² "
                                     "(sample level; the decomposition probe does not run across ranks yet)")
        return Localization(step=x.record.step, method=Method.ATTRIBUTION, status=Status.DIFFUSE, probes=probes,
                            global_norm=x.record.global_norm, unattributed_share=view.unattributed_share,
                            note=f"{why}; {describe(tuple(samples), n)}", samples=tuple(samples))


    def _sample_spans(self, view: TokenView, samples: list[SampleShare]) -> tuple:
        """Each culprit sample's loss tokens as one span, built by the rank that holds it, gathered."""
        mine = []
        for s in samples:
            if s.rank != self.comm.rank:
                continue
            m = _meta_pos(view, s.micro_batch)
            pos = view.sample_flats(m, s.sample) - view.offsets[m] - view.metas[m].bounds(s.sample)[0]
            span = range_span(view, m, s.sample, int(pos[0]), int(pos[-1]) + 1, float(s.share),
                              self.localizer.decode, self.localizer.cfg.context_tokens)
            mine.append(replace(span, rank=self.comm.rank))
        every = self.comm.all_gather_object(mine, "gradloc culprit samples")
        return tuple(sorted((sp for e in every for sp in e), key=lambda sp: -sp.share))


def _promote(samples: list[SampleShare], passes: Callable[[float], bool],
             n_samples: int) -> tuple[float, list[SampleShare]] | None:
    """(their share, the samples) of the smallest verified union of the measured samples, or None."""
    ranked = sorted((s for s in samples if s.share is not None and math.isfinite(s.share) and s.tokens > 0),
                    key=lambda s: -s.share)
    verdict = pick_samples([(i, s.share, s.tokens) for i, s in enumerate(ranked)], passes, n_samples)
    return (verdict.explained, [ranked[i] for i in verdict.culprits]) if verdict.culprits else None


class _Session:
    """A probe session inside the job's probe context (DDP: no_sync)."""

    def __init__(self, session: ProbeSession, context: ContextManager[Any]) -> None:
        self.session, self.context = session, context

    def __enter__(self) -> ProbeSession:
        self.context.__enter__()
        return self.session.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.session.__exit__(*exc)
        finally:
            self.context.__exit__(*exc)


def _summary(view: TokenView | None, K: int) -> torch.Tensor:
    """[top-K scores | their flats | their micro-batch positions | median | non-finite | unattributed | has view]."""
    out = torch.zeros(3 * K + 5, dtype=torch.float64)
    out[K:3 * K] = -1
    if view is None or view.scores.size == 0:
        return out
    s = np.where(view.eligible, view.rank_scores, 0.0)
    bad = view.eligible & ~(np.isfinite(view.scores) & np.isfinite(view.rank_scores))
    finite = np.where(np.isfinite(s), s, 0.0)
    order = np.argsort(-finite, kind="stable")[:K]
    n = order.size
    out[:n] = torch.from_numpy(finite[order])
    out[K:K + n] = torch.from_numpy(order.astype(np.float64))
    out[2 * K:2 * K + n] = torch.tensor([float(view.locate(int(f))[0]) for f in order], dtype=torch.float64)
    pool = finite[view.eligible]
    out[3 * K] = float(np.median(pool)) if pool.size else 0.0
    out[3 * K + 1:3 * K + 5] = torch.tensor([float(bad.sum()), view.unattributed_share, float(view.scores.sum()), 1.0])
    return out


def _global_candidates(rows: np.ndarray, K: int, rel: float, outlier: float) -> list[tuple[float, int, int, int]]:
    """(score, rank, flat, micro-batch position) of the job's candidates, best first (the same on every rank)."""
    entries = [(float(rows[r, j]), r, int(rows[r, K + j]), int(rows[r, 2 * K + j]))
               for r in range(rows.shape[0]) for j in range(K) if rows[r, K + j] >= 0 and rows[r, j] > 0]
    if not entries:
        return []
    top = max(e[0] for e in entries)
    median = float(np.median(rows[:, 3 * K]))
    floor = max(rel * top, outlier * median)
    return sorted((e for e in entries if e[0] >= floor), key=lambda e: (-e[0], e[1], e[2]))[:K]


def _groups(mine: list[tuple[int, int]], view: TokenView | None) -> list[tuple[int, np.ndarray]]:
    """This rank's candidates by micro-batch position, the highest-scoring group first."""
    by: dict[int, list[int]] = {}
    for flat, mb in mine:
        by.setdefault(mb, []).append(flat)
    order = sorted(by, key=lambda m: -sum(view.rank_scores[f] for f in by[m]) if view is not None else 0)
    return [(m, np.asarray(by[m], dtype=np.int64)) for m in order]


def _note(n_groups: list[int], rounds: int, world: int) -> str:
    skipped = sum(max(n - rounds, 0) for n in n_groups)
    note = f"{rounds} probe round(s), each rank probing its own candidates in parallel across {world} ranks"
    return note + (f"; candidates in {skipped} more micro-batch(es) not probed (max_probes)" if skipped else "")


def _top_samples(view: TokenView) -> list[tuple[float, int, int, str | None, int]]:
    """(score, micro-batch index, sample, sample id, loss tokens) of this rank's top samples."""
    out = []
    for m, b, score, n_loss in view.sample_totals()[:5]:
        meta = view.metas[m]
        out.append((score, meta.index, b, meta.sample_id(b), n_loss))
    return out


def _merge_samples(every: list[list[tuple[float, int, int, str | None, int]]], total: float) -> tuple[SampleShare, ...]:
    total = total if total > 0 else math.nan
    merged = sorted(((s, r) for r, rank in enumerate(every) for s in rank), key=lambda e: -e[0][0])[:5]
    return tuple(SampleShare(mb, b, score / total, None, sid, n, r) for (score, mb, b, sid, n), r in merged)


def _meta_pos(view: TokenView, micro_batch: int) -> int:
    return next(i for i, m in enumerate(view.metas) if m.index == micro_batch)
