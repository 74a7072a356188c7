"""When no small token set explains a spike: find the sample, span or micro-batch that does.

What is left of the ≤ ``max_probes`` budget goes, micro-batch by micro-batch (the one holding the
top-scoring sample first), to the decomposition probe (``decompose.py``): one probe and two
forward-only passes measure every sample's and every token's exact share of ‖∇‖² in that
micro-batch. ``levels.py`` turns the shares into a verdict: a culprit sample (its span(s) when they
carry it), else the micro-batch, else the next micro-batch. A probe left after a verdict re-measures
the culprit samples exactly (∇_S itself: ‖∇ − ∇_S‖, ℓ_S, and the gradient the opt-in remedy drops).

Without the head module (no single exact layer) or when the decomposition fails, each remaining probe
measures one top sample instead (``diffuse.sample_shares``), and a verified sample is still named.
Nothing passes: ``diffuse``, with every measured share reported.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from gradloc.localizer.decompose import Decomposition, decompose
from gradloc.localizer.diffuse import TOP_SAMPLES, describe, sample_shares
from gradloc.localizer.levels import Region, SampleVerdict, pick_samples, regions_of, sample_measures, top_tokens
from gradloc.localizer.probes import ProbeSession
from gradloc.localizer.spans import build_culprits, range_span
from gradloc.localizer.token_view import TokenView
from gradloc.records import Level, Localization, Method, SampleShare, Status

if TYPE_CHECKING:
    from gradloc.localizer.localizer import LocalizeResult, Localizer, SpikeContext, StoredGradient

MAX_CLOSURE_ERROR = 0.25  # a decomposition whose Σ c_t misses the probe's ⟨∇_mb, ∇⟩ by more is not trusted


class Below:
    def __init__(self, loc: "Localizer", step: int, view: TokenView, stored: "StoredGradient",
                 session: ProbeSession, ctx: "SpikeContext", head: nn.Module | None) -> None:
        self.loc, self.step, self.view, self.stored, self.session, self.ctx, self.head = \
            loc, step, view, stored, session, ctx, head
        self.passes = 0
        self.measured: list[SampleShare] = []

    def run(self, why: str, keep_grad: bool) -> "LocalizeResult":
        from gradloc.localizer.localizer import LocalizeResult

        notes = [why]
        if self.head is not None:
            for m in self._micro_batch_order():
                if self.session.count >= self.loc.cfg.max_probes:
                    break
                try:
                    dec = self._decompose(m)
                except Exception as exc:  # noqa: BLE001 - an unusual model: fall back to sample probes
                    notes.append(f"decomposition unavailable ({type(exc).__name__}: {exc})")
                    break
                if dec.closure_error > MAX_CLOSURE_ERROR:
                    notes.append(f"decomposition of micro-batch {self.view.metas[m].index} off by "
                                 f"{dec.closure_error:.0%} (not trusted)")
                    continue
                found = self._verdict(m, dec, keep_grad, notes)
                if found is not None:
                    return found
            else:
                notes.append("no sample or micro-batch measured carries it")
        if not self.measured:  # no decomposition ran: one probe per top sample
            return self._by_sample_probes(notes, keep_grad)
        return LocalizeResult(self._diffuse(notes))

    # -- decomposition ------------------------------------------------------------------------
    def _micro_batch_order(self) -> list[int]:
        order: list[int] = []
        for m, _, _, _ in self.view.sample_totals():
            if m not in order:
                order.append(m)
        return order

    def _decompose(self, m: int) -> Decomposition:
        view, st = self.view, self.stored
        a, b = view.offsets[m], view.offsets[m + 1]
        mask = torch.from_numpy(view.mask_for(m, np.flatnonzero(view.eligible[a:b]) + a))
        dec = decompose(self.session, view.metas[m].index, mask, st.grads, st.inv_scale, st.norm ** 2, self.head)
        self.passes += 2
        return dec

    def _verdict(self, m: int, dec: Decomposition, keep_grad: bool, notes: list[str]) -> "LocalizeResult | None":
        from gradloc.localizer.localizer import LocalizeResult, _loss_fields

        view, loc = self.view, self.loc
        measures = sample_measures(view, m, dec.c)
        meta = view.metas[m]
        self.measured += [SampleShare(micro_batch=meta.index, sample=b, score_share=_score_share(view, m, b),
                                      share=share, sample_id=meta.sample_id(b), tokens=n)
                          for b, share, n in measures[:TOP_SAMPLES]]
        verdict = pick_samples(measures, lambda s: loc._verified(s, self.stored.norm, 0.0, self.ctx), self._n())
        if verdict.culprits:
            return self._sample_level(m, dec, verdict, keep_grad, notes)
        if loc._verified(dec.explained, self.stored.norm, dec.loss, self.ctx):
            from gradloc.localizer.localizer import _explained

            _, c_norm, without = _explained(self.stored, dec.grad)
            note = "; ".join(notes + [f"micro-batch {meta.index} carries it; no sample of it alone does"])
            loss_share, loss_without = _loss_fields(self.ctx, dec.loss)
            out = self._record(Level.MICRO_BATCH, dec.explained, (), (), note, c_norm, without, loss_share,
                               loss_without)
            return LocalizeResult(out, dec.grad if keep_grad else None)
        notes.append(f"micro-batch {meta.index} measured: {dec.explained:.0%} of ‖∇‖², no sample of it passes")
        return None

    def _sample_level(self, m: int, dec: Decomposition, verdict: SampleVerdict, keep_grad: bool,
                      notes: list[str]) -> "LocalizeResult":
        from gradloc.localizer.localizer import LocalizeResult, _explained, _loss_fields, _probe_into

        view, cfg = self.view, self.loc.cfg
        share_of = {b: s for b, s, _ in verdict.samples}
        levels, regions = [], []
        for b in verdict.culprits:
            level, rs = regions_of(view, m, b, dec.c, share_of[b])
            levels.append(level)
            regions += rs
        level = levels[0] if len(set(levels)) == 1 else Level.SPAN
        del dec.grad[:]  # the micro-batch's gradient is not needed any more
        explained, c_norm, without, loss_share, loss_without, grad = verdict.explained, None, None, None, None, None
        if self.session.count < cfg.max_probes:  # measure the culprit samples themselves
            flats = np.concatenate([view.sample_flats(m, b) for b in verdict.culprits])
            g = _probe_into(self.session, view, [None] * len(self.stored.grads), m, flats)
            exact, c_norm, without = _explained(self.stored, g)
            loss_share, loss_without = _loss_fields(self.ctx, self.session.losses[-1])
            notes.append(f"the decomposition gave {explained:.0%}, a probe of the sample(s) {exact:.0%}")
            explained = exact
            grad = g if keep_grad else None
        what = ", ".join(f"sample {b}" for b in verdict.culprits)
        notes.append(f"{what} of micro-batch {view.metas[m].index} carr{'ies' if len(verdict.culprits) == 1 else 'y'} "
                     f"{explained:.0%} of ‖∇‖² ({level.value} level)")
        flats = top_tokens(view, regions, dec.c)
        culprits = build_culprits(view, flats, [float(dec.c[f - view.offsets[m]]) for f in flats], self.loc.decode)
        spans = tuple(range_span(view, r.m, r.sample, r.start, r.end, r.share, self.loc.decode, cfg.context_tokens)
                      for r in regions)
        out = self._record(level, explained, culprits, spans, "; ".join(notes), c_norm, without, loss_share,
                           loss_without)
        return LocalizeResult(out, grad)

    # -- without a decomposition --------------------------------------------------------------
    def _by_sample_probes(self, notes: list[str], keep_grad: bool) -> "LocalizeResult":
        from gradloc.localizer.localizer import LocalizeResult, _explained, _probe_into

        view, loc = self.view, self.loc
        samples = sample_shares(view, lambda m, f: _explained(self.stored, _probe_into(
            self.session, view, [None] * len(self.stored.grads), m, f))[0], loc.cfg.max_probes - self.session.count)
        self.measured = [s for s in samples if s.share is not None]
        ranked = sorted(self.measured, key=lambda s: -s.share)
        verdict = pick_samples([(i, s.share, s.tokens) for i, s in enumerate(ranked)],
                               lambda x: loc._verified(x, self.stored.norm, 0.0, self.ctx), self._n())
        if not verdict.culprits:
            self.measured = list(samples)
            return LocalizeResult(self._diffuse(notes))
        regions = []
        for i in verdict.culprits:
            s = ranked[i]
            m = next(j for j, meta in enumerate(view.metas) if meta.index == s.micro_batch)
            pos = view.sample_flats(m, s.sample) - view.offsets[m] - view.metas[m].bounds(s.sample)[0]
            regions.append(Region(m=m, sample=s.sample, start=int(pos[0]), end=int(pos[-1]) + 1, share=s.share))
        spans = tuple(range_span(view, r.m, r.sample, r.start, r.end, r.share, loc.decode, loc.cfg.context_tokens)
                      for r in regions)
        notes.append(f"{len(regions)} sample(s) measured by probes carry {verdict.explained:.0%} of ‖∇‖² "
                     "(sample level; no decomposition, so no span inside them)")
        self.measured = list(samples)
        return LocalizeResult(self._record(Level.SAMPLE, verdict.explained, (), spans, "; ".join(notes)))

    # -- records ------------------------------------------------------------------------------
    def _n(self) -> int:
        return sum(m.n_samples for m in self.view.metas)

    def _samples(self) -> tuple[SampleShare, ...]:
        seen = {(s.micro_batch, s.sample) for s in self.measured}
        rest = [s for s in sample_shares(self.view, None, 0) if (s.micro_batch, s.sample) not in seen]
        measured = sorted(self.measured, key=lambda s: -(s.share if s.share is not None and math.isfinite(s.share)
                                                         else -math.inf))
        return tuple(measured[:TOP_SAMPLES] + rest)[:TOP_SAMPLES]

    def _diffuse(self, notes: list[str]) -> Localization:
        samples = self._samples()
        return self.loc._empty(self.step, Method.ATTRIBUTION, Status.DIFFUSE, self.session.count, self.stored,
                               self.view, f"{'; '.join(notes)}; {describe(samples, self._n())}", samples, self.passes)

    def _record(self, level: Level, explained: float, culprits: tuple, spans: tuple, note: str,
                c_norm: float | None = None, without: float | None = None, loss_share: float | None = None,
                loss_without: float | None = None) -> Localization:
        view = self.view
        return Localization(step=self.step, method=Method.ATTRIBUTION, status=Status.LOCATED, level=level,
                            probes=self.session.count, passes=self.passes, explained_share=explained,
                            global_norm=self.stored.norm, culprit_norm=c_norm, norm_without_culprits=without,
                            culprits=culprits, spans=spans, micro_batch_shares=view.micro_batch_shares(),
                            unattributed_share=view.unattributed_share, loss_share=loss_share,
                            loss_without_culprits=loss_without, note=note, samples=self._samples())


def _score_share(view: TokenView, m: int, b: int) -> float:
    total = float(view.scores.sum())
    a, e = view.metas[m].bounds(b)
    base = view.offsets[m]
    return float(view.scores[base + a:base + e].sum()) / total if math.isfinite(total) and total > 0 else math.nan
