"""``PrecursorConfig``: the slow instabilities measured every step (records/precursors.py, collector/precursors/)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gradloc.config.options import check


@dataclass(frozen=True)
class DriftConfig:
    """The drift detector over the precursor series (detector/drift.py, docs/precursors.md).

    Each series (statistic, layer[, head]) is judged on a log scale. After ``warmup`` steps (early training moves
    every statistic), a step is *drifting* when the median of its last ``window`` steps is ``z_threshold``
    step-to-step spreads of the ``reference`` window before them away toward the statistic's danger, by at least
    ``min_change`` (a ratio: 1.5 = 50% up, or down to 1/1.5 for a falling statistic), and the recent window trends
    that way (Kendall τ ≥ ``tau``); *oscillating* when its step-to-step spread is ``oscillation`` × the reference's
    without such a trend. ``patience`` such steps in a row open a finding; the series is quiet again after
    ``max(patience, window)`` steps in a row without its level (or swing) — no trend needed while open. A finding pages
    once it has lasted ``page_steps`` and, for ``patience`` steps in a row, a quadratic fit over the drift so far has a
    slope at its end ``page_acceleration`` × its slope at its start (a steady drift on the log scale never pages).
    ``references``: a statistic's own reference length where it differs from ``reference`` — (statistic, steps) pairs
    (or a dict): the level is compared with the median of that many values, the step-to-step spread (z's unit, the
    oscillation's yardstick) is still the last ``reference`` values' (early training, at a lower LR, swung less); by
    default the three entropies (attention, router, RL policy) are held to their last 900 values: a collapse of
    entropy is slow (×1.2–1.3 per 175 steps before a router collapse in docs/BENCHMARKS.md §8), and against 300 values
    that move along with it the ×1.5 gap never opens. ``statistics``: which series are judged (None: every one);
    ``max_series``: series judged at once (the rest are counted as ``drift_series_dropped``)."""

    enabled: bool = True
    warmup: int = 1000
    reference: int = 300
    window: int = 50
    z_threshold: float = 4.0  # chosen on replays of docs/BENCHMARKS.md §8 and §5 (6 before 2026-11-30)
    min_change: float = 1.5
    tau: float = 0.3
    oscillation: float = 4.0
    patience: int = 20
    page_steps: int = 200
    page_acceleration: float = 2.0
    references: tuple[tuple[str, int], ...] = (("attn_entropy", 900), ("router_entropy", 900), ("rl_entropy", 900))
    statistics: tuple[str, ...] | None = None
    max_series: int = 512

    def reference_of(self, statistic: str) -> int:
        """The reference length ``statistic``'s series are judged against (``references``, else ``reference``)."""
        return dict(self.references).get(statistic, self.reference)

    def __post_init__(self) -> None:
        # a dict {statistic: steps} or a list of pairs (a YAML or JSON config's) is taken as the tuple of pairs, a list
        # of statistics as the tuple
        if isinstance(self.references, Mapping) or (isinstance(self.references, list) and all(
                isinstance(p, (list, tuple)) for p in self.references)):
            items = self.references.items() if isinstance(self.references, Mapping) else self.references
            object.__setattr__(self, "references", tuple(tuple(p) for p in items))
        if isinstance(self.statistics, list):
            object.__setattr__(self, "statistics", tuple(self.statistics))
        check(isinstance(self.enabled, bool), f"drift.enabled must be a bool, got {self.enabled!r}")
        for name in ("warmup", "reference", "window", "patience", "page_steps", "max_series"):
            v = getattr(self, name)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= (0 if name == "warmup" else 1),
                  f"drift.{name} must be an int >= {0 if name == 'warmup' else 1}, got {v!r}")
        check(self.window >= 8 and self.reference >= 2 * self.window,
              f"drift.window must be >= 8 and drift.reference >= 2 × window, got {self.window}, {self.reference}")
        for name, low in (("z_threshold", 0.0), ("min_change", 1.0), ("oscillation", 1.0),
                          ("page_acceleration", 1.0)):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and v > low, f"drift.{name} must be a number > {low}, got {v!r}")
        check(isinstance(self.tau, (int, float)) and 0.0 <= self.tau < 1.0, f"drift.tau must be in [0, 1), got {self.tau!r}")
        check(isinstance(self.references, tuple) and all(
            isinstance(p, tuple) and len(p) == 2 and p[0] in STATISTICS and isinstance(p[1], int)
            and not isinstance(p[1], bool) and p[1] >= 2 * self.window for p in self.references)
            and len({p[0] for p in self.references}) == len(self.references),
            f"drift.references must be a tuple of (statistic, steps) pairs, each statistic one of {list(STATISTICS)} "
            f"once and steps an int >= 2 × window ({2 * self.window}), got {self.references!r}")
        if self.statistics is not None:
            check(isinstance(self.statistics, tuple) and all(s in STATISTICS for s in self.statistics),
                  f"drift.statistics must be None or a tuple of {list(STATISTICS)}, got {self.statistics!r}")


# the series the drift detector judges (records/precursors.py STATISTICS, which tests/config checks against this:
# config sits below records)
STATISTICS = ("attn_max_logit", "attn_entropy", "logit_max_abs", "logit_lse_sq", "residual_rms", "router_entropy",
              "expert_load_max", "dead_experts", "rl_entropy", "rl_kl_rollout", "update_ratio")


@dataclass(frozen=True)
class PrecursorConfig:
    """What precursor statistics the forward pass measures (docs/precursors.md).

    ``attention``: each attention module's max logit and entropy — from its own weights where it materialises them
    (eager), else from ``attention_queries`` query rows per sequence of scaled-dot-product attention (its T×T is
    never built: memory B·H·queries·S floats per call), in the first ``attention_micro_batches`` micro-batches of a
    step (0: every one; one is a sample of the step's sequences, as the query rows are of a sequence's, and keeps the
    cost from growing with gradient accumulation), every ``attention_every`` steps. ``head_logits``: the loss
    head's max |logit| and mean logsumexp² over ``head_positions`` positions evenly spaced over the micro-batch (every
    pass over all the logits costs a read of B·T·V floats; a logsumexp an exp per logit, 10 ms per 4 M logits on one
    CPU thread). ``residual``: the residual stream's RMS at the final norm's input.
    ``router``: MoE routers' entropy, expert load and dead experts. ``per_head``: per-head (per-expert) values on
    the record and the metrics too — a label of bounded size (heads × layers), off by default."""

    enabled: bool = True
    attention: bool = True
    attention_queries: int = 16
    attention_micro_batches: int = 1
    attention_every: int = 1
    head_logits: bool = True
    head_positions: int = 64  # positions per micro-batch the head's statistics read (0: every position)
    residual: bool = True
    router: bool = True
    per_head: bool = False
    drift: DriftConfig = field(default_factory=DriftConfig)

    def __post_init__(self) -> None:
        for name in ("enabled", "attention", "head_logits", "residual", "router", "per_head"):
            check(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        check(isinstance(self.attention_queries, int) and 1 <= self.attention_queries <= 4096,
              f"attention_queries must be an int in [1, 4096], got {self.attention_queries!r}")
        check(isinstance(self.head_positions, int) and self.head_positions >= 0,
              f"head_positions must be an int >= 0 (0: every position), got {self.head_positions!r}")
        check(isinstance(self.attention_micro_batches, int) and not isinstance(self.attention_micro_batches, bool)
              and self.attention_micro_batches >= 0,
              "attention_micro_batches must be an int >= 0 (0: every micro-batch), "
              f"got {self.attention_micro_batches!r}")
        check(isinstance(self.attention_every, int) and self.attention_every >= 1,
              f"attention_every must be an int >= 1, got {self.attention_every!r}")
        check(isinstance(self.drift, DriftConfig), f"drift must be a DriftConfig, got {type(self.drift).__name__}")


__all__ = ["DriftConfig", "PrecursorConfig"]
