"""``PrecursorConfig``: the slow instabilities measured every step (records/precursors.py, collector/precursors/)."""
from __future__ import annotations

from dataclasses import dataclass

from gradloc.config.options import check


@dataclass(frozen=True)
class PrecursorConfig:
    """What precursor statistics the forward pass measures (docs/precursors.md).

    ``attention``: each attention module's max logit and entropy — from its own weights where it materialises them
    (eager), else from ``attention_queries`` query rows per sequence of scaled-dot-product attention (its T×T is
    never built: memory B·H·queries·S floats per call), every ``attention_every`` steps. ``head_logits``: the loss
    head's max |logit| (every position) and mean logsumexp² (over ``head_positions`` positions evenly spaced over the
micro-batch: a logsumexp costs an exp per logit, 10 ms per 4 M logits on one CPU thread). ``residual``: the residual stream's RMS at the final norm's input.
    ``router``: MoE routers' entropy, expert load and dead experts. ``per_head``: per-head (per-expert) values on
    the record and the metrics too — a label of bounded size (heads × layers), off by default."""

    enabled: bool = True
    attention: bool = True
    attention_queries: int = 16
    attention_every: int = 1
    head_logits: bool = True
    head_positions: int = 64  # positions per micro-batch whose logsumexp² is averaged (0: every position)
    residual: bool = True
    router: bool = True
    per_head: bool = False

    def __post_init__(self) -> None:
        for name in ("enabled", "attention", "head_logits", "residual", "router", "per_head"):
            check(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        check(isinstance(self.attention_queries, int) and 1 <= self.attention_queries <= 4096,
              f"attention_queries must be an int in [1, 4096], got {self.attention_queries!r}")
        check(isinstance(self.head_positions, int) and self.head_positions >= 0,
              f"head_positions must be an int >= 0 (0: every position), got {self.head_positions!r}")
        check(isinstance(self.attention_every, int) and self.attention_every >= 1,
              f"attention_every must be an int >= 1, got {self.attention_every!r}")


__all__ = ["PrecursorConfig"]
