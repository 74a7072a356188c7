"""How one watched module call maps onto the micro-batch's (B, T) positions.

- Output lead (B, T), or flattened (B·T,): as it is.
- Lead (B, T, *h) for a rule whose parameters every h shares (norms applied per head: Qwen3's
  ``q_norm``/``k_norm`` on (B, T, H, D)): position (b, t) routes Σ_h of its h contributions into the
  parameter, so the rule scores the sum over h before squaring (``score_grouped``).
- Lead (1, T) for an embedding called with broadcast ids (learned absolute positions: GPT-2's
  ``wpe`` gets position ids (1, T)) while B > 1: the output is expanded to (B, T, d) (contiguous) and
  handed on in its place. The values are the ones the broadcast would have added, and the gradient
  that reaches the embedding is reduced over the batch by the same ``sum_to`` the broadcast uses, so
  training is bitwise unchanged (``tests/collector/test_fit.py``); each (b, t) now has its own
  gradient to score. Any other shape: not scorable per position (the caller drops it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gradloc.collector.rules.registry import TokenRule


@dataclass(frozen=True)
class Fit:
    x: torch.Tensor
    out: torch.Tensor
    extra: int  # position-sharing dims after (B, T) (score_grouped); 0: none
    replaced: bool  # ``out`` replaces the module's output (hand it on)


def fit_call(rule: TokenRule, module: torch.nn.Module, x: torch.Tensor, out: torch.Tensor, batch: int,
             seq: int) -> Fit | None:
    lead = rule.lead_shape(module, x, out)
    if lead == (batch, seq) or lead == (batch * seq,):
        return Fit(x=x, out=out, extra=0, replaced=False)
    if len(lead) > 2 and lead[:2] == (batch, seq) and hasattr(rule, "score_grouped"):
        return Fit(x=x, out=out, extra=len(lead) - 2, replaced=False)
    if (getattr(rule, "broadcasts", False) and batch > 1 and lead == (1, seq) and isinstance(x, torch.Tensor)
            and out.dim() == 3 and tuple(out.shape[:2]) == (1, seq)):
        wide = out.expand(batch, seq, out.shape[2]).contiguous()  # (1, T, d) -> (B, T, d)
        return Fit(x=x.expand(batch, seq), out=wide, extra=0, replaced=True)  # ids (1, T) -> (B, T)
    return None


def score(rule: TokenRule, module: torch.nn.Module, saved: object, g: torch.Tensor, extra: int) -> torch.Tensor:
    return rule.score_grouped(module, saved, g, extra) if extra else rule.score(module, saved, g)  # type: ignore[attr-defined]


__all__ = ["Fit", "fit_call", "score"]
