"""The closed sets of string options, the checks every config runs on construction, and shared constants."""
from __future__ import annotations

import math
from enum import StrEnum
from typing import Callable, Union

from gradloc.errors import ConfigError

# "module": one layer per module that owns parameters; an int N: the first N dotted name parts;
# a callable: parameter name -> layer name.
LayerGrouping = Union[str, int, Callable[[str], str]]


def check(cond: bool, msg: str) -> None:
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


def values(kind: type[StrEnum]) -> tuple[str, ...]:
    return tuple(m.value for m in kind)


UPDATE_RATIO_MODES = values(UpdateRatioMode)  # ("lean", "full", "off")
REMEDIES = values(RemedyAction)  # ("drop_culprits", "skip_step")
MIN_MEMORY_BUDGET = 64 * 2**20  # bytes: the persistent-memory floor for small models
MEMORY_BUDGET_FRACTION = 0.02  # of the trainable parameters' bytes
MEMORY_RESERVE = 16 * 2**20  # bytes of the budget kept for gradloc's other state (history, token buffers, agent)
# "lean" copies at most 1/LEAN_SWEEP_STEPS of the parameters a step, whatever the budget allows: each layer's ratio
# every >= 4 steps. A small model under the 64 MiB floor would otherwise copy, subtract and reduce every parameter
# every step: the largest item of the per-layer monitor's time on TinyGPT (docs/BENCHMARKS.md §1)
LEAN_SWEEP_STEPS = 4


def is_address(addr: object) -> bool:
    if not isinstance(addr, str):
        return False
    host, sep, port = addr.rpartition(":")
    return bool(sep) and port.isdigit() and int(port) <= 65535


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
