"""Culprit tokens -> records with decoded text, spans of adjacent tokens and their context."""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np

from gradloc.localizer.token_view import TokenView
from gradloc.records import MAX_SPAN_WINDOW, Culprit, CulpritSpan, LayerShare

Decode = Callable[[list[int]], str]
log = logging.getLogger("gradloc")
_TOP_LAYERS = 5
# tokens each side of a span in CulpritSpan.window_* (the incident page's text; context_tokens still cuts the
# context_before/after strings the terminal prints): about two paragraphs, 2 decode calls per token
WINDOW_TOKENS = 200


def safe_decode(decode: Decode | None, ids: Sequence[int]) -> str | None:
    if decode is None or not ids:
        return None if decode is None else ""
    try:
        return str(decode(list(ids)))
    except Exception:  # a tokenizer error must not lose the incident
        log.debug("gradloc: decode failed", exc_info=True)
        return None


def _layer_shares(view: TokenView, flat: int) -> tuple[LayerShare, ...]:
    if view.per_layer is None:
        return ()
    col = view.per_layer[:, flat]  # (L,)
    total = float(col.sum())
    if not np.isfinite(total) or total <= 0:
        return ()
    order = np.argsort(-col)[:_TOP_LAYERS]
    return tuple(LayerShare(view.layers[i], float(col[i]) / total) for i in order if col[i] > 0)


def build_culprits(view: TokenView, flats: Sequence[int], shares: Sequence[float],
                   decode: Decode | None) -> tuple[Culprit, ...]:
    total = float(view.scores.sum())
    out = []
    for flat, share in zip(flats, shares):
        m, b, t = view.locate(int(flat))
        meta = view.metas[m]
        tok = int(meta.token_ids.reshape(-1)[meta.flat(b, t)]) if meta.token_ids is not None else None  # (B, T) -> (B·T,)
        score_share = float(view.scores[flat]) / total if np.isfinite(total) and total > 0 else float("nan")
        out.append(Culprit(
            micro_batch=meta.index, sample=b, position=t, share=float(share), score_share=score_share,
            token_id=tok, text=safe_decode(decode, [tok]) if tok is not None else None,
            sample_id=meta.sample_id(b), layers=_layer_shares(view, int(flat)), rl=view.token_rl(int(flat)),
            sample_info=meta.sample_info(b),
        ))
    return tuple(sorted(out, key=lambda c: -c.share if np.isfinite(c.share) else 0.0))


def build_spans(view: TokenView, culprits: Sequence[Culprit], decode: Decode | None,
                context: int) -> tuple[CulpritSpan, ...]:
    by_sample: dict[tuple[int, int], list[Culprit]] = {}
    for c in culprits:
        by_sample.setdefault((c.micro_batch, c.sample), []).append(c)
    where = {m.index: i for i, m in enumerate(view.metas)}  # micro-batch index -> its position in the view
    spans = []
    for (mb, b), cs in by_sample.items():
        cs.sort(key=lambda c: c.position)
        run = [cs[0]]
        for c in cs[1:] + [None]:
            if c is not None and c.position == run[-1].position + 1:
                run.append(c)
                continue
            spans.append(range_span(view, where[mb], b, run[0].position, run[-1].position + 1,
                                    sum(c.share for c in run), decode, context))
            run = [c] if c is not None else []
    return tuple(sorted(spans, key=lambda s: -s.share))


def range_span(view: TokenView, m: int, b: int, start: int, end: int, share: float, decode: Decode | None,
               context: int) -> CulpritSpan:
    """The span [start, end) of sample b of view position m, with its text, context and window."""
    meta = view.metas[m]
    ids = meta.sample_tokens(b)  # this sample's tokens only: context never crosses into a packed neighbour
    window = max(context, WINDOW_TOKENS)
    lo, hi = max(0, start - window), min(len(ids), end + window)
    if hi - lo > MAX_SPAN_WINDOW:  # a huge context_tokens: the window keeps the span and what fits around it
        lo = max(lo, min(start, hi - MAX_SPAN_WINDOW))
        hi = min(hi, lo + MAX_SPAN_WINDOW)
    return CulpritSpan(
        micro_batch=meta.index, sample=b, start=start, end=end, share=share,
        token_ids=tuple(ids[start:end]), text=safe_decode(decode, ids[start:end]) if ids else None,
        context_before=safe_decode(decode, ids[max(0, start - context):start]) if ids else None,
        context_after=safe_decode(decode, ids[end:end + context]) if ids else None,
        sample_id=meta.sample_id(b), sample_info=meta.sample_info(b),
        **_window(view, m, b, ids, lo, hi, decode),
    )


def _token_texts(decode: Decode, ids: list[int], lo: int, hi: int) -> tuple[str, ...]:
    """Tokens lo..hi-1 as each reads after its predecessor (SentencePiece and byte-level BPE drop or
    split a token's leading space when it is decoded alone): decode(prev, t) minus decode(prev).
    Two decode calls per token."""
    alone = [safe_decode(decode, ids[i:i + 1]) for i in range(max(0, lo - 1), hi)]  # (hi - lo [+ 1],)
    out = []
    for i in range(lo, hi):
        mine, prev = alone[i - max(0, lo - 1)], alone[i - 1 - max(0, lo - 1)] if i > 0 else None
        both = safe_decode(decode, ids[i - 1:i + 1]) if prev is not None else None
        out.append(both[len(prev):] if both is not None and prev is not None and both.startswith(prev) else mine or "")
    return tuple(out)


def _window(view: TokenView, m: int, b: int, ids: list[int], lo: int, hi: int,
            decode: Decode | None) -> dict[str, object]:
    """Positions [lo, hi) of sample b of view position m: each token's text and score share."""
    if decode is None or not ids or hi <= lo:
        return {}
    first = view.offsets[m] + view.metas[m].bounds(b)[0]  # flat index of the sample's position 0
    total = float(view.scores.sum())
    scores = view.scores[first + lo:first + hi]  # (hi - lo,)
    shares = scores / total if np.isfinite(total) and total > 0 else np.full(hi - lo, np.nan)
    texts = _token_texts(decode, ids, lo, hi)
    return {"window_start": lo, "window_tokens": texts, "window_scores": tuple(float(x) for x in shares)}
