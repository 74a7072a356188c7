"""Per-sample surprise from the loss head's output gradient, reduced on the device (no extra pass).

For a cross-entropy head, the gradient at position p of the logits is g_p = w·(softmax_p − onehot_p)
(w: the position's loss weight, e.g. 1/N for a token mean). The token hooks keep u_p = −g_p[y_p] =
w·(1 − p(y_p)) of the last forward call of the last watched module (token_hooks._head_u): one
gather of B×T values. One weight per micro-batch (a token mean over the micro-batch or the step, as
the HF Trainer and plain loops compute it) is recovered as ŵ = max_p u_p over its loss positions:
max_p (1 − p(y_p)) is within 1e-4 of 1 in any micro-batch of a few hundred natural-text tokens, so
p̂(y_p) = 1 − u_p/ŵ and the surprise s_p = −log max(p̂, e^−cap) follow without knowing w.

The model's own expectation at p: the hooks also keep ‖g_p‖² = w²·(Σ_v p_v² − 2p(y_p) + 1) (one
reduction over the vocabulary), so Σ_v p_v² = ‖g_p‖²/ŵ² + 2p̂ − 1. Since E_{y~p}[p(y)] = Σ_v p_v²,
the calibration deficit d_p = Σ_v p_v² − p̂(y_p) is 0 on average wherever the model is calibrated,
however hard the text (a URL, a table, markup: the model knows it is unsure there, Σ_v p_v² is
small); labels that are not the text's own (shifted, garbage after natural context) make it large
wherever the model is sure.

A micro-batch is not judged (``MB_*`` codes) when it has no head gradient, gave RL fields (signed
per-sample weights), or its head gradient is not cross-entropy shaped: u_p < 0 somewhere (label
smoothing, logit soft-capping, a head that is not the last watched module). Positions with u_p = 0
carry no loss term (masked by the loss, or an id outside the head such as −100) and do not count.

The step's pack (float64, appended to the step's one host transfer)::

    [mb_code (M) | n (S) | Σ s (S) | nonfinite (S) | worst window mean (S) | its flat start (S) | Σ d (S) | Σ v (S)
     | gain at each offset k (2K × S) | its paired t (2K × S)]

where S counts the samples of every micro-batch in order (rows, or sequences of a packed row), n is
a sample's judged loss positions, and a window is ``window`` adjacent positions of one sample with
at least half of them judged (−inf / N when the sample has none); Σ d and Σ v are NaN where ‖g‖² was not
read. v_p = max((Σ_v p_v²)^1.5 − (Σ_v p_v²)², 1e-4) bounds the variance of p(y) for y ~ p at p (Σ_v p_v³ ≤
max_v p_v · Σ_v p_v² ≤ (Σ_v p_v²)^1.5), so Σ d / √Σ v is the deficit in units of its own spread under the
model: a sample of confident positions with wrong labels is far out, one of unsure positions is not, however
surprising (detector/samples.py). Every row is a function of u_p and ‖g_p‖², both already summed over a
token group's tp ranks before the pack (parallel/tokens.py): exact under TP/FSDP.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from gradloc.collector.batch import MicroBatchMeta
from gradloc.collector.head_read import offsets
from gradloc.collector.packs import Pack
from gradloc.collector.token_summary import StepScores

MB_JUDGED, MB_NO_HEAD, MB_RL, MB_NOT_CE, MB_EMPTY = 1, 0, -1, -2, -3
ROWS = 7  # per-sample rows of the pack before the per-offset rows (2·2K of them, collector/head_read.py)


def surprise_pack(M: int, S: int, align_rows: int) -> Pack:
    """The step's per-sample pack (collector/packs.py): a code per micro-batch, then per sample its judged positions,
    Σ surprise, non-finite positions, worst window's mean and start, Σ deficit, Σ variance bound; then
    ``align_rows`` rows of S (the per-offset gains and paired t, 2·2K of them; none when nothing was read)."""
    return Pack.of(code=M, n=S, total=S, nonfinite=S, wmax=S, wstart=S, deficit=S, var=S, align=align_rows * S)


def pack_layout(host_len: int, M: int, S: int) -> Pack:
    """The layout of a pack of ``host_len`` values for M micro-batches and S samples (its offset rows counted)."""
    return surprise_pack(M, S, (host_len - M - ROWS * S) // S if S else 0)
_MIN_VAR = 1e-4  # per position: a model sure of one token (Σp² → 1) still has ŵ's error


class SurprisePack:
    """Builds the device pack of one step; caches the (position → micro-batch, sample) maps per layout."""

    def __init__(self, window: int, token_cap: float) -> None:
        self.window, self.floor = window, math.exp(-token_cap)  # p̂ below the floor counts as the floor
        self._maps: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _layout(self, metas: Sequence[MicroBatchMeta], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (tuple((m.batch, m.seq, m.starts) for m in metas), str(device))
        hit = self._maps.get(key)
        if hit is None:
            mb, seg, first = [], [], 0
            for i, m in enumerate(metas):
                lengths = [b - a for a, b in (m.bounds(s) for s in range(m.n_samples))]
                mb.append(torch.full((m.n_tokens,), i, dtype=torch.long))
                seg.append(torch.repeat_interleave(torch.arange(first, first + m.n_samples), torch.tensor(lengths)))
                first += m.n_samples
            hit = (torch.cat(mb).to(device), torch.cat(seg).to(device))  # (N,), (N,)
            if len(self._maps) >= 8:
                self._maps.pop(next(iter(self._maps)))
            self._maps[key] = hit
        return hit

    def pack(self, scores: StepScores, rl: set[int]) -> torch.Tensor | None:
        """The step's pack (see the module docstring) from its scores' head rows (``StepScores.head_u``, summed over
        a token group) and loss positions; ``rl``: indices of micro-batches with RL fields. None when no
        micro-batch has a head gradient."""
        if scores.head_u is None or scores.head_has is None or not scores.head_given:
            return None
        dev = scores.eligible.device
        metas, eligible = scores.metas, scores.eligible
        given = scores.head_has.to(dev) > 0  # (M,)
        M, S, N = len(metas), sum(m.n_samples for m in metas), eligible.numel()
        mb_id, seg = self._layout(metas, dev)
        u = scores.head_u.to(dev)  # (N,)
        has = given & torch.tensor([m.index not in rl for m in metas], device=dev)  # (M,)
        elig = eligible & has[mb_id]
        finite = torch.isfinite(u)
        valid = elig & finite & (u != 0)
        w_hat = torch.zeros(M, device=dev).scatter_reduce(0, mb_id, torch.where(valid, u, 0.0), "amax")
        negative = torch.zeros(M, device=dev).index_add_(0, mb_id, (valid & (u < -1e-6 * w_hat[mb_id])).float())
        ok_mb = has & (w_hat > 0) & (negative == 0)  # (M,)
        valid = valid & ok_mb[mb_id]
        p = 1.0 - u / torch.where(w_hat > 0, w_hat, 1.0)[mb_id]
        s = torch.where(valid, -torch.log(p.clamp_min(self.floor)), 0.0).double()
        n = torch.zeros(S, dtype=torch.float64, device=dev).index_add_(0, seg, valid.double())
        total = torch.zeros(S, dtype=torch.float64, device=dev).index_add_(0, seg, s)
        nonfinite = torch.zeros(S, dtype=torch.float64, device=dev).index_add_(0, seg, (elig & ~finite).double())
        g2 = scores.head_g2.to(dev) if scores.head_g2 is not None else torch.full_like(u, float("nan"))  # (N,)
        w2 = torch.where(w_hat > 0, w_hat, 1.0)[mb_id] ** 2
        collision = (g2 / w2 + 2.0 * p - 1.0).clamp(0.0, 1.0)  # Σ_v p_v²; NaN stays NaN
        d = torch.where(valid, collision - p.clamp(0.0, 1.0), 0.0).double()  # E_{y~p}[p(y)] − p(y_p): 0 on average
        deficit = torch.zeros(S, dtype=torch.float64, device=dev).index_add_(0, seg, d)
        spread = torch.where(valid, (collision.pow(1.5) - collision.square()).clamp_min(_MIN_VAR), 0.0).double()
        var = torch.zeros(S, dtype=torch.float64, device=dev).index_add_(0, seg, spread)  # ≥ Σ_p Var_{y~p}[p(y)]
        wmax, wstart = self._windows(s, valid, seg, S, N)
        code = torch.where(ok_mb, float(MB_JUDGED), torch.where(~has, float(MB_NO_HEAD),
                           torch.where(negative > 0, float(MB_NOT_CE), float(MB_EMPTY)))).double()
        rl_mb = torch.tensor([m.index in rl for m in metas], device=dev)
        code = torch.where(rl_mb, float(MB_RL), code)
        align = self._alignment(scores, p, s, valid, mb_id, seg, w_hat, S)
        return surprise_pack(M, S, len(align)).build(
            code=code, n=n, total=total, nonfinite=nonfinite, wmax=wmax, wstart=wstart, deficit=deficit, var=var,
            align=torch.cat(align) if align else torch.zeros(0, dtype=torch.float64, device=dev))  # (M + (7 + 4K)·S,)

    def _alignment(self, scores: StepScores, p: torch.Tensor, s: torch.Tensor, valid: torch.Tensor,
                   mb_id: torch.Tensor, seg: torch.Tensor, w_hat: torch.Tensor, S: int) -> list[torch.Tensor]:
        """Per offset k of ``head_read.offsets`` and sample (2·2K rows of S, none when nothing was read): the mean gain
        of d_p = s_p − s_p(k), nats per position by which the model at p + k predicts p's label better than at p, then
        the paired t of each mean (mean·√n / sd of d_p over the n positions where p and p + k are both judged in the
        sample; −inf where n < 2)."""
        if scores.head_shift is None or not scores.head_shift.numel():
            return []
        dev, N = s.device, s.numel()
        lab = torch.cat([m.token_ids.reshape(-1).to(dev) if m.token_ids is not None  # (B, T) -> (B·T,)
                         else torch.full((m.n_tokens,), -1, device=dev, dtype=torch.long) for m in scores.metas])
        shift = scores.head_shift.to(dev)  # (2K, N)
        w = torch.where(w_hat > 0, w_hat, 1.0)[mb_id]  # (N,)
        gains, ts = [], []
        flat = torch.arange(N, device=dev)  # (N,): one allocation for every offset
        for i, k in enumerate(offsets(shift.shape[0] // 2)):
            at = flat + k
            inside = (at >= 0) & (at < N)
            at = at.clamp(0, N - 1)
            ok = valid & inside & valid[at] & (seg[at] == seg)  # p and p + k judged, in one sample
            pk = shift[i] / w + (lab[at] == lab).float()  # p_{p+k}(y_p)
            d = torch.where(ok, s - (-torch.log(pk.clamp(self.floor, 1.0))).double(), 0.0)
            nk = torch.zeros(S, dtype=torch.float64, device=dev).index_add_(0, seg, ok.double())
            total = torch.zeros(S, dtype=torch.float64, device=dev).index_add_(0, seg, d)
            total2 = torch.zeros(S, dtype=torch.float64, device=dev).index_add_(0, seg, d * d)
            mean = total / nk.clamp_min(1.0)
            spread = (total2 / nk.clamp_min(1.0) - mean * mean).clamp_min(1e-6).sqrt()
            gains.append(mean)
            ts.append(torch.where(nk >= 2, mean * nk.sqrt() / spread, float("-inf")))
        return gains + ts

    def _windows(self, s: torch.Tensor, valid: torch.Tensor, seg: torch.Tensor, S: int,
                 N: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample: the largest mean surprise over ``window`` adjacent positions of that sample with
        at least half of them judged, and that window's flat start (−inf and N where there is none)."""
        W, dev = self.window, s.device
        wmax = torch.full((S,), float("-inf"), dtype=torch.float64, device=dev)
        wstart = torch.full((S,), float(N), dtype=torch.float64, device=dev)
        if N < W:
            return wmax, wstart
        zero = torch.zeros(1, dtype=torch.float64, device=dev)
        cs = torch.cat([zero, s.cumsum(0)])  # (N + 1,)
        cn = torch.cat([zero, valid.double().cumsum(0)])
        wsum, wn = cs[W:] - cs[:-W], cn[W:] - cn[:-W]  # (N − W + 1,): window [p, p + W)
        first = seg[: N - W + 1]
        ok = (first == seg[W - 1:]) & (wn >= W / 2)
        mean = torch.where(ok, wsum / wn.clamp_min(1.0), float("-inf"))
        wmax = wmax.scatter_reduce(0, first, mean, "amax")
        at = torch.arange(N - W + 1, device=dev, dtype=torch.float64)
        is_max = ok & (mean == wmax[first])
        wstart = wstart.scatter_reduce(0, first, torch.where(is_max, at, float(N)), "amin")
        return wmax, wstart
