"""What can be said of a spike no small token set explains: where the norm sits, by sample.

A *diffuse* spike (every token's loss weight scaled up, a learning-rate blow-up, a bad batch
rather than bad tokens) has no culprit tokens to name. Bisecting it costs dozens of probes and
ends with noise, so gradloc spends what is left of the ≤ ``max_probes`` budget on the samples that
carry the most attribution score — each probe measures one sample's exact share ⟨∇_S, ∇⟩/‖∇‖² —
and reports the sample-level picture: which samples carry the norm (measured where probed,
attributed otherwise), or that it is spread evenly. No token is listed as a culprit.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from gradloc.localizer.token_view import TokenView
from gradloc.records import SampleShare

TOP_SAMPLES = 5


def sample_shares(view: TokenView, measure: Callable[[int, np.ndarray], float] | None,
                  probes_left: int) -> tuple[SampleShare, ...]:
    """The top samples by attribution score; the first ``probes_left`` of them measured by ``measure``
    (micro-batch position, flat indices → ⟨∇_S, ∇⟩/‖∇‖²)."""
    total = float(view.scores.sum())
    out = []
    for m, b, score, n_loss in view.sample_totals()[:TOP_SAMPLES]:
        meta = view.metas[m]
        measured = None
        if measure is not None and probes_left > 0 and n_loss > 0:
            measured = measure(m, view.sample_flats(m, b))
            probes_left -= 1
        share = score / total if math.isfinite(total) and total > 0 else math.nan
        out.append(SampleShare(meta.index, b, share, measured,
                               meta.sample_id(b), n_loss))
    return tuple(out)


def describe(samples: tuple[SampleShare, ...], n_samples: int) -> str:
    """One sentence on where the norm sits, e.g. for an incident's note."""
    if not samples:
        return "no per-sample picture (no attribution scores)"
    top = samples[0]
    measured = [s for s in samples if s.share is not None]
    parts = [_fmt(s) for s in samples[:3]]
    biggest = max([s.score_share for s in samples if math.isfinite(s.score_share)] +
                  [s.share for s in measured if s.share is not None and math.isfinite(s.share)], default=math.nan)
    if n_samples > 1 and math.isfinite(biggest) and biggest <= 2.0 / n_samples + 0.05:
        return (f"spread evenly over {n_samples} samples: none carries more than {biggest:.0%} of ‖∇‖² "
                f"({'; '.join(parts)})")
    lead = "carries" if top.share is not None and top.share >= 0.5 else "leads with"
    return f"sample {top.sample} of micro-batch {top.micro_batch} {lead} the norm ({'; '.join(parts)})"


def _fmt(s: SampleShare) -> str:
    where = f"mb {s.micro_batch}/sample {s.sample}" + (f" ({s.sample_id})" if s.sample_id else "")
    measured = f"{s.share:.0%} measured, " if s.share is not None and math.isfinite(s.share) else ""
    return f"{where}: {measured}{s.score_share:.0%} attributed"
