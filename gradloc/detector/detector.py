"""Spike detection on step records. Observability only: it never clips or changes the update.

Kinds a :class:`SpikeEvent` can carry (``INCIDENT`` ones open an incident, ``LOCALIZE`` ones also
run the localizer; ``layer_spike`` and ``skipped_step`` alone are reported on the step only):
``grad_spike`` (global-norm z > z_threshold *and* global norm >= spike_ratio × its EMA mean),
``sample_spike`` (below that line, z > z_threshold and norm >= sample_ratio × its EMA mean in a
step with a per-sample surprise outlier: the sample that moved the gradient is known to be odd),
``abs_threshold`` (global norm > abs_threshold), ``layer_spike`` (some layer's own z >
layer_z_threshold), ``nonfinite_grad``, ``nonfinite_loss``, ``loss_spike`` (z of log(loss) >
loss_z_threshold: loss spikes are multiplicative, and a falling loss inflates a linear σ),
``token_spike`` (z of log(top token's attribution share) > token_z_threshold, and, unless
token_share is 0, that share >= token_share in a step whose global norm >= token_ratio × its EMA
mean: one token
suddenly carries a large part of the gradient, as a corrupted label does even when its bounded
cross-entropy gradient leaves the global norm below the grad_spike line), ``divergence``
(the fast EMA of the global norm stayed above (1 + margin) × the slow EMA for
``divergence_patience`` steps), ``warmup_spike`` (during the statistics' warm-up, global norm >
``warmup_ratio`` × the median of the warm-up's last quarter so far: reported on the step and in the
record's band, no incident), ``skipped_step`` (GradScaler found inf/NaN and will skip the update
— normal while the scale calibrates, so not localized).

Episodes: the steps after a spike (the run reacting to it: Adam's moments, the clipped update) are
one episode with it. A step with incident kinds that comes within ``episode_steps`` steps of the
episode's last flagged step carries ``SpikeEvent.episode`` (the step of the incident that opened
it) and opens no incident of its own (:func:`opens_incident`), unless its kinds are non-finite
(always an incident, at once), include an incident kind the episode's incident did not have (a
different trouble: a planted token's loss_spike after a natural grad_spike), or its global norm
is more than ``ESCALATION`` × the episode's largest (a worse spike, not a reaction), or it is a new
cause (:func:`new_cause`, read from the record, no extra pass): most of its top tokens' score is in
samples the episode's incidents did not name, and the step shows they are bad data — one is a
per-sample surprise outlier, or its rollouts are above the rl_mismatch line
(``SampleStats.rl_mismatch_streak``). A new cause opens its own incident, linked by
``SpikeEvent.follows`` (the episode's incident step) and explained in ``SpikeEvent.detail``; the episode
goes on. At most ``NEW_CAUSES`` per episode (a run that keeps spiking: bounded; a new episode opened
inside an open one keeps its count). The echo of one bad update (fresh samples carrying the tokens it
broke, a concentrated top included: the demo's step 187) has no such evidence and folds.

Statistics (gradloc/detector/ema.py): robust at the end of the warm-up (median level, σ from the
MAD of step-to-step differences) and trend-aware after it (σ is the spread of the clamped residuals
around the trend, not around the lagging EMA mean), so an early spike or the fall of early training
cannot inflate σ. ``sensitivity="zclip"`` keeps ZClip's own statistics.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from gradloc.config import DetectorConfig
from gradloc.detector.ema import EmaZ, ZClipEma
from gradloc.records import OutlierKind, SpikeEvent, SpikeKind, StepRecord

K = SpikeKind
LOCALIZE: frozenset[SpikeKind] = frozenset({K.GRAD_SPIKE, K.ABS_THRESHOLD, K.NONFINITE_GRAD, K.LOSS_SPIKE,
                                            K.TOKEN_SPIKE, K.SAMPLE_SPIKE})
INCIDENT: frozenset[SpikeKind] = LOCALIZE | {K.NONFINITE_LOSS, K.DIVERGENCE}
NONFINITE: frozenset[SpikeKind] = frozenset({K.NONFINITE_GRAD, K.NONFINITE_LOSS})
ESCALATION = 2.0  # inside an episode, a global norm above this × the episode's largest opens a new incident
NEW_CAUSES = 8  # new-cause incidents one episode may open (a run that keeps spiking: bounded)
NEW_SHARE = 0.5  # a new cause: at least this share of the top tokens' score is in samples the episode had not named
_FAST_ALPHA = 0.7


def grad_spike_line(mean: float, std: float, config: DetectorConfig) -> float:
    """The global-norm line a grad_spike crosses: the larger of mean + z_threshold·std and spike_ratio·mean
    (``config`` resolved)."""
    return max(mean + config.z_threshold * std, (config.spike_ratio or 1.0) * mean)


def norm_line(spike: SpikeEvent, config: DetectorConfig) -> float | None:
    """The global-norm line ``spike``'s step was flagged against: a step whose norm stays above it would
    still be flagged (the localizer's "is the rest still a spike", localizer/context.py). grad_spike: its
    line (the record's band); sample_spike: the larger of mean + z·std and sample_ratio·mean; any other
    kind (loss, token, nonfinite: no norm line of their own): mean + z·std, the band's z line. None
    during the warm-up (no band). ``config`` resolved (SpikeDetector.config)."""
    if spike.mean is None or spike.std is None:
        return None
    if K.GRAD_SPIKE in spike.kinds:
        return grad_spike_line(spike.mean, spike.std, config)
    z_line = spike.mean + config.z_threshold * spike.std
    if K.SAMPLE_SPIKE in spike.kinds and config.sample_ratio:
        return max(z_line, config.sample_ratio * spike.mean)
    return z_line


def opens_incident(spike: SpikeEvent) -> bool:
    """Whether ``spike`` opens an incident: it has incident kinds and is not part of an earlier
    incident's episode."""
    return spike.episode is None and not INCIDENT.isdisjoint(spike.kinds)


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


class SpikeDetector:
    def __init__(self, config: DetectorConfig, layers: list[str]) -> None:
        self.config = c = config.resolved()  # the sensitivity preset's thresholds filled in
        self.layers = list(layers)
        stats = ZClipEma if c.sensitivity == "zclip" else EmaZ  # "zclip": the old rule, its statistics too
        self._global = stats(1, c.warmup, c.alpha, c.min_std_fraction)
        self._loss = stats(1, c.warmup, c.alpha, c.min_std_fraction)
        self._layers = stats(len(layers), c.warmup, c.alpha, c.min_std_fraction)
        self._top = stats(1, c.warmup, c.alpha, c.min_std_fraction)
        self._fast: float | None = None
        self._warm_band: tuple[int, float] | None = None  # (step, warm-up level) of the last warm-up step judged
        self._rising = 0
        self._episode: _Episode | None = None
        self._last_healthy: int | None = None  # the last step judged with no kind at all, outside any episode
        self._layer_z: np.ndarray | None = None  # the last observed step's per-layer z-scores (see layer_z)
        # a job's ranks: whether a flag holds on any rank (one all-reduce), set by the monitor. Each rank
        # judges only its own samples; sample_spike must be the job's verdict, the same on every rank.
        self.agree: Callable[[bool], bool] | None = None

    def healthy_loss(self) -> float | None:
        """Healthy loss level: exp of the EMA mean of log(loss) (None during warm-up)."""
        return float(math.exp(self._loss.mean[0])) if self._loss.ready[0] else None

    def healthy_norm(self) -> float | None:
        """EMA mean of the global norm (None during warm-up): the localizer's noise reference."""
        return float(self._global.mean[0]) if self._global.ready[0] else None

    def band(self, spike: SpikeEvent) -> dict[str, float | None]:
        """The healthy band ``spike``'s step was judged against, as StepRecord fields: the EMA mean
        and the grad_spike line, the larger of mean + z_threshold * std and spike_ratio * mean. During
        the warm-up, the warm-up's level so far and the warmup_spike line, warmup_ratio × that level
        (both None before 3 finite samples)."""
        if spike.mean is None or spike.std is None:
            wb = self._warm_band
            if wb is not None and wb[0] == spike.step:
                return {"norm_mean": wb[1], "norm_threshold": self.config.warmup_ratio * wb[1]}
            return {"norm_mean": None, "norm_threshold": None}
        return {"norm_mean": spike.mean, "norm_threshold": grad_spike_line(spike.mean, spike.std, self.config)}

    def z_of(self, global_norm: float) -> float | None:
        z = float(self._global.z(np.array([global_norm]))[0])
        return z if math.isfinite(z) else None

    def observe(self, rec: StepRecord) -> SpikeEvent:
        c = self.config
        kinds: list[SpikeKind] = []
        g = rec.global_norm
        mean, loss_mean = self.healthy_norm(), self.healthy_loss()
        std = float(self._global.std[0]) if mean is not None else None
        if rec.skipped:
            kinds.append(K.SKIPPED_STEP)
        elif rec.nonfinite > 0 or not math.isfinite(g):
            kinds.append(K.NONFINITE_GRAD)
        if rec.loss is not None and not math.isfinite(rec.loss):
            kinds.append(K.NONFINITE_LOSS)
        z = self.z_of(g) if math.isfinite(g) else None
        if z is not None and z > c.z_threshold and mean is not None and g >= c.spike_ratio * mean:
            kinds.append(K.GRAD_SPIKE)
        elif z is not None and z > c.z_threshold and self._outlier_sample(rec, mean):
            kinds.append(K.SAMPLE_SPIKE)
        elif mean is None and not rec.skipped and self._warmup_spike(rec.step, g):
            kinds.append(K.WARMUP_SPIKE)
        if c.abs_threshold is not None and math.isfinite(g) and g > c.abs_threshold:
            kinds.append(K.ABS_THRESHOLD)
        hot_layers = self._layer_spikes(rec)
        if hot_layers:
            kinds.append(K.LAYER_SPIKE)
        if self._token_spike(rec, mean):
            kinds.append(K.TOKEN_SPIKE)
        loss_z = None
        if _finite(rec.loss) and rec.loss > 0:
            log_loss = np.array([math.log(rec.loss)])
            lz = float(self._loss.z(log_loss)[0])
            loss_z = lz if math.isfinite(lz) else None
            if loss_z is not None and loss_z > c.loss_z_threshold:
                kinds.append(K.LOSS_SPIKE)
            self._loss.update(log_loss, c.loss_z_threshold)
        if math.isfinite(g) and not rec.skipped:
            if self._divergence(g):
                kinds.append(K.DIVERGENCE)
            self._global.update(np.array([g]), c.z_threshold)
        healthy_before = self._last_healthy
        episode, follows, detail = self._fold(rec, kinds, g)
        if not kinds and episode is None:
            self._last_healthy = rec.step
        opens = not INCIDENT.isdisjoint(kinds) and episode is None
        last_healthy = (self._episode.healthy if follows is not None and self._episode is not None
                        else healthy_before) if opens else None
        return SpikeEvent(step=rec.step, kinds=tuple(kinds), global_norm=g, z=z, mean=mean, std=std, loss=rec.loss,
                          loss_z=loss_z, loss_mean=loss_mean, layers=hot_layers, episode=episode, follows=follows,
                          detail=detail, last_healthy_step=last_healthy)

    def _fold(self, rec: StepRecord, kinds: list[SpikeKind], g: float) -> tuple[int | None, int | None, str]:
        """(the episode ``rec``'s step belongs to, None: it opens an incident or is outside any episode;
        the episode a new-cause incident opens inside; the spike's detail)."""
        step, (ep, horizon) = rec.step, (self._episode, self.config.episode_steps)
        if ep is not None and step - ep.last > horizon:
            ep = self._episode = None
        if INCIDENT.isdisjoint(kinds):
            return (ep.start if ep is not None else None), None, ""
        norm = g if math.isfinite(g) else math.inf
        flagged = INCIDENT.intersection(kinds)
        if (ep is None or not NONFINITE.isdisjoint(kinds) or norm > ESCALATION * ep.peak
                or not flagged <= ep.kinds):
            if horizon > 0:  # a new episode inside an open one keeps its budget of new causes: bounded
                seen = culprit_samples(rec) | (ep.seen if ep is not None else frozenset())
                self._episode = _Episode(step, step, norm, flagged, seen)
                self._episode.causes = ep.causes if ep is not None else 0
                self._episode.healthy = ep.healthy if ep is not None else self._last_healthy
            return None, None, ""
        ep.last, ep.peak = step, max(ep.peak, norm)
        new, why = (new_cause(rec, ep.seen) if ep.causes < NEW_CAUSES else (frozenset(), ""))
        if ep.causes < NEW_CAUSES and (self.agree(bool(new)) if self.agree is not None else bool(new)):
            ep.causes += 1  # every rank counts it: the job's verdict (one all-reduce, flagged steps in an episode only)
            ep.seen |= new
            return None, ep.start, (f"new cause inside the episode of step {ep.start}: {why or 'on another rank'} "
                                    f"({ep.causes} of at most {NEW_CAUSES} in one episode)")
        return ep.start, None, ""

    def _warmup_spike(self, step: int, g: float) -> bool:
        """During the warm-up: ``g`` is above warmup_ratio × the warm-up's recent median (a real early
        spike, reported; the robust warm-up statistics do not take it in)."""
        self._warm_band = None
        level = float(self._global.warm_level()[0])
        if not (math.isfinite(level) and level > 0):
            return False
        self._warm_band = (step, level)
        return math.isfinite(g) and g > self.config.warmup_ratio * level

    def _outlier_sample(self, rec: StepRecord, mean: float | None) -> bool:
        """The step's norm is >= sample_ratio × its mean and a sample of it is a surprise outlier: a bad
        sample that moved the gradient, below the grad_spike line (a truncated document, a duplicated
        garbage sample: 1.3-1.8× on docs/BENCHMARKS.md §6's runs)."""
        ratio = self.config.sample_ratio
        if not ratio or mean is None or not mean > 0 or rec.global_norm < ratio * mean:
            return False  # the job's norm and band: every rank returns here, or none does
        mine = rec.samples is not None and any(o.kind == OutlierKind.SURPRISE for o in rec.samples.outliers)
        return self.agree(mine) if self.agree is not None else mine

    def _token_spike(self, rec: StepRecord, mean: float | None) -> bool:
        c = self.config
        share = rec.tokens.top_share if rec.tokens is not None else 0.0
        if rec.skipped or not (share > 0 and math.isfinite(share)):
            return False
        x = np.array([math.log(share)])
        z = float(self._top.z(x)[0])
        self._top.update(x, c.token_z_threshold)
        if not (math.isfinite(z) and z > c.token_z_threshold):
            return False
        # a token that takes over a step whose norm stayed near its mean is a shift of the gradient
        # between tokens (rare tokens of natural text), not a spike. The line is a ratio, not the norm's
        # z: early in a run σ is wide, and a planted token's step at 2× the mean sits at z 1.4 (the
        # two-rank demo); bench/healthy.py measured the ratio's false incidents (docs/BENCHMARKS.md §5)
        return c.token_share == 0 or (share >= c.token_share and _finite(mean) and mean > 0
                                      and rec.global_norm >= c.token_ratio * mean)

    @property
    def layer_z(self) -> dict[str, float]:
        """The last observed step's finite per-layer z-scores by layer name (the incident's layer table); built
        on demand, so a healthy step pays nothing for it."""
        z = self._layer_z
        if z is None:
            return {}
        return {name: float(v) for name, v in zip(self.layers, z) if math.isfinite(v)}

    def _layer_spikes(self, rec: StepRecord) -> tuple[str, ...]:
        self._layer_z = None
        if not self.layers:
            return ()
        by_name = {s.layer: s.grad_norm for s in rec.layers}
        x = np.array([by_name.get(name, np.nan) for name in self.layers], dtype=float)
        if rec.skipped:
            return ()
        z = self._layers.z(x)
        self._layer_z = z
        self._layers.update(x, self.config.layer_z_threshold)
        with np.errstate(invalid="ignore"):
            hot = np.nan_to_num(z, nan=-np.inf) > self.config.layer_z_threshold
        order = np.argsort(-np.nan_to_num(z, nan=-np.inf))
        return tuple(self.layers[i] for i in order if hot[i])

    def _divergence(self, g: float) -> bool:
        self._fast = g if self._fast is None else _FAST_ALPHA * self._fast + (1 - _FAST_ALPHA) * g
        slow = self.healthy_norm()
        if slow is None:
            return False
        self._rising = self._rising + 1 if self._fast > (1 + self.config.divergence_margin) * slow else 0
        if self._rising >= self.config.divergence_patience:
            self._rising = 0
            return True
        return False


class _Episode:
    """An open episode: the step of its incident, its last flagged step, its largest global norm,
    the incident kinds of its incident, the samples its incidents' attribution named, the new-cause
    incidents opened inside it."""

    __slots__ = ("start", "last", "peak", "kinds", "seen", "causes", "healthy")

    def __init__(self, start: int, last: int, peak: float, kinds: set[SpikeKind], seen: frozenset) -> None:
        self.start, self.last, self.peak, self.kinds, self.seen, self.causes = start, last, peak, kinds, seen, 0
        self.healthy: int | None = None  # the last healthy step before the episode (its incidents' rollback point)


def _key(step: int, sample_id: str | None, micro_batch: int | None, sample: int | None) -> object:
    """A sample's identity: its id, or without one its place in its step (then every step's are new)."""
    return sample_id if sample_id is not None else (step, micro_batch, sample)


def culprit_samples(rec: StepRecord) -> frozenset:
    """The samples (sample id, or (micro-batch, sample)) of the step's top tokens."""
    top = rec.tokens.top if rec.tokens is not None else ()
    return frozenset(_key(rec.step, t.sample_id, t.micro_batch, t.sample) for t in top)


def new_cause(rec: StepRecord, seen: frozenset) -> tuple[frozenset, str]:
    """(the new culprit samples, why) when a flagged step inside an episode is new bad data, else
    (empty, ""): most of its top tokens' score is in samples the episode's incidents did not name, and
    the step itself shows those samples are bad data — one of them is a per-sample surprise outlier,
    or the step's rollouts disagree with the trainer (its mismatch share is above the rl_mismatch line).
    The echo of one bad update (Adam's moments: fresh samples that carry the broken tokens) has
    neither, so it folds. Read from the record: no extra pass."""
    top = rec.tokens.top if rec.tokens is not None else ()
    mass: dict[object, float] = {}
    for t in top:
        k = _key(rec.step, t.sample_id, t.micro_batch, t.sample)
        mass[k] = mass.get(k, 0.0) + t.share
    new = frozenset(k for k in mass if k not in seen)
    total = sum(mass.values())
    if not new or not total > 0 or sum(mass[k] for k in new) < NEW_SHARE * total:
        return frozenset(), ""
    found = rec.samples.outliers if rec.samples is not None else ()
    odd = sorted(str(k) for k in new if any(o.kind == OutlierKind.SURPRISE and
                                            _key(rec.step, o.sample_id, o.micro_batch, o.sample) == k for o in found))
    if odd:
        return new, f"new culprit sample(s) {', '.join(odd[:3])} are surprise outliers"
    streak = rec.samples.rl_mismatch_streak if rec.samples is not None else 0
    if streak > 0:
        return new, (f"{len(new)} new culprit sample(s) on a step whose rollouts disagree with the trainer "
                     f"({streak} step(s) above the rl_mismatch line)")
    return frozenset(), ""
