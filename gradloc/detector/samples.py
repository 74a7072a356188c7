"""Per-sample findings on the host: each sample's surprise against the run's own history, and a
sustained RL training–inference mismatch against the run's own baseline. Findings, not incidents:
no probe runs and nothing pages (docs/DESIGN-NOTES.md, "Per-sample surprise").

Surprise: the step's pack (collector/surprise.py) gives every sample's judged loss positions n, mean
surprise, worst-window mean, mean calibration deficit d = Σ_v p_v² − p(y) (read off the head's
‖g‖²: 0 on average wherever the model is calibrated, however hard the text) and Σ v, a bound on the
deficit's variance under the model. Each is judged against the last ``history`` judged samples
(robust: median and 1.4826 × MAD, σ floored at 2% of the median) once ``warmup_samples`` are in:
z = (x − median) / (σ · √max(1, n_median / n)) for the means (a short sample's mean is noisier) and
z_window = (window − median_window) / σ_window.

Real text holds odd but legitimate samples (URLs, tables, groff or HTML markup, regexes) that are as
surprising as a bad one: the model was unsure there and knew it (Σ_v p_v² small, d ≈ 0). Garbage and
wrong labels are surprising where it was sure (d large) or far more surprising than any text. So
with ``SampleConfig.calibrated`` and a deficit in the pack, a sample's z is
max(z_deficit, max(z, z_window) / 1.5, z where the mean deficit's z ≥ z_threshold),
z_deficit = 0.2 × the mean deficit's z + 0.7 × the z of
Σ d / √Σ v (the deficit in units of its own spread: a deficit means little where the model spreads its
bets), counting only where z > 0 (a wrong label never makes a sample less surprising than usual):
surprise alone must be 1.5 × z_threshold out, surprise at z_threshold needs the mean deficit's own z
there too (1.0 × z_threshold), and a worst window (a URL, a line of ``=``) counts only
when its sample's deficit is half-way (z_deficit ≥ z_threshold / 2); the weights were measured on
bench/samples_text.py (docs/DESIGN-NOTES.md, "Per-sample surprise"). Without one (``calibrated=False``,
a pack without ‖g‖²) it is max(z, z_window), as before. Either way a sample whose labels a neighbouring position
predicts far better than their own (misaligned labels: ``_misaligned``, SHIFT_*; at offset −1, labels that are the
inputs, asked alone with its own bars: INPUTS_*) gets that z when it is larger,
judged against the sample itself, not the history. Every judged sample enters the history, an
outlier clamped to median + z_threshold · σ, so a minority of bad samples barely moves the baseline while
a lasting change of the data becomes the new normal. Outliers come worst (highest z) first.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from gradloc.collector.batch import MicroBatchMeta
from gradloc.collector.head_read import offsets
from gradloc.collector.surprise import MB_JUDGED, MB_NOT_CE, pack_layout
from gradloc.config import SampleConfig
from gradloc.records import SAMPLE_Z_BUCKETS, OutlierKind, RLStats, SampleOutlier, SampleStats

log = logging.getLogger("gradloc")
_MIN_STD_FRACTION = 0.02
SURPRISE_ALONE = 1.5  # with a calibration deficit: surprise alone makes a finding at this × z_threshold
# the wrong-label z: this mix of the mean deficit's z and the self-normalised deficit's z (Σ d / √Σ v), measured on
# bench/samples_text.py (seed 0 to choose, seed 1 held out: docs/BENCHMARKS.md §4.1)
W_DEFICIT, W_SELF = 0.2, 0.7
SUPPORT = 1.0  # surprise at z_threshold is a finding when the mean deficit's own z is at this × z_threshold
# misaligned labels (collector/head_read.py): a neighbour predicts the sample's labels SHIFT_GAIN nats per position
# better than their own positions, with a paired t of SHIFT_T making z_threshold (bench/samples_text.py: on 22,008
# healthy samples of four kinds of text no offset but +1 reached a gain of 0.46 or a t of 3.4). Offset +1 is not
# judged: its position's input *is* the label, and a model's prior to repeat its current token (runs of spaces,
# doubled letters) makes it a better predictor than the label's own position on healthy text (gain up to 1.76, t 10.3)
# A sample needs SHIFT_MIN_TOKENS judged positions: a paired t over a few positions, maximised over 15 offsets,
# reaches 4 by chance (a 16-position sample of an untrained model on random ids: t 4.2 at offset −5).
SHIFT_GAIN, SHIFT_T, COPY_OFFSET, SHIFT_MIN_TOKENS = 0.3, 4.0, 1, 48
# labels that are the inputs (the off-by-one of a pipeline that forgot to shift them) are asked about at offset −1
# alone, an offset named in advance: no maximum over 15 offsets inflates its t, and on healthy text its gain is far
# below 0 — the model at p − 1 must predict the label two positions ahead (22,008 healthy samples of
# bench/samples_text.py: median −1.25 nats, max 0.22 at a t of 1.2). A gain of INPUTS_GAIN with a paired t of
# INPUTS_T makes z_threshold there.
INPUTS_OFFSET, INPUTS_GAIN, INPUTS_T = -1, 0.2, 2.0
# ... once the model predicts one position ahead: the run's median gain at −1 (its judged samples) at or below
# INPUTS_ARMED. An untrained model is a copy/unigram model, whose gain at −1 is positive on every sample (text bench,
# seed 0: median +0.45 at step 5, −0.05 at step 30, −0.63 at step 60, −1.2 from step 300)
INPUTS_ARMED = -0.5
# σ floor of the mean deficit (a probability): a model sure of everything (a memorised cycle) has MAD ≈ 0,
# and ŵ's error (collector/surprise.py) alone would then be "far out". Real text: 1.4826·MAD ≈ 0.016.
_DEFICIT_MIN_STD = 0.01


class _Ring:
    """The last ``size`` values of a statistic."""

    def __init__(self, size: int) -> None:
        self.values = np.empty(size)
        self.n = self.at = 0

    def add(self, x: np.ndarray) -> None:
        size = len(self.values)
        x = np.asarray(x, dtype=np.float64)[-size:]
        idx = (self.at + np.arange(len(x))) % size
        self.values[idx] = x
        self.at = (self.at + len(x)) % size
        self.n = min(self.n + len(x), size)

    def robust(self, floor: float = 1e-6) -> tuple[float, float]:
        """(median, σ from the MAD, floored at a fraction of the median and at ``floor``)."""
        v = self.values[: self.n]
        med = float(np.median(v))
        return med, max(1.4826 * float(np.median(np.abs(v - med))), _MIN_STD_FRACTION * abs(med), floor)


class SampleJudge:
    def __init__(self, cfg: SampleConfig) -> None:
        self.cfg = cfg
        self.mean, self.win, self.length = _Ring(cfg.history), _Ring(cfg.history), _Ring(cfg.history)
        self.deficit = _Ring(cfg.history)  # mean Σ_v p_v² − p(y), where the pack has it
        self.self_z = _Ring(cfg.history)  # Σ d / √Σ v: the deficit in units of its spread under the model
        self.gain_in = _Ring(cfg.history)  # the gain at offset −1 (INPUTS_OFFSET) of judged samples
        self.not_ce_warned = False

    def judge(self, host: np.ndarray, metas: Sequence[MicroBatchMeta], where: dict[str, Any],
              decode: Callable[[list[int]], str] | None) -> SampleStats:
        """``host``: the step's pack; ``where``: job, rank, step, time_unix of the step."""
        cfg, M = self.cfg, len(metas)
        S = sum(m.n_samples for m in metas)
        lay = pack_layout(len(host), M, S)
        code = lay.get(host, "code")
        n, total, nonfinite, wmax, wstart, deficit, var = (lay.get(host, f) for f in (
            "n", "total", "nonfinite", "wmax", "wstart", "deficit", "var"))
        align = lay.get(host, "align").reshape(-1, S)  # (4K·S,) -> (4K, S)
        shift_k, shift_gain, shift_t = _misaligned(align)
        in_gain, in_t = _at_offset(align, INPUTS_OFFSET)
        if (code == MB_NOT_CE).any() and not self.not_ce_warned:
            self.not_ce_warned = True
            log.warning("gradloc: the last watched module's gradient is not a cross-entropy head's "
                        "(w·(softmax − onehot), w > 0): its samples are not judged for surprise")
        mb_of = np.repeat(np.arange(M), [m.n_samples for m in metas])  # (S,)
        judged = (code[mb_of] == MB_JUDGED) & (n >= cfg.min_tokens) & (nonfinite == 0)
        score = np.where(judged, total / np.maximum(n, 1), 0.0)
        has_win = judged & np.isfinite(wmax)
        has_d = judged & np.isfinite(deficit) & cfg.calibrated
        dmean = np.where(has_d, deficit, 0.0) / np.maximum(n, 1)
        dself = np.where(has_d, deficit, 0.0) / np.sqrt(np.where(has_d & (var > 0), var, 1.0))
        stats = dict(judged=int(judged.sum()), unjudged=int((~judged & (nonfinite == 0)).sum()),
                     nonfinite=int((nonfinite > 0).sum()))
        if self.mean.n < cfg.warmup_samples or not judged.any():
            self._remember(score[judged], wmax[has_win], n[judged], dmean[has_d], dself[has_d])
            return SampleStats(**stats)
        t = cfg.z_threshold
        med, sd = self.mean.robust()
        wmed, wsd = self.win.robust() if self.win.n >= cfg.warmup_samples else (math.nan, math.nan)
        dmed, dsd = self.deficit.robust(_DEFICIT_MIN_STD) if self.deficit.n >= cfg.warmup_samples else (math.nan, math.nan)
        smed, ssd = self.self_z.robust() if self.self_z.n >= cfg.warmup_samples else (math.nan, math.nan)
        n_med = float(np.median(self.length.values[: self.length.n]))
        noise = np.sqrt(np.maximum(1.0, n_med / np.maximum(n, 1)))  # a short sample's mean is noisier
        z_mean = (score - med) / (sd * noise)
        z_win = np.where(has_win & np.isfinite(wsd), (wmax - wmed) / wsd, -np.inf)
        use_d = has_d & math.isfinite(dsd) & math.isfinite(ssd)
        # a wrong label never makes a sample less surprising than usual: the deficit counts above the median only
        # (it also keeps ŵ's error off a sample the model is sure of, e.g. a memorised sequence)
        z_dmean = np.where(use_d & (z_mean > 0), (dmean - dmed) / (dsd * noise), -np.inf)
        z_d = np.where(use_d & (z_mean > 0), W_DEFICIT * z_dmean + W_SELF * (dself - smed) / ssd, -np.inf)
        z_win = np.where(use_d & (z_d < t / 2), -np.inf, z_win)  # a window needs its sample's deficit half-way
        z_surprise = np.maximum(z_mean, z_win)
        z_both = np.where(z_dmean >= SUPPORT * t, z_mean, -np.inf)  # surprising, and wrong where the model was sure
        z_cal = np.maximum(np.maximum(z_d, z_surprise / SURPRISE_ALONE), z_both)
        z = np.where(judged, np.where(use_d, z_cal, z_surprise), np.nan)
        # labels the model predicts far better a few positions away than where they stand: shifted (head_read.py)
        long_enough = judged & (n >= SHIFT_MIN_TOKENS)
        z_shift = np.where(long_enough & (shift_gain >= SHIFT_GAIN) & np.isfinite(shift_t), t * shift_t / SHIFT_T, -np.inf)
        armed = self.gain_in.n >= cfg.warmup_samples and float(np.median(self.gain_in.values[:self.gain_in.n])) \
            <= INPUTS_ARMED
        z_inputs = np.where(long_enough & (in_gain >= INPUTS_GAIN) & np.isfinite(in_t) & armed, t * in_t / INPUTS_T,
                            -np.inf)
        self.gain_in.add(in_gain[long_enough & np.isfinite(in_t)])
        inputs = z_inputs > z_shift  # the labels-are-inputs reading names offset −1, its own gain and t
        shift_k = np.where(inputs, float(INPUTS_OFFSET), shift_k)
        shift_gain, shift_t = np.where(inputs, in_gain, shift_gain), np.where(inputs, in_t, shift_t)
        z_shift = np.maximum(z_shift, z_inputs)
        by_shift = z_shift > z
        z = np.where(by_shift, z_shift, z)
        flagged = np.flatnonzero(judged & (z >= t))
        top = flagged[np.argsort(-z[flagged], kind="stable")][: cfg.max_outliers]  # worst first
        outliers = tuple(self._outlier(int(i), z_win[i] > z_mean[i], metas, mb_of, host, where, decode,
                                       score[i], z[i], med, wmed, dmean[i] if use_d[i] else None, dmed,
                                       (int(shift_k[i]), float(shift_gain[i]), float(shift_t[i]))
                                       if by_shift[i] else None)
                         for i in top)
        zj = z[judged]
        counts = np.bincount(np.searchsorted(np.asarray(SAMPLE_Z_BUCKETS), zj, side="left"),
                             minlength=len(SAMPLE_Z_BUCKETS) + 1)
        self._remember(np.minimum(score[judged], med + t * sd), np.minimum(wmax[has_win], wmed + t * wsd)
                       if math.isfinite(wsd) else wmax[has_win], n[judged],
                       np.minimum(dmean[has_d], dmed + t * dsd) if math.isfinite(dsd) else dmean[has_d],
                       np.minimum(dself[has_d], smed + t * ssd) if math.isfinite(ssd) else dself[has_d])
        return SampleStats(**stats, z_counts=tuple(int(c) for c in counts), z_sum=float(zj.sum()),
                           max_z=float(zj.max()), baseline=med, flagged=len(flagged), outliers=outliers)

    def _remember(self, score: np.ndarray, window: np.ndarray, n: np.ndarray, deficit: np.ndarray,
                  self_z: np.ndarray) -> None:
        self.mean.add(score)
        self.win.add(window)
        self.length.add(n)
        self.deficit.add(deficit)
        self.self_z.add(self_z)

    def _outlier(self, i: int, by_window: bool, metas: Sequence[MicroBatchMeta], mb_of: np.ndarray,
                 host: np.ndarray, where: dict[str, Any], decode: Callable[[list[int]], str] | None,
                 score: float, z: float, med: float, wmed: float, deficit: float | None,
                 dmed: float, shifted: tuple[int, float, float] | None = None) -> SampleOutlier:
        cfg, M = self.cfg, len(metas)
        S = sum(x.n_samples for x in metas)
        m = int(mb_of[i])
        meta = metas[m]
        b = i - int(np.searchsorted(mb_of, m))  # the sample's index within its micro-batch
        first = sum(x.n_tokens for x in metas[:m])  # flat offset of the micro-batch
        a, e = meta.bounds(b)
        lay = pack_layout(len(host), M, S)
        n = int(lay.get(host, "n")[i])
        if by_window and shifted is None:
            start = int(lay.get(host, "wstart")[i]) - first - a
            end, score, baseline = start + cfg.window, float(lay.get(host, "wmax")[i]), wmed
        else:
            start, end, baseline = 0, e - a, med
        text = _excerpt(meta, b, start, min(end, start + cfg.excerpt_tokens), decode)
        what = f"its worst {cfg.window}-token window" if by_window else "its mean over the sample"
        beyond = "" if deficit is None else (f"; p(label) {deficit:.3f} below the model's own Σp² on average "
                                             f"(run median {dmed:.3f})")
        if shifted is not None:
            k, gain, t = shifted
            what = f"its mean over the sample; labels look shifted by {k:+d}"
            beyond = (f"; the model predicts its labels {gain:.2f} nats/token better {abs(k)} position"
                      f"{'s' if abs(k) > 1 else ''} {'later' if k > 0 else 'earlier'} than where they stand "
                      f"(paired t {t:.1f}): misaligned labels")
        return SampleOutlier(
            kind=OutlierKind.SURPRISE, step=where["step"], job=where["job"], rank=where["rank"],
            time_unix=where["time_unix"],
            score=float(score), z=float(z), baseline=float(baseline), micro_batch=meta.index, sample=b,
            sample_id=meta.sample_id(b), start=start, end=end, tokens=n, text=text, sample_info=meta.sample_info(b),
            detail=f"surprise {score:.2f} nats/token ({what}; run median {baseline:.2f}){beyond}, z {z:.1f}")


def _misaligned(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sample, from the pack's per-offset rows (2K gains, then 2K paired t; collector/surprise.py): the offset
    that predicts its labels best, that offset's gain and t (0, 0, −inf where none was read)."""
    S = rows.shape[1]
    if not len(rows):
        return np.zeros(S), np.zeros(S), np.full(S, -np.inf)
    gain, t = np.split(rows, 2)  # (2K, S) each
    ks = np.asarray(offsets(len(gain) // 2))
    judged = np.isfinite(t) & (ks != COPY_OFFSET)[:, None]  # (2K, S)
    best = np.argmax(np.where(judged, gain, -np.inf), axis=0)  # (S,)
    col = np.arange(S)
    found = judged[best, col]
    return ks[best].astype(float), np.where(found, gain[best, col], 0.0), np.where(found, t[best, col], -np.inf)


def _at_offset(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, the gain and paired t at offset ``k`` (0 and −inf where it was not read)."""
    S = rows.shape[1]
    ks = list(offsets(len(rows) // 4)) if len(rows) else []
    if k not in ks:
        return np.zeros(S), np.full(S, -np.inf)
    gain, t = np.split(rows, 2)  # (2K, S) each
    j = ks.index(k)
    ok = np.isfinite(t[j])
    return np.where(ok, gain[j], 0.0), np.where(ok, t[j], -np.inf)


def _excerpt(meta: MicroBatchMeta, sample: int, start: int, end: int,
             decode: Callable[[list[int]], str] | None) -> str | None:
    """Decoded ids of positions [start, end) of one sample (one small host copy, outlier steps only)."""
    if meta.token_ids is None or decode is None:
        return None
    a, _ = meta.bounds(sample)
    ids = [int(x) for x in meta.token_ids.reshape(-1)[a + start: a + end].tolist() if x >= 0]  # (B, T) -> (B·T,)
    try:
        return str(decode(ids))
    except Exception:  # noqa: BLE001 - a tokenizer failure costs the excerpt, nothing else
        log.debug("gradloc: decoding an outlier's excerpt failed", exc_info=True)
        return None


class MismatchJudge:
    """A sustained training–inference mismatch: the step's mismatch share above rl_factor × the run's
    baseline + rl_margin for rl_patience steps in a row (one finding when the streak reaches it)."""

    def __init__(self, cfg: SampleConfig) -> None:
        self.cfg = cfg
        self.healthy: deque[float] = deque(maxlen=256)
        self.streak = 0

    def observe(self, rl: RLStats | None, where: dict[str, Any]) -> tuple[float | None, SampleOutlier | None]:
        """(the baseline after the step, a finding or None)."""
        frac = None if rl is None else rl.mismatch_fraction
        if frac is None or not math.isfinite(frac):
            return self.baseline, None
        cfg, base = self.cfg, self.baseline
        if base is None or frac <= cfg.rl_factor * base + cfg.rl_margin:
            self.streak = 0
            self.healthy.append(frac)
            return self.baseline, None
        self.streak += 1
        if self.streak != cfg.rl_patience:
            return base, None
        v = np.asarray(self.healthy)
        sd = max(1.4826 * float(np.median(np.abs(v - base))), 0.01)
        return base, SampleOutlier(
            kind=OutlierKind.RL_MISMATCH, step=where["step"], job=where["job"], rank=where["rank"],
            time_unix=where["time_unix"], score=float(frac), z=(frac - base) / sd, baseline=base, tokens=rl.tokens,
            detail=f"{100 * frac:.1f}% of {rl.tokens} loss tokens have |log π_trainer − log π_rollout| > log 2 for "
                   f"{cfg.rl_patience} steps in a row (run baseline {100 * base:.1f}%)")

    @property
    def baseline(self) -> float | None:
        if len(self.healthy) < self.cfg.rl_warmup:
            return None
        return float(np.median(np.asarray(self.healthy)))
