"""Typed configuration, validated on construction (invalid values raise :class:`ConfigError`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Callable, ClassVar, Union

from gradloc.errors import ConfigError

# "module": one layer per module that owns parameters; an int N: the first N dotted name parts;
# a callable: parameter name -> layer name.
LayerGrouping = Union[str, int, Callable[[str], str]]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# -- the closed sets of string options (each field also takes the plain string; it becomes the member) -----
class Sensitivity(StrEnum):
    """``DetectorConfig.sensitivity``: the preset of the detector's thresholds (DetectorConfig.PRESETS)."""

    LOW = "low"
    DEFAULT = "default"
    HIGH = "high"
    ZCLIP = "zclip"  # the plain ZClip rule: every 2.5σ excursion an incident, no episodes


class BisectionPolicy(StrEnum):
    """``LocalizerConfig.bisection``: when GradLoc-style probe bisection runs."""

    OFF = "off"
    FALLBACK = "fallback"  # only when attribution is unavailable
    ON_FAILURE = "on_failure"  # also when the attributed candidates fail verification


class UpdateRatioMode(StrEnum):
    """``WatchConfig.update_ratio``: how the update-to-weight ratios are measured."""

    LEAN = "lean"  # a rotating window of pre-step parameter copies within the memory budget
    FULL = "full"  # every parameter copied every step
    OFF = "off"


class RemedyAction(StrEnum):
    """``WatchConfig.remedy`` (and ``Remedy.action`` of the incidents it acted on)."""

    DROP_CULPRITS = "drop_culprits"  # the gradient becomes ∇ − ∇_C
    SKIP_STEP = "skip_step"  # every gradient set to None


class TokenStatsMode(StrEnum):
    """``WatchConfig.token_stats`` besides True (always) and False (never)."""

    ON_SPIKE = "on_spike"  # hooks only to re-run a flagged step's micro-batches (gradloc/engine/on_spike.py)


class DistributedMode(StrEnum):
    """``WatchConfig.distributed``."""

    AUTO = "auto"  # an initialised torch.distributed job of > 1 rank is watched as one
    OFF = "off"


def _values(kind: type[StrEnum]) -> tuple[str, ...]:
    return tuple(m.value for m in kind)


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
    SENSITIVITIES: ClassVar[tuple[str, ...]] = _values(Sensitivity)  # ("low", "default", "high", "zclip")

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
        _check(self.sensitivity in self.SENSITIVITIES,
               f"sensitivity must be one of {self.SENSITIVITIES}, got {self.sensitivity!r}")
        object.__setattr__(self, "sensitivity", Sensitivity(self.sensitivity))
        _check(self.warmup >= 2, f"warmup must be >= 2 steps, got {self.warmup}")
        _check(0.0 < self.alpha < 1.0, f"alpha must be in (0, 1), got {self.alpha}")
        for name in ("z_threshold", "layer_z_threshold", "loss_z_threshold", "token_z_threshold"):
            v = getattr(self, name)
            _check(v is None or v > 0, f"{name} must be > 0, got {v}")
        _check(self.spike_ratio is None or self.spike_ratio >= 1, f"spike_ratio must be >= 1, got {self.spike_ratio}")
        _check(self.token_ratio >= 1, f"token_ratio must be >= 1, got {self.token_ratio}")
        _check(self.sample_ratio is None or self.sample_ratio == 0 or self.sample_ratio >= 1,
               f"sample_ratio must be 0 (off) or >= 1, got {self.sample_ratio}")
        _check(self.token_share is None or 0 <= self.token_share < 1,
               f"token_share must be in [0, 1), got {self.token_share}")
        _check(self.episode_steps is None or (isinstance(self.episode_steps, int) and self.episode_steps >= 0),
               f"episode_steps must be an int >= 0, got {self.episode_steps!r}")
        _check(self.abs_threshold is None or self.abs_threshold > 0, "abs_threshold must be > 0")
        _check(self.divergence_patience >= 1, "divergence_patience must be >= 1")
        _check(self.divergence_margin > 0, "divergence_margin must be > 0")
        _check(0 <= self.min_std_fraction < 1, "min_std_fraction must be in [0, 1)")
        _check(self.warmup_ratio > 1, f"warmup_ratio must be > 1, got {self.warmup_ratio}")

    def resolved(self) -> DetectorConfig:
        """This config with the fields left at None taken from its ``sensitivity`` preset."""
        preset = dict(zip(self.FIELDS, self.PRESETS[self.sensitivity]))
        return replace(self, **{k: v for k, v in preset.items() if getattr(self, k) is None})


BISECTION_POLICIES = _values(BisectionPolicy)  # ("off", "fallback", "on_failure")


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
            _check(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _check(0 < self.low_prob < 1, f"low_prob must be in (0, 1), got {self.low_prob}")
        _check(0 < self.layer_share <= 1, f"layer_share must be in (0, 1], got {self.layer_share}")


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
        _check(isinstance(self.classifier, ClassifierConfig), "classifier must be a ClassifierConfig")
        _check(self.max_probes >= 1, f"max_probes must be >= 1, got {self.max_probes}")
        _check(0 < self.min_explained_share <= 1, "min_explained_share must be in (0, 1]")
        _check(self.max_candidates >= 1, "max_candidates must be >= 1")
        _check(0 < self.candidate_rel_score <= 1, "candidate_rel_score must be in (0, 1]")
        _check(self.candidate_outlier_factor >= 1, "candidate_outlier_factor must be >= 1")
        _check(self.bisection in BISECTION_POLICIES, f"bisection must be one of {BISECTION_POLICIES}, got {self.bisection!r}")
        object.__setattr__(self, "bisection", BisectionPolicy(self.bisection))
        _check(self.bisection_budget >= 1, "bisection_budget must be >= 1")
        _check(self.bisection_sigma > 0, "bisection_sigma must be > 0")
        _check(self.context_tokens >= 0, "context_tokens must be >= 0")


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
            _check(getattr(self, name) > 0, f"samples.{name} must be > 0, got {getattr(self, name)}")
        _check(self.window >= 2, f"samples.window must be >= 2 tokens, got {self.window}")
        _check(self.min_tokens >= 1, f"samples.min_tokens must be >= 1, got {self.min_tokens}")
        _check(1 <= self.warmup_samples <= self.history,
               f"samples.warmup_samples must be in [1, history={self.history}], got {self.warmup_samples}")
        _check(0 <= self.label_shifts <= 64, f"samples.label_shifts must be in [0, 64], got {self.label_shifts}")
        for name in ("max_outliers", "excerpt_tokens", "rl_patience", "rl_warmup"):
            _check(getattr(self, name) >= 1, f"samples.{name} must be >= 1, got {getattr(self, name)}")
        _check(self.max_outliers <= 255, f"samples.max_outliers must be <= 255 (the agent takes 256 findings "
                                         f"per step), got {self.max_outliers}")


UPDATE_RATIO_MODES = _values(UpdateRatioMode)  # ("lean", "full", "off")
REMEDIES = _values(RemedyAction)  # ("drop_culprits", "skip_step")
MIN_MEMORY_BUDGET = 64 * 2**20  # bytes: the persistent-memory floor for small models
MEMORY_BUDGET_FRACTION = 0.02  # of the trainable parameters' bytes
MEMORY_RESERVE = 16 * 2**20  # bytes of the budget kept for gradloc's other state (history, token buffers, agent)


@dataclass(frozen=True)
class WatchConfig:
    """What a monitor measures and where it sends it.

    Memory: gradloc's persistent memory stays within ``memory_budget_bytes`` (default
    max(2% of the trainable parameters' bytes, 64 MiB)). The update-to-weight ratios need a copy of
    the parameters from before ``optimizer.step()``: ``update_ratio="lean"`` (default) copies a
    rotating window of them that fits the budget less gradloc's other persistent tensors and a
    16 MiB reserve for its other state, so every layer gets a ratio at least every
    ⌈parameter bytes / window⌉ steps; ``"full"`` copies all of them every step (1× parameter bytes);
    ``"off"`` measures none. ``True``/``False`` mean ``"lean"``/``"off"``.

    Cost: gradloc times its own work every step (``StepRecord.overhead``). When its smoothed cost
    exceeds ``max_overhead`` of the training step's own time it sheds optional work — first the
    update ratios, then the per-layer breakdown of token scores — and names what it shed in each
    record (``StepRecord.shed``). Detection is never shed. The default 0.5 is a guardrail against
    pathological cases (real models cost a few percent; a tiny toy model ~25% of its tiny step);
    a production budget is e.g. ``max_overhead=0.05``. ``None`` measures without ever shedding.

    Remedy (opt-in, observability first): ``remedy="drop_culprits"`` replaces the gradient of a
    step whose culprits were located *and verified by probes* with ∇ − ∇_C (the update as if the
    culprit tokens had been masked out of the loss); ``"skip_step"`` drops the whole update of such
    a step (every gradient set to None). Diffuse, unverified or unlocated spikes are never remedied.
    """

    job: str = "default"
    rank: int = 0
    token_stats: bool | TokenStatsMode = True  # True | False | "on_spike" (hooks only to re-run a flagged step: engine/on_spike.py)
    top_k: int = 16  # tokens kept (with per-layer breakdown) in every StepRecord
    layer_grouping: LayerGrouping = "module"
    update_ratio: UpdateRatioMode | bool = UpdateRatioMode.LEAN  # "lean" | "full" | "off" (see the class docstring)
    memory_budget_bytes: int | None = None  # None: max(2% of trainable parameter bytes, 64 MiB)
    layer_breakdown: bool = True  # keep each token's score per layer (memory: layers × tokens × 4 B)
    max_overhead: float | None = 0.5  # shed optional work above this fraction of the step's time (None: never)
    remedy: RemedyAction | None = None  # None | "drop_culprits" | "skip_step"
    history: int = 256  # StepRecords kept in Monitor.history
    distributed: DistributedMode = DistributedMode.AUTO  # "auto": an initialised torch.distributed job of > 1 rank is watched as one; "off"
    collective_timeout_s: float = 60.0  # every gradloc collective is waited on at most this long
    close_timeout_s: float = 1.0  # Monitor.close() (and interpreter exit) waits at most this long on the agent
    strict: bool = True  # wiring mistakes (shape mismatch) raise BatchMetadataError at block exit
    incident_path: str | None = None  # JSONL incident file (embedded mode)
    world_size: int = 1  # ranks in the job: the agent waits for all of them before closing an incident
    agent: str | None = None  # "host:port" of a gradloc-agent daemon: ship records there
    agent_token: str | None = field(default=None, repr=False)  # its bearer token (else $GRADLOC_AGENT_AUTH_TOKEN)
    agent_tls_ca: str | None = None  # TLS to the agent, trusting this PEM CA / certificate
    embedded: bool = True  # without an agent: run the store and exporters in-process
    store_path: str | None = None  # embedded SQLite store (None: $GRADLOC_DB or the per-user default)
    store: bool = True  # embedded mode keeps incidents in the SQLite store
    metrics_address: str | None = None  # embedded mode: serve /metrics and /api here, e.g. "127.0.0.1:9917"
    otlp_endpoint: str | None = None  # embedded mode: export metrics and traces over OTLP/gRPC
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    localizer: LocalizerConfig = field(default_factory=LocalizerConfig)
    samples: SampleConfig = field(default_factory=SampleConfig)  # per-sample outlier findings

    def __post_init__(self) -> None:
        _check(bool(self.job) and isinstance(self.job, str), "job must be a non-empty string")
        _check(self.rank >= 0, f"rank must be >= 0, got {self.rank}")
        _check(self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}")
        _check(self.world_size >= 1 and self.rank < self.world_size,
               f"need 0 <= rank < world_size, got rank {self.rank}, world_size {self.world_size}")
        for name in ("agent", "metrics_address"):
            addr = getattr(self, name)
            _check(addr is None or _is_address(addr), f"{name} must be 'host:port', got {addr!r}")
        g = self.layer_grouping
        ok = g in ("module", "parameter") or callable(g) or (isinstance(g, int) and g >= 1)
        _check(ok, f"layer_grouping must be 'module', 'parameter', an int >= 1 or a callable, got {g!r}")
        ratio = ("lean" if self.update_ratio else "off") if isinstance(self.update_ratio, bool) else self.update_ratio
        _check(ratio in UPDATE_RATIO_MODES, f"update_ratio must be one of {UPDATE_RATIO_MODES} (or a bool), got {self.update_ratio!r}")
        object.__setattr__(self, "update_ratio", UpdateRatioMode(ratio))
        _check(self.memory_budget_bytes is None or self.memory_budget_bytes >= 0,
               f"memory_budget_bytes must be >= 0, got {self.memory_budget_bytes}")
        _check(self.max_overhead is None or self.max_overhead > 0, f"max_overhead must be > 0, got {self.max_overhead}")
        _check(self.token_stats in (True, False, "on_spike"),
               f"token_stats must be True, False or 'on_spike', got {self.token_stats!r}")
        if isinstance(self.token_stats, str):
            object.__setattr__(self, "token_stats", TokenStatsMode(self.token_stats))
        _check(self.remedy is None or self.remedy in REMEDIES, f"remedy must be None or one of {REMEDIES}, got {self.remedy!r}")
        if self.remedy is not None:
            object.__setattr__(self, "remedy", RemedyAction(self.remedy))
        _check(self.remedy != "drop_culprits" or self.token_stats,
               "remedy='drop_culprits' needs token_stats=True (culprits are located from per-token statistics)")
        _check(self.history >= 1, f"history must be >= 1, got {self.history}")
        _check(self.distributed in ("auto", "off"), f"distributed must be 'auto' or 'off', got {self.distributed!r}")
        object.__setattr__(self, "distributed", DistributedMode(self.distributed))
        _check(self.collective_timeout_s > 0, f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        _check(self.close_timeout_s > 0, f"close_timeout_s must be > 0, got {self.close_timeout_s}")
        _check(isinstance(self.detector, DetectorConfig), "detector must be a DetectorConfig")
        _check(isinstance(self.localizer, LocalizerConfig), "localizer must be a LocalizerConfig")
        _check(isinstance(self.samples, SampleConfig), "samples must be a SampleConfig")


def _is_address(addr: object) -> bool:
    if not isinstance(addr, str):
        return False
    host, sep, port = addr.rpartition(":")
    return bool(sep) and port.isdigit() and int(port) <= 65535


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
