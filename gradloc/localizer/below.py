"""When no small token set explains a spike: find the sample, span or micro-batch that does.

What is left of the ≤ ``max_probes`` budget goes, micro-batch by micro-batch (the job's micro-batch
holding the top-scoring sample first), to the decomposition probe (``decompose.py``) on the rank that
holds it: one probe and two forward-only passes measure every sample's and every token's exact share
of ‖∇‖² in that micro-batch. ``levels.py`` turns the shares into a verdict: a culprit sample (its
span when one carries it), else the micro-batch, else the next micro-batch. A probe left after a
verdict re-measures the culprit samples exactly (∇_S itself: ‖∇ − ∇_S‖, ℓ_S, and the gradient the
opt-in remedy drops).

Without a decomposition (the exact layer is not one module, a scope whose stored gradient is not
whole on one rank — FSDP2, ZeRO — or a failure), each remaining probe measures one top sample
instead, and a measured sample that passes is still named (``sample`` level). In a job, a rank whose
micro-batches could carry the spike together is measured as a whole after a measurement on it found
nothing smaller (``ranks.py``: ``rank`` level). Nothing passes: ``diffuse``, with every measured
share reported. Every rank takes the same path: the owner's results
reach the others through ``all_gather_object``.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from gradloc.localizer.context import LocalizeResult, out_of_band
from gradloc.localizer.decompose import decompose
from gradloc.localizer.diffuse import TOP_SAMPLES, describe
from gradloc.localizer.levels import micro_batch_passes, pick_samples, regions_of, sample_measures, top_tokens
from gradloc.localizer.ranks import Ranks
from gradloc.localizer.runner import Runner
from gradloc.localizer.spans import build_culprits, range_span
from gradloc.records import CulpritGroup, Level, Method, SampleShare, Status

MAX_CLOSURE_ERROR = 0.25  # a decomposition whose Σ c_t misses the probe's ⟨∇_mb, ∇⟩ by more is not trusted


class Below:
    def __init__(self, run: Runner, why: str) -> None:
        self.r, self.notes = run, [why]
        self.passes = 0
        self.measured: list[SampleShare] = []
        self.pending: list[tuple] = []  # outlier samples of the micro-batches decomposed so far (_verdict)
        self.order: list[tuple[int, int]] = []  # (rank, view position) to decompose, set by run()
        self.flagged: set[tuple[int, int]] = set()  # ... of those holding a per-sample surprise outlier
        self.n = run.n_samples()
        self._dec: tuple | None = None  # (c, gradient, loss) of the last decomposition on this rank
        self.ranks = None if run.solo else Ranks(run, self)  # the rank level (W > 1)

    def run(self) -> LocalizeResult:
        r = self.r
        if r.all_ranks(r.scope.decomposes and r.head is not None):
            self.order = self._micro_batch_order()
            for owner, m in self.order:
                if r.left <= 0:
                    break
                got = self._decompose(owner, m)
                if got["error"]:
                    self.notes.append(f"decomposition unavailable ({got['error']})")
                    break
                if got["closure_error"] > MAX_CLOSURE_ERROR:
                    self.notes.append(f"decomposition of micro-batch {got['index']} off by {got['closure_error']:.0%} "
                                      "(not trusted)")
                    continue
                found = self._verdict(owner, m, got)
                if found is None and self.ranks is not None:
                    found = self.ranks.after_decomposition(owner, got["explained"], self._dec)
                if found is not None:
                    return found
        if not self.measured:
            return self._by_sample_probes()
        return LocalizeResult(self._diffuse())

    # -- decomposition --------------------------------------------------------------------------
    def _micro_batch_order(self) -> list[tuple[int, int]]:
        """(rank, view position) of the job's micro-batches: those holding a per-sample surprise
        outlier of the step first (SpikeContext.outliers: the odd sample is known), then by their best
        sample's score, best first. Attribution scores are sums of squares: a coherent bad sample (a
        truncated document's predictable padding) can score below a healthy one."""
        view = self.r.view
        odd = {m for m, meta in enumerate(view.metas) for mb, _ in self.r.ctx.outliers if mb == meta.index}
        best: dict[int, float] = {}
        for m, _, score, _ in view.sample_totals():
            best.setdefault(m, score if math.isfinite(score) else 0.0)
        items = sorted((m, score, m in odd) for m, score in best.items())
        every = self.r.comm.all_gather_object(items, "gradloc micro-batch order")
        merged = [(not flagged, -score, rank, m) for rank, items in enumerate(every) for m, score, flagged in items]
        self.m_total = len(merged)
        self.flagged = {(rank, m) for odd, _, rank, m in merged if not odd}
        return [(rank, m) for _, _, rank, m in sorted(merged)]

    def _decompose(self, owner: int, m: int) -> dict:
        r, payload = self.r, None
        self._dec = None
        if owner == r.rank:
            view, st = r.view, r.stored
            meta = view.metas[m]
            a, b = view.offsets[m], view.offsets[m + 1]
            mask = view.mask(m, np.flatnonzero(view.eligible[a:b]) + a)
            try:
                dec = decompose(r.session, meta.index, mask, st.grads, st.inv_scale, st.norm ** 2, r.head)
                k = r.scope.contribution  # DDP: a rank's own gradient enters the job's averaged
                c = dec.c * k
                self._dec = (c, dec.grad, dec.loss)  # c as the job sees it; the gradient and loss as probed here
                measures = [(s, share, n, meta.sample_id(s), _score_share(r, m, s))
                            for s, share, n in sample_measures(view, m, c)]
                payload = {"error": "", "closure_error": dec.closure_error, "explained": dec.explained * k,
                           "loss": dec.loss * k, "measures": measures, "index": meta.index,
                           "samples": meta.n_samples, "tokens": int(view.eligible[a:b].sum())}
            except Exception as exc:  # noqa: BLE001 - an unusual model: fall back to sample probes
                payload = {"error": f"{type(exc).__name__}: {exc}"}
        got = r.comm.all_gather_object(payload, "gradloc decomposition")[owner]
        r.spend()
        self.passes += 2
        return got

    def _verdict(self, owner: int, m: int, got: dict) -> LocalizeResult | None:
        r = self.r
        rank = None if r.solo else owner
        self.measured += [SampleShare(micro_batch=got["index"], sample=s, score_share=ss, share=share, sample_id=sid,
                                      tokens=n, rank=rank) for s, share, n, sid, ss in got["measures"][:TOP_SAMPLES]]
        # this micro-batch's outlier samples; with those of micro-batches measured before (the copies of
        # a duplicated bad sample), named when their union passes verification
        odd = pick_samples([(s, share, n) for s, share, n, _, _ in got["measures"]], lambda x: True, self.n)
        if odd.culprits:
            self.pending.append((owner, m, odd, got["index"], self._dec))
            if r.verified(sum(v.explained for _, _, v, _, _ in self.pending)):
                return self._sample_level([*self.pending, *self._other_outliers(owner, m)])
        if micro_batch_passes(got["explained"], self.m_total,
                              lambda x: r.verified(x)):
            mine = self._dec[1] if self._dec is not None else [None] * len(r.stored.grads)
            explained, loss = r.scope.measure(mine, self._dec[2] if self._dec is not None else 0.0, "")
            norms = r.scope.norms(mine)
            if self.ranks is not None and out_of_band(norms[1], r.ctx):  # not the whole story: its rank?
                found = self.ranks.beyond_micro_batch(owner, got["explained"])
                if found is not None:
                    return found
            self.notes.append(f"micro-batch {got['index']} carries it; no sample of it alone does")
            group = CulpritGroup(share=explained, micro_batch=got["index"], rank=None if r.solo else owner,
                                 samples=got["samples"], tokens=got["tokens"])
            loc = r.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=Level.MICRO_BATCH, probes=r.used,
                           passes=self.passes, samples=self.samples(), note="; ".join(self.notes),
                           explained=explained, norms=norms, loss=loss, groups=(group,))
            return LocalizeResult(loc, mine if r.keep_grad else None)
        self.notes.append(f"micro-batch {got['index']} measured: {got['explained']:.0%} of ‖∇‖², no sample of it passes alone")
        return None

    def _other_outliers(self, owner: int, m: int) -> list[tuple]:
        """The culprit samples of the other micro-batches holding a per-sample surprise outlier (the
        second copy of a duplicated bad sample), decomposed with the probes left: (owner, view
        position, verdict, micro-batch index, decomposition). Their shares add exactly to the first
        micro-batch's; a sample is named when it is an outlier (``pick_samples``' floor), the union
        having passed already."""
        r, out = self.r, []
        done = {(o, mm) for o, mm, *_ in self.pending}
        for o2, m2 in self.order:
            if (o2, m2) in done or (o2, m2) not in self.flagged or r.left <= 0:
                continue
            got = self._decompose(o2, m2)
            if got["error"] or got["closure_error"] > MAX_CLOSURE_ERROR:
                self.notes.append(f"micro-batch {got.get('index', '?')} with an odd sample: no usable decomposition")
                continue
            rank = None if r.solo else o2
            self.measured += [SampleShare(micro_batch=got["index"], sample=s, score_share=ss, share=share,
                                          sample_id=sid, tokens=n, rank=rank)
                              for s, share, n, sid, ss in got["measures"][:TOP_SAMPLES]]
            verdict = pick_samples([(s, share, n) for s, share, n, _, _ in got["measures"]], lambda x: True, self.n)
            if verdict.culprits:
                out.append((o2, m2, verdict, got["index"], self._dec))
        return out

    def _sample_level(self, parts: list[tuple]) -> LocalizeResult:
        """``parts``: (owner, view position, SampleVerdict, micro-batch index, decomposition) per
        micro-batch with culprit samples."""
        r = self.r
        (owner, m, verdict, _, _), more = parts[0], parts[1:]
        explained, norms, loss, grad = sum(v.explained for _, _, v, _, _ in parts), (None, None), None, None
        # culprits in several micro-batches: their decomposed shares add up (one probe round covers one
        # micro-batch per rank, so they are not re-measured together)
        if not more and r.left > 0:  # measure the culprit samples themselves
            group = None
            if owner == r.rank:
                group = (m, np.concatenate([r.view.sample_flats(m, b) for b in verdict.culprits]))
            start = len(r.session.losses)
            acc, err = r.probe_round([None] * len(r.stored.grads), group)
            exact, loss = r.scope.measure(acc, float(sum(r.session.losses[start:])), err)
            norms = r.scope.norms(acc)
            r.spend()
            self.notes.append(f"the decomposition gave {explained:.0%}, a probe of the sample(s) {exact:.0%}")
            explained, grad = exact, (acc if r.keep_grad else None)
        levels, culprits, spans = set(), [], []
        for o, mm, v, _, dec in parts:
            payload = self._regions(mm, v, dec) if o == r.rank else None
            lv, cs, ss = r.comm.all_gather_object(payload, "gradloc culprit samples")[o]
            levels.add(lv)
            culprits += cs
            spans += ss
        level = levels.pop() if len(levels) == 1 else Level.SPAN
        if more:  # one list over the micro-batches, largest share first
            culprits, spans = sorted(culprits, key=lambda x: -x.share), sorted(spans, key=lambda x: -x.share)
        culprits, spans = tuple(culprits), tuple(spans)
        what = "; ".join(", ".join(f"sample {b}" for b in v.culprits) + f" of micro-batch {i}" for _, _, v, i, _ in parts)
        n_named = sum(len(v.culprits) for _, _, v, _, _ in parts)
        self.notes.append(f"{what} carr{'ies' if n_named == 1 else 'y'} {explained:.0%} of ‖∇‖² "
                          f"({level.value} level)")
        loc = r.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=level, probes=r.used,
                       passes=self.passes, culprits=culprits, spans=spans, samples=self.samples(),
                       note="; ".join(self.notes), explained=explained, norms=norms, loss=loss)
        return LocalizeResult(loc, grad)

    def _regions(self, m: int, verdict, dec: tuple) -> tuple:  # noqa: ANN001 - levels.SampleVerdict
        """(level, culprits, spans) of the culprit samples, on the rank that holds them (``dec``: that
        micro-batch's decomposition)."""
        r, (c, _, _) = self.r, dec
        share_of = {b: s for b, s, _ in verdict.samples}
        levels, regions = [], []
        for b in verdict.culprits:
            level, rs = regions_of(r.view, m, b, c, share_of[b])
            levels.append(level)
            regions += rs
        level = levels[0] if len(set(levels)) == 1 else Level.SPAN
        flats = top_tokens(r.view, regions, c)
        base = r.view.offsets[m]
        culprits = build_culprits(r.view, flats, [float(c[f - base]) for f in flats], r.decode)
        spans = tuple(range_span(r.view, x.m, x.sample, x.start, x.end, x.share, r.decode, r.cfg.context_tokens)
                      for x in regions)
        if not r.solo:
            culprits = tuple(replace(x, rank=r.rank) for x in culprits)
            spans = tuple(replace(x, rank=r.rank) for x in spans)
        return level, culprits, spans

    # -- without a decomposition --------------------------------------------------------------
    def _by_sample_probes(self) -> LocalizeResult:
        r = self.r
        every = r.comm.all_gather_object([(score, m, b, n, r.view.metas[m].index)
                                          for m, b, score, n in r.view.sample_totals()[:TOP_SAMPLES]], "gradloc samples")
        top = sorted(((score, rank, m, b, n, index) for rank, items in enumerate(every) for score, m, b, n, index in items),
                     key=lambda e: (-e[0] if math.isfinite(e[0]) else 0.0, e[1]))[:TOP_SAMPLES]
        measured: list[tuple[float, int, int, int, int, int]] = []  # (share, rank, view position, sample, tokens, index)
        for score, rank, m, b, n, index in top:
            if r.left <= 0:
                break
            if n == 0:
                continue
            group = (m, r.view.sample_flats(m, b)) if rank == r.rank else None
            start = len(r.session.losses)
            acc, err = r.probe_round([None] * len(r.stored.grads), group)
            share, _ = r.scope.measure(acc, float(sum(r.session.losses[start:])), err)
            del acc
            r.spend()
            measured.append((share, rank, m, b, n, index))
            if self.ranks is not None and not self._passing(measured).culprits:
                self.measured = self._with_shares(measured)
                found = self.ranks.after_sample_probe(rank, share)
                if found is not None:
                    return found
        ranked = sorted(measured, key=lambda e: -e[0])
        verdict = self._passing(ranked)
        self.measured = self._with_shares(measured)
        if not verdict.culprits:
            return LocalizeResult(self._diffuse())
        mine = [ranked[i] for i in verdict.culprits if ranked[i][1] == r.rank]
        spans = []
        for share, _, m, b, _, _ in mine:
            pos = r.view.sample_flats(m, b) - r.view.offsets[m] - r.view.metas[m].bounds(b)[0]
            span = range_span(r.view, m, b, int(pos[0]), int(pos[-1]) + 1, share, r.decode, r.cfg.context_tokens)
            spans.append(span if r.solo else replace(span, rank=r.rank))
        spans = sorted((x for e in r.comm.all_gather_object(spans, "gradloc culprit samples") for x in e),
                       key=lambda x: -x.share)
        self.notes.append(f"{len(spans)} sample(s) measured by probes carry {verdict.explained:.0%} of ‖∇‖² "
                          "(sample level; no decomposition, so no span inside them)")
        loc = r.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=Level.SAMPLE, probes=r.used,
                       spans=tuple(spans), samples=self.samples(), note="; ".join(self.notes),
                       explained=verdict.explained)
        return LocalizeResult(loc)

    def _passing(self, measured: list[tuple]):  # noqa: ANN202 - levels.SampleVerdict
        """The sample verdict on probed samples (share, rank, view position, sample, tokens, index), best first."""
        r = self.r
        return pick_samples([(i, e[0], e[4]) for i, e in enumerate(measured)],
                            lambda x: r.verified(x), self.n)

    def _with_shares(self, measured: list[tuple]) -> list[SampleShare]:
        """The job's top samples, with the probed ones' measured shares."""
        shares = {(e[1], e[5], e[3]): e[0] for e in measured}
        return [replace(s, share=shares.get((s.rank or 0, s.micro_batch, s.sample), s.share)) for s in self._attributed()]

    # -- records ------------------------------------------------------------------------------
    def _attributed(self) -> tuple[SampleShare, ...]:
        from gradloc.localizer.picture import merge_samples, top_samples

        every = self.r.comm.all_gather_object(top_samples(self.r.view), "gradloc top samples")
        return merge_samples(every, self.r.pic.total_score, not self.r.solo)

    def samples(self) -> tuple[SampleShare, ...]:
        """The job's top samples for the record: the measured ones first (their shares), then by attribution."""
        seen = {(s.rank, s.micro_batch, s.sample) for s in self.measured}
        rest = [s for s in self._attributed() if (s.rank, s.micro_batch, s.sample) not in seen]
        measured = sorted(self.measured, key=lambda s: -(s.share if s.share is not None and math.isfinite(s.share)
                                                         else -math.inf))
        return tuple(measured[:TOP_SAMPLES] + rest)[:TOP_SAMPLES]

    def _diffuse(self):  # noqa: ANN202 - Localization
        r = self.r
        samples = self.samples()
        return r.record(method=Method.ATTRIBUTION, status=Status.DIFFUSE, probes=r.used, passes=self.passes,
                        samples=samples, note=f"{'; '.join(self.notes)}; {describe(samples, self.n)}")


def _score_share(r: Runner, m: int, b: int) -> float:
    total = r.pic.total_score
    a, e = r.view.metas[m].bounds(b)
    base = r.view.offsets[m]
    return float(r.view.scores[base + a:base + e].sum()) / total if math.isfinite(total) and total > 0 else math.nan


__all__ = ["Below"]
