"""The stages' configs: the detector (and its classifier), the localizer, the per-sample judge."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

from gradloc.config.options import BisectionPolicy, Sensitivity, check, values


@dataclass(frozen=True)
class DetectorConfig:
    """When a step opens an incident (docs/DESIGN-NOTES.md, "Detection"). Detection never changes
    the update.

    ``sensitivity`` ("low", "default", "high"; "zclip": the plain ZClip rule gradloc used before,
    every 2.5σ excursion an incident, no episodes) sets the five fields left at None: ``spike_ratio``,
    ``loss_z_threshold``, ``token_share``, ``episode_steps`` and ``sample_ratio`` (:attr:`PRESETS`; :meth:`resolved`
    gives the config with them filled in). A field given explicitly wins over the preset.
    docs/BENCHMARKS.md §5 has the false incidents per 1,000 healthy steps and the recall of each
    setting.
    """

    # sensitivity -> (spike_ratio, loss_z_threshold, token_share, episode_steps, sample_ratio)
    PRESETS: ClassVar[dict[str, tuple[float, float, float, int, float]]] = {
        "low": (5.0, 6.0, 0.7, 20, 0.0),
        "default": (2.5, 4.0, 0.5, 20, 1.25),
        "high": (1.5, 3.5, 0.3, 20, 1.1),
        "zclip": (1.0, 2.5, 0.0, 0, 0.0),
    }
    FIELDS: ClassVar[tuple[str, ...]] = ("spike_ratio", "loss_z_threshold", "token_share", "episode_steps",
                                         "sample_ratio")
    SENSITIVITIES: ClassVar[tuple[str, ...]] = values(Sensitivity)  # ("low", "default", "high", "zclip")

    sensitivity: Sensitivity = Sensitivity.DEFAULT
    warmup: int = 25
    alpha: float = 0.97
    z_threshold: float = 2.5  # the ZClip band: z of the global norm (also the EMA clamp and the localizer's line)
    # grad_spike also needs global norm >= spike_ratio × its EMA mean: healthy runs on natural text
    # have single steps at 2-4× (rare tokens); the old z > 2.5 rule opened 38-52 incidents per 1,000 steps
    spike_ratio: float | None = None
    layer_z_threshold: float = 6.0
    abs_threshold: float | None = None  # absolute global-norm threshold (GradLoc's τ semantics)
    loss_z_threshold: float | None = None  # z of log(loss)
    token_z_threshold: float = 4.0  # z of log(top token share): one token suddenly dominating
    token_share: float | None = None  # ... and carrying at least this share of the step's per-token scores
    token_ratio: float = 1.5  # ... in a step whose global norm is >= this × its EMA mean (unless token_share is 0)
    # sample_spike: a step out of its band (z > z_threshold), its norm >= this × its EMA mean, with a
    # per-sample surprise outlier (SampleConfig) among its samples; 0: off. In a job each rank judges its
    # own samples, and one all-reduce on a step above this band tells every rank whether any holds one
    sample_ratio: float | None = None
    episode_steps: int | None = None  # flagged steps within this many steps of an episode's last one fold into it (0: off)
    divergence_patience: int = 20  # steps the fast EMA must stay above the slow one
    divergence_margin: float = 0.5  # fast EMA > (1 + margin) × slow EMA counts as rising
    min_std_fraction: float = 0.02  # σ is floored at this fraction of μ (flat warm-ups)
    # warmup_spike: during the warm-up, a global norm above this × the median of the warm-up's last
    # quarter so far (at least 3 steps) is reported on the step and in its record's band (no incident)
    warmup_ratio: float = 3.0

    def __post_init__(self) -> None:
        check(self.sensitivity in self.SENSITIVITIES,
               f"sensitivity must be one of {self.SENSITIVITIES}, got {self.sensitivity!r}")
        object.__setattr__(self, "sensitivity", Sensitivity(self.sensitivity))
        check(self.warmup >= 2, f"warmup must be >= 2 steps, got {self.warmup}")
        check(0.0 < self.alpha < 1.0, f"alpha must be in (0, 1), got {self.alpha}")
        for name in ("z_threshold", "layer_z_threshold", "loss_z_threshold", "token_z_threshold"):
            v = getattr(self, name)
            check(v is None or v > 0, f"{name} must be > 0, got {v}")
        check(self.spike_ratio is None or self.spike_ratio >= 1, f"spike_ratio must be >= 1, got {self.spike_ratio}")
        check(self.token_ratio >= 1, f"token_ratio must be >= 1, got {self.token_ratio}")
        check(self.sample_ratio is None or self.sample_ratio == 0 or self.sample_ratio >= 1,
               f"sample_ratio must be 0 (off) or >= 1, got {self.sample_ratio}")
        check(self.token_share is None or 0 <= self.token_share < 1,
               f"token_share must be in [0, 1), got {self.token_share}")
        check(self.episode_steps is None or (isinstance(self.episode_steps, int) and self.episode_steps >= 0),
               f"episode_steps must be an int >= 0, got {self.episode_steps!r}")
        check(self.abs_threshold is None or self.abs_threshold > 0, "abs_threshold must be > 0")
        check(self.divergence_patience >= 1, "divergence_patience must be >= 1")
        check(self.divergence_margin > 0, "divergence_margin must be > 0")
        check(0 <= self.min_std_fraction < 1, "min_std_fraction must be in [0, 1)")
        check(self.warmup_ratio > 1, f"warmup_ratio must be > 1, got {self.warmup_ratio}")

    def resolved(self) -> DetectorConfig:
        """This config with the fields left at None taken from its ``sensitivity`` preset."""
        preset = dict(zip(self.FIELDS, self.PRESETS[self.sensitivity]))
        return replace(self, **{k: v for k, v in preset.items() if getattr(self, k) is None})


BISECTION_POLICIES = values(BisectionPolicy)  # ("off", "fallback", "on_failure")


@dataclass(frozen=True)
class ClassifierConfig:
    """Thresholds of the spike classes (docs/rl.md, "Classification").

    A culprit token is a *training–inference mismatch* when |log π_old − log π_rollout| (the same
    weights scored by the trainer and by the inference engine; π_train when no old policy is given)
    ≥ ``mismatch_log_ratio`` at the token, or on average over its sequence (the geometric-mean
    ratio); *stale off-policy* when |log π_train − log π_old| ≥ ``stale_log_ratio``; a
    *low-probability token with a large advantage* when π_train ≤ ``low_prob``, |A| ≥
    ``advantage_z`` × the step's RMS advantage, and its ratio was not clipped (by the loss's own
    flag, else |ratio − 1| ≤ ``clip_epsilon``). A spike is *layer-concentrated* when one layer
    carries ≥ ``layer_share`` of ‖∇‖² and its own z-score flagged it.
    """

    mismatch_log_ratio: float = math.log(2.0)  # a ratio outside [1/2, 2], as truncated importance sampling uses
    stale_log_ratio: float = math.log(2.0)
    low_prob: float = 0.05
    advantage_z: float = 2.0
    clip_epsilon: float = 0.2
    layer_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("mismatch_log_ratio", "stale_log_ratio", "advantage_z", "clip_epsilon"):
            check(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        check(0 < self.low_prob < 1, f"low_prob must be in (0, 1), got {self.low_prob}")
        check(0 < self.layer_share <= 1, f"layer_share must be in (0, 1], got {self.layer_share}")


@dataclass(frozen=True)
class LocalizerConfig:
    """One-pass attribution, verified with at most ``max_probes`` masked-loss probes.

    ``bisection``: ``"fallback"`` (default) runs GradLoc-style bisection (up to ``bisection_budget``
    probes) only when attribution is unavailable: more than half of ‖∇‖² in parameters no per-token
    rule covers (a step without any per-token statistics cannot be bisected either: the probes need
    its micro-batches' layout); ``"on_failure"`` also runs it when the attributed candidates fail
    verification (a diffuse spike: dozens of probes); ``"off"`` never.
    """

    max_probes: int = 3
    min_explained_share: float = 0.5
    max_candidates: int = 32
    candidate_rel_score: float = 0.1  # a candidate's score must be >= this × the top score
    candidate_outlier_factor: float = 20.0  # ... and >= this × the median token score
    bisection: BisectionPolicy = BisectionPolicy.FALLBACK
    bisection_budget: int = 48
    bisection_sigma: float = 4.0  # a token subset is hot above sigma × the healthy-noise level
    context_tokens: int = 8
    classifier: ClassifierConfig = field(default_factory=ClassifierConfig)

    def __post_init__(self) -> None:
        check(isinstance(self.classifier, ClassifierConfig), "classifier must be a ClassifierConfig")
        check(self.max_probes >= 1, f"max_probes must be >= 1, got {self.max_probes}")
        check(0 < self.min_explained_share <= 1, "min_explained_share must be in (0, 1]")
        check(self.max_candidates >= 1, "max_candidates must be >= 1")
        check(0 < self.candidate_rel_score <= 1, "candidate_rel_score must be in (0, 1]")
        check(self.candidate_outlier_factor >= 1, "candidate_outlier_factor must be >= 1")
        check(self.bisection in BISECTION_POLICIES, f"bisection must be one of {BISECTION_POLICIES}, got {self.bisection!r}")
        object.__setattr__(self, "bisection", BisectionPolicy(self.bisection))
        check(self.bisection_budget >= 1, "bisection_budget must be >= 1")
        check(self.bisection_sigma > 0, "bisection_sigma must be > 0")
        check(self.context_tokens >= 0, "context_tokens must be >= 0")


@dataclass(frozen=True)
class SampleConfig:
    """Per-sample outlier findings (docs/DESIGN-NOTES.md, "Per-sample surprise"): no probe, no page.

    Each sample's surprise (mean −log p over its loss tokens, p read off the loss head's output
    gradient, each token capped at ``token_cap`` nats) and its worst ``window``-token span are judged
    against the run's own history: the median and MAD of the last ``history`` judged samples, after
    ``warmup_samples``. z ≥ ``z_threshold`` makes a ``SampleOutlier``. With ``calibrated`` (default), where
    the head's ‖g‖² was read, a sample's z is the larger of its calibration deficit's z (Σ_v p_v² − p(y),
    0 on average wherever the model is calibrated, however odd the text; judged both as a mean and in units
    of its own spread under the model) and its surprise's z / 1.5: odd but legitimate text must be
    1.5 × z_threshold out on surprise alone. A sample whose labels the model predicts far better at a
    neighbouring position (up to ``label_shifts`` away) than where they stand is a finding too: misaligned
    labels, its own reference (collector/head_read.py). Samples with fewer than
    ``min_tokens`` loss tokens are not judged. RL: a step whose mismatch share (loss tokens with
    |log π_trainer − log π_rollout| > log 2) exceeds ``rl_factor`` × the run's baseline +
    ``rl_margin`` for ``rl_patience`` steps in a row is a ``rl_mismatch`` finding (baseline: the
    median of the last 256 steps that were not, after ``rl_warmup`` steps). The shipped alert rule
    GradlocRLMismatchSustained uses the default factor and margin.
    """

    enabled: bool = True
    z_threshold: float = 6.0
    window: int = 32
    min_tokens: int = 16
    token_cap: float = 9.21  # nats: −log 1e-4
    warmup_samples: int = 256
    history: int = 1024
    max_outliers: int = 16  # SampleOutlier records per step (all are counted in SampleStats.flagged)
    excerpt_tokens: int = 48
    calibrated: bool = True  # judge the calibration deficit too, surprise alone only far out (see above)
    label_shifts: int = 8  # labels compared with the model's predictions 1 … this many positions away (0: off)
    rl_factor: float = 2.0
    rl_margin: float = 0.05
    rl_patience: int = 3
    rl_warmup: int = 10

    def __post_init__(self) -> None:
        for name in ("z_threshold", "token_cap", "rl_factor", "rl_margin"):
            check(getattr(self, name) > 0, f"samples.{name} must be > 0, got {getattr(self, name)}")
        check(self.window >= 2, f"samples.window must be >= 2 tokens, got {self.window}")
        check(self.min_tokens >= 1, f"samples.min_tokens must be >= 1, got {self.min_tokens}")
        check(1 <= self.warmup_samples <= self.history,
               f"samples.warmup_samples must be in [1, history={self.history}], got {self.warmup_samples}")
        check(0 <= self.label_shifts <= 64, f"samples.label_shifts must be in [0, 64], got {self.label_shifts}")
        for name in ("max_outliers", "excerpt_tokens", "rl_patience", "rl_warmup"):
            check(getattr(self, name) >= 1, f"samples.{name} must be >= 1, got {getattr(self, name)}")
        check(self.max_outliers <= 255, f"samples.max_outliers must be <= 255 (the agent takes 256 findings "
                                         f"per step), got {self.max_outliers}")
